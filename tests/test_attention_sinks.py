"""Attention sinks (gpt-oss): per-head logits that join the softmax denominator. The Triton kernels
against the plain-torch reference (interpreter, tiny shapes; decode with split KV, two-stage and
fused, extend with a prefix and a sliding window), the Triton backend against torch_native on the
tiny gpt-oss whose layers have two window sizes and a full layer (prefill, decode, verify), the fp32
cache keyed by (id, _version), eager and under graph replay, and torch_flash's refusal."""

from __future__ import annotations

import pytest
import torch

from plait.attention.sinks import Float32Cache
from tests.helpers import make_engine, prompt_ids

pytest.importorskip("triton")

from plait.attention.triton import kernels as K  # noqa: E402
from plait.attention.triton import reference as R  # noqa: E402

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}
# 14 tokens: longer than both windows (12 and 7), so both sliding layers drop keys from the prefill on.
PROMPTS = [prompt_ids(13, seed=3)[12]]


# --- the fp32 cache -----------------------------------------------------------------------------


def test_cache_converts_once_per_version():
    cache, sinks = Float32Cache(), torch.randn(4).bfloat16()
    first = cache.get(sinks, capturing=False)
    assert first.dtype == torch.float32 and cache.get(sinks, capturing=False) is first
    assert cache.conversions == 1


def test_cache_picks_up_an_in_place_update():
    cache, sinks = Float32Cache(), torch.nn.Parameter(torch.zeros(4).bfloat16(), requires_grad=False)
    assert cache.get(sinks, capturing=False).tolist() == [0.0] * 4
    with torch.no_grad():
        sinks.copy_(torch.full((4,), 2.0))  # a weight reloaded in place: same tensor, new _version
    assert cache.get(sinks, capturing=False).tolist() == [2.0] * 4
    assert cache.conversions == 2


def test_capture_converts_unconditionally():
    cache, sinks = Float32Cache(), torch.randn(4).bfloat16()
    cached = cache.get(sinks, capturing=False)
    captured = cache.get(sinks, capturing=True)
    assert captured is not cached and torch.equal(captured, cached)
    assert cache.get(sinks, capturing=True) is not captured
    assert cache.conversions == 3


def test_float32_sinks_are_read_directly():
    cache, sinks = Float32Cache(), torch.randn(4)
    assert cache.get(sinks, capturing=False) is sinks and cache.conversions == 0


# --- the kernels ----------------------------------------------------------------------------------


def _paged(lens: list[int], hkv: int, d: int, gen: torch.Generator):
    slots = torch.randperm(sum(lens) + 9, generator=gen).to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    k_buf, v_buf = torch.randn(slots.numel(), hkv, d, generator=gen), torch.randn(slots.numel(), hkv, d, generator=gen)
    return indptr, slots[: sum(lens)], k_buf, v_buf


@pytest.mark.parametrize("pack", [1, 2], ids=["head-per-program", "two-heads-per-program"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-merge", "two-stage"])
def test_decode_kernel_with_sinks_matches_reference(fused, pack):
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, lens = 4, 2, 16, [3, 40, 17]
    indptr, indices, k_buf, v_buf = _paged(lens, hkv, d, gen)
    q, sinks = torch.randn(3, hq, d, generator=gen), torch.randn(hq, generator=gen) * 3
    o, o_ref = torch.empty(3, hq, d), torch.empty(3, hq, d)
    logits, lse = torch.empty(3, hq, 4, d), torch.empty(3, hq, 4)
    splits = torch.tensor([1, 3, 2], dtype=torch.int32)
    counters = torch.zeros(3 * hkv, dtype=torch.int32) if fused else None
    K.decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, logits, lse, splits, 4, d**-0.5,
                           split_counters=counters, sinks=sinks,
                           config=K.LaunchConfig(block_n=16, num_warps=4, num_stages=1, kv_pack=pack))
    R.decode_attention_fwd(q, k_buf, v_buf, o_ref, indptr, indices, logits, lse, splits, 4, d**-0.5, sinks=sinks)
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
    plain = torch.empty_like(o)
    R.decode_attention_fwd(q, k_buf, v_buf, plain, indptr, indices, logits, lse, splits, 4, d**-0.5)
    assert not torch.allclose(o, plain, atol=1e-3), "the sinks changed nothing"


def test_extend_kernel_with_sinks_and_window_matches_reference():
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, pre, ext = 4, 2, 16, [0, 21], [19, 7]
    indptr, indices, k_buf, v_buf = _paged(pre, hkv, d, gen)
    q, k, v = (torch.randn(sum(ext), h, d, generator=gen) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen) * 3
    qo = torch.tensor([0, ext[0], sum(ext)], dtype=torch.int32)
    o, o_ref = torch.empty(sum(ext), hq, d), torch.empty(sum(ext), hq, d)
    args = (qo, indptr, indices, None, None, max(ext), d**-0.5)
    K.extend_attention_fwd(q, k, v, o, k_buf, v_buf, *args, sliding_window=12, sinks=sinks)
    R.extend_attention_fwd(q, k, v, o_ref, k_buf, v_buf, *args, sliding_window=12, sinks=sinks)
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)


