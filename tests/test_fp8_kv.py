"""FP8 KV cache (--kv-cache-dtype): the pool stores FP8 with per-layer checkpoint scales, every
backend reads it, its capacity doubles, and scheduling events (chunked prefill, prefix reuse,
retraction) change no output of an FP8-KV engine."""

from __future__ import annotations

import pytest
import torch

import plait
from plait.config import EngineConfig
from plait.executor.sizing import kv_capacity_tokens
from plait.mem.pools import MHATokenToKVPool, kv_cache_dtype
from plait.models.loader import load_model_config
from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids
from tests.quant_helpers import plait_teacher_forced, write_fp8_checkpoint

PROMPTS = prompt_ids(6)  # 3 to 20 tokens
PARAMS = {**GREEDY, "max_new_tokens": 16}
FP8_KV = {"kv_cache_dtype": "fp8_e4m3"}


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def fp8_reference(model_path) -> list[list[int]]:
    """The FP8-KV engine's own greedy tokens, without chunking, prefix hits or retraction."""
    engine = make_engine(model_path, disable_radix_cache=True, **FP8_KV)
    outs = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    engine.shutdown()
    return outs


def test_config_rejects_an_unknown_kv_cache_dtype_naming_the_field():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\)"):
        EngineConfig(model="x", kv_cache_dtype="int8")


def test_fp8_is_the_alias_of_fp8_e4m3():
    assert kv_cache_dtype("fp8", torch.bfloat16) == kv_cache_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_fp8_kv_cache_doubles_the_capacity_of_a_bf16_model(model_path):
    mc = load_model_config(str(model_path), "bfloat16")
    auto = kv_capacity_tokens(EngineConfig(model=str(model_path)), mc, "cpu")
    fp8 = kv_capacity_tokens(EngineConfig(model=str(model_path), kv_cache_dtype="fp8"), mc, "cpu")
    assert fp8 == 2 * auto


def test_pool_stores_values_over_their_scale_saturated():
    pool = MHATokenToKVPool(8, torch.float8_e4m3fn, 1, 1, 4, "cpu", k_scales=[2.0], v_scales=[0.5])
    k = torch.tensor([[[1.0, -3.0, 2000.0, 0.1]]])
    v = torch.tensor([[[1.0, -3.0, 100.0, 0.1]]])
    pool.set_kv_buffer(0, torch.tensor([3]), k, v)
    assert pool.k_buffer[0].dtype == torch.float8_e4m3fn
    stored_k = pool.k_buffer[0][3].float()
    assert stored_k.tolist() == [[0.5, -1.5, 448.0, 0.05078125]]  # k / 2, 1000 saturated to 448
    # v / 0.5 = 200 rounds to 192 in e4m3 (step 16 there): read back 96
    assert pool.dequantize(pool.v_buffer[0][3], 0.5, torch.float32).tolist() == [[1.0, -3.0, 96.0, 0.1015625]]


def test_checkpoint_kv_scales_reach_the_fp8_pool_and_only_it(model_path, tmp_path):
    path = write_fp8_checkpoint(model_path, tmp_path / "ckpt", "ct-channel", kv_scales={0: (0.5, 0.25), 1: (2.0, 4.0)})
    fp8 = plait.Engine(model=str(path), max_total_tokens=128, **FP8_KV)
    assert fp8.runner.kv_pool.k_scales == [0.5, 2.0] and fp8.runner.kv_pool.v_scales == [0.25, 4.0]
    out = fp8.generate(PROMPTS[0], {**PARAMS, "max_new_tokens": 4})
    fp8.shutdown()
    auto = plait.Engine(model=str(path), max_total_tokens=128)
    assert auto.runner.kv_pool.k_scales == [1.0, 1.0]  # a model-dtype pool ignores them
    auto.shutdown()
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("backend", ["triton", "torch_flash"])
def test_every_backend_reads_the_fp8_cache_as_torch_native_does(one_layer, backend):
    from plait.attention.torch_flash import TorchFlashAttnBackend

    ids = list(range(5, 29))
    logits = {}
    for name in ("torch_native", backend):
        engine = plait.Engine(model=str(one_layer), attention_backend="triton" if name == "triton" else "torch_native",
                              max_total_tokens=128, **FP8_KV)
        if name == "torch_flash":  # its SDPA path runs on the CPU; the registry refuses it there
            runner = engine.runner
            runner.attn_backend = TorchFlashAttnBackend(runner.req_to_token_pool, runner.kv_pool)
        logits[name] = plait_teacher_forced(engine, ids, chunk=8)  # later chunks read earlier ones from the cache
        engine.shutdown()
    torch.testing.assert_close(logits[backend], logits["torch_native"], rtol=1e-4, atol=1e-4)


def test_fp8_kv_changes_the_logits(one_layer):
    ids = list(range(5, 29))
    out = {}
    for kv in ("auto", "fp8_e4m3"):
        engine = plait.Engine(model=str(one_layer), max_total_tokens=128, kv_cache_dtype=kv)
        out[kv] = plait_teacher_forced(engine, ids, chunk=8)
        engine.shutdown()
    diff = float((out["auto"] - out["fp8_e4m3"]).abs().max() / out["auto"].abs().max())
    assert 1e-4 < diff < 0.25  # measured 0.11 of the largest logit on this random layer


def test_chunked_prefill_with_fp8_kv_keeps_outputs(model_path, fp8_reference):
    engine = make_engine(model_path, chunked_prefill_size=4, disable_radix_cache=True, **FP8_KV)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == fp8_reference
    assert_no_leaks(engine)


def test_prefix_reuse_with_fp8_kv_keeps_outputs(model_path, fp8_reference):
    engine = make_engine(model_path, **FP8_KV)
    engine.generate(PROMPTS, PARAMS)
    again = engine.generate(PROMPTS, PARAMS)
    assert all(o.meta_info["cached_tokens"] > 0 for o in again)
    assert [o.token_ids for o in again] == fp8_reference
    assert_no_leaks(engine)


def test_retraction_with_fp8_kv_keeps_outputs(model_path, fp8_reference):
    # 6 requests need up to 56 + 6 * 16 tokens; 64 slots cannot hold them all at once.
    engine = make_engine(model_path, max_total_tokens=64, disable_radix_cache=True, **FP8_KV)
    outs = engine.generate(PROMPTS, PARAMS)
    assert engine.scheduler.stats.num_retractions >= 1
    assert [o.token_ids for o in outs] == fp8_reference
    assert_no_leaks(engine)