# --- the backends on a tiny gpt-oss with two window sizes ----------------------------------------

# Layer 0 slides over 12 keys (the checkpoint's window), layer 1 is full, layer 2 slides over 7: no
# checkpoint format gives layers different window sizes, so the models are built with layer 2's
# window patched in (torch_native and triton alike).
WINDOWS = (12, None, 7)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from plait.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gpt-oss-3"), "gpt-oss", seed=0, num_hidden_layers=3,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="module", autouse=True)
def two_window_sizes():
    import plait.models.llama as llama

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama, "sliding_window_of", lambda cfg, layer_id: WINDOWS[layer_id])
        yield


@pytest.fixture(scope="module")
def native_tokens(gpt_oss):
    with make_engine(gpt_oss, max_total_tokens=256) as engine:
        assert [m.self_attn.attn.sliding_window for m in engine.runner.model.model.layers] == list(WINDOWS)
        return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def test_triton_prefill_decode_and_verify_with_sinks_and_two_window_sizes_equal_torch_native(gpt_oss,
                                                                                          native_tokens):
    spec = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1}
    with make_engine(gpt_oss, attention_backend="triton", max_total_tokens=256, **spec) as engine:
        assert engine.runner.attn_backend.sliding_windows == (7, 12)
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == native_tokens
        verified = engine.scheduler.spec_worker.stats.verify_steps
        again = engine.generate(PROMPTS, GREEDY)  # the n-gram cache now holds the answers: drafts verify
        assert [o.token_ids for o in again] == native_tokens
        assert engine.scheduler.spec_worker.stats.verify_steps > verified


def test_graph_replay_reads_sinks_updated_in_place(gpt_oss, monkeypatch):
    """Under graph replay (PLAIT_CPU_GRAPHS=1: the graph runners over the eager stand-in) with bf16
    sinks: after an in-place update the replayed decode (triton, both windows' static plans) equals
    torch_native given the same update, and each layer converted its sinks once more, not once per
    step. (Both engines keep the prompt's KV from before the update in their radix caches.)"""
    def bf16_sinks(engine):
        layers = [m.self_attn.attn for m in engine.runner.model.model.layers]
        for attn in layers:
            attn.sinks = torch.nn.Parameter(attn.sinks.detach().bfloat16(), requires_grad=False)
        return layers

    def update(layers):
        with torch.no_grad():
            for attn in layers:
                attn.sinks.fill_(5.0)  # sinks that take most of the attention mass

    with make_engine(gpt_oss, max_total_tokens=256) as eager:
        layers = bf16_sinks(eager)
        before = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
        update(layers)
        expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    assert expected != before, "the update changed nothing"
    monkeypatch.setenv("PLAIT_CPU_GRAPHS", "1")
    with make_engine(gpt_oss, attention_backend="triton", max_total_tokens=256, cuda_graph_max_bs=1) as engine:
        graphs = engine.runner.graph_runner
        assert graphs is not None and len(graphs.graphs) == 1
        layers = bf16_sinks(engine)
        engine.generate(PROMPTS, {**GREEDY, "max_new_tokens": 2})  # the prompt's KV, one replayed step
        cache = engine.runner.attn_backend.sinks_fp32
        converted = cache.conversions
        replays = sum(g.replays for g in graphs.graphs.values())
        update(layers)
        after = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        assert sum(g.replays for g in graphs.graphs.values()) > replays, "decode did not replay graphs"
        assert after == expected
        assert cache.conversions - converted == len(layers)


def test_torch_flash_refuses_sink_models_naming_itself(gpt_oss):
    with pytest.raises(ValueError, match="attention backend 'torch_flash' does not support attention sinks"):
        make_engine(gpt_oss, attention_backend="torch_flash")
