"""torch_flash on the CPU: its planning and attention routine (the SDPA path, fp32) against torch_native,
the start-up error where it cannot run, the varlen_attn signature adapter, and its registry entries.
The CUDA kernels themselves (batched flash SDPA, varlen_attn) are covered by tests/gpu/."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import plait.attention.torch_flash as tf
from plait.attention.hybrid import HybridAttnBackend
from plait.attention.registry import build_backend, create_attention_backend, registered_backends
from plait.attention.torch_flash import TorchFlashAttnBackend, VarlenKernel, plan_extend
from plait.attention.torch_native import TorchNativeAttnBackend
from plait.config import EngineConfig
from plait.forward_batch import ForwardMode
from tests.attn_cases import extend_batch, layer, make_pools, random_tree_mask, run
from tests.helpers import GREEDY, make_engine, prompt_ids

HEADS = [(4, 4), (8, 2)]  # GQA ratios 1 and 4
TOL = dict(atol=1e-4, rtol=1e-4)


def backends(hq: int, hkv: int, d: int, seed: int = 0, window: int | None = None, path: str = "auto"):
    pool, kv, g = make_pools(hkv, d, seed)
    return TorchNativeAttnBackend(pool, kv), TorchFlashAttnBackend(pool, kv, path, sliding_window=window), pool, g


def qkv(t: int, hq: int, hkv: int, d: int, g: torch.Generator):
    return (torch.randn(t, hq * d, generator=g), torch.randn(t, hkv * d, generator=g),
            torch.randn(t, hkv * d, generator=g))


# --- the attention routine against torch_native --------------------------------------------------


@pytest.mark.parametrize(("hq", "hkv"), HEADS, ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(("prefix", "ext"), [
    ([0, 0, 0], [6, 6, 6]),  # one packed group, tokens in order
    ([0, 5, 17, 0, 0], [7, 3, 9, 7, 4]),  # ragged: prefixes, a split same-length group, a singleton
    ([3, 40], [1, 12]),  # every request over a cached prefix
], ids=["packed", "ragged", "prefixed"])
def test_extend_matches_torch_native(hq, hkv, d, prefix, ext):
    native, flash, pool, g = backends(hq, hkv, d)
    fb = extend_batch(pool, g, prefix, ext)
    q, k, v = qkv(fb.num_tokens, hq, hkv, d, g)
    torch.testing.assert_close(run(flash, fb, q, k, v, layer(hq, hkv, d)), run(native, fb, q, k, v, layer(hq, hkv, d)),
                               **TOL)


def test_extend_without_saving_kv_reads_the_new_tokens_from_the_call():
    native, flash, pool, g = backends(8, 2, 64)
    fb = extend_batch(pool, g, [4, 0], [5, 5])
    q, k, v = qkv(fb.num_tokens, 8, 2, 64, g)
    lay = layer(8, 2, 64)
    for be in (native, flash):
        be.init_forward_metadata(fb)
        fb.reset_forward_metadata_marker()
    torch.testing.assert_close(flash.forward(q, k, v, lay, fb, save_kv_cache=False),
                               native.forward(q, k, v, lay, fb, save_kv_cache=False), **TOL)


@pytest.mark.parametrize("window", [4, 9])
def test_sliding_window_extend_and_decode_match_torch_native(window):
    native, flash, pool, g = backends(8, 2, 64, seed=3, window=window)
    lay = layer(8, 2, 64, window)
    fb = extend_batch(pool, g, [0, 6, 20, 0], [13, 5, 7, 13])
    q, k, v = qkv(fb.num_tokens, 8, 2, 64, g)
    torch.testing.assert_close(run(flash, fb, q, k, v, lay), run(native, fb, q, k, v, lay), **TOL)
    dec = extend_batch(pool, g, [3, 15, 40], [1, 1, 1])
    dec.forward_mode = ForwardMode.DECODE
    q, k, v = qkv(3, 8, 2, 64, g)
    torch.testing.assert_close(run(flash, dec, q, k, v, lay), run(native, dec, q, k, v, lay), **TOL)


@pytest.mark.parametrize(("hq", "hkv"), HEADS, ids=["gqa1", "gqa4"])
def test_decode_matches_torch_native(hq, hkv):
    native, flash, pool, g = backends(hq, hkv, 128, seed=1)
    fb = extend_batch(pool, g, [4, 30, 70], [1, 1, 1])
    fb.forward_mode = ForwardMode.DECODE
    q, k, v = qkv(3, hq, hkv, 128, g)
    torch.testing.assert_close(run(flash, fb, q, k, v, layer(hq, hkv, 128)),
                               run(native, fb, q, k, v, layer(hq, hkv, 128)), **TOL)


def test_tree_mask_verify_matches_torch_native():
    native, flash, pool, g = backends(8, 2, 64, seed=2)
    prefix, ext = [6, 11], [4, 3]
    fb = extend_batch(pool, g, prefix, ext)
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    fb.spec_info = SimpleNamespace(custom_mask=random_tree_mask(prefix, ext, g))
    q, k, v = qkv(fb.num_tokens, 8, 2, 64, g)
    torch.testing.assert_close(run(flash, fb, q, k, v, layer(8, 2, 64)), run(native, fb, q, k, v, layer(8, 2, 64)),
                               **TOL)


def test_logit_capped_layers_match_torch_native():
    native, flash, pool, g = backends(8, 2, 64, seed=4)
    lay = layer(8, 2, 64, logit_cap=5.0)
    fb = extend_batch(pool, g, [0, 9], [6, 4])
    q, k, v = qkv(fb.num_tokens, 8, 2, 64, g)
    torch.testing.assert_close(run(flash, fb, q, k, v, lay), run(native, fb, q, k, v, lay), **TOL)


# --- planning ------------------------------------------------------------------------------------


def test_plan_packs_equal_length_no_prefix_requests_in_place():
    plan = plan_extend([6, 6, 6], [0, 0, 0], [2, 3, 4], None, torch.device("cpu"), pack=True, want_everything=False)
    assert [(g.length, g.count, g.token_start) for g in plan.packed] == [(6, 3, 0)]
    assert plan.rest is None


def test_plan_sends_prefixed_requests_to_the_gathered_rest():
    plan = plan_extend([7, 3, 7], [0, 5, 0], [2, 3, 4], None, torch.device("cpu"), pack=True, want_everything=False)
    assert [(g.length, g.count, g.token_start) for g in plan.packed] == [(7, 2, None)]
    assert plan.packed[0].q_src.tolist() == list(range(7)) + list(range(10, 17))
    assert plan.rest is not None and plan.rest.q_src.tolist() == [7, 8, 9]
    assert plan.rest.cu_k.tolist() == [0, 8] and plan.rest.prefix_dst.tolist() == [0, 1, 2, 3, 4]


def test_plan_never_packs_a_tree_batch():
    tree = torch.ones(2 * 2 + 3 * 3, dtype=torch.bool)
    plan = plan_extend([2, 3], [0, 0], [2, 3], tree, torch.device("cpu"), pack=True, want_everything=True)
    assert plan.packed == [] and plan.rest is not None and plan.everything is None
    assert [m.numel() for m in plan.rest.masks] == [4, 9]


# --- where it cannot run, and the varlen_attn signature adapter ----------------------------------


def test_packed_causal_sdpa_leaves_cudnn_out_by_default():
    """cuDNN's attention plans per new shape on the request path; the packed call takes FlashAttention-2 only
    (tests/gpu checks which kernel runs)."""
    assert tf.PACKED_SDPA_BACKENDS == (torch.nn.attention.SDPBackend.FLASH_ATTENTION,)


@pytest.mark.parametrize(("capability", "head_dim", "fits"), [
    ((9, 0), 128, True), ((8, 0), 64, True), ((12, 0), 256, True),
    ((7, 5), 128, False),  # Turing: no FlashAttention-2
    ((9, 0), 512, False), ((9, 0), 100, False),  # over 256, not a multiple of 8
])
def test_flash_attention_fits_sm80_and_newer_at_head_dims_up_to_256(capability, head_dim, fits):
    assert tf.flash_attention_fits(capability, head_dim) is fits
    assert tf.flash_attention_fits(capability) is (capability >= (8, 0))


def test_start_on_the_cpu_fails_naming_the_backends_that_run_here():
    pool, kv, _ = make_pools(2, 64)
    with pytest.raises(ValueError, match="torch_native.*triton"):
        build_backend("torch_flash", pool, kv, 8)


def test_varlen_path_on_the_cpu_is_refused():
    pool, kv, _ = make_pools(2, 64)
    with pytest.raises(ValueError, match="varlen"):
        TorchFlashAttnBackend(pool, kv, "varlen")


def test_decode_refuses_cuda_graphs_and_names_the_pair_that_works():
    _, flash, _, _ = backends(8, 2, 64)
    with pytest.raises(RuntimeError, match="--decode-attention-backend triton"):
        flash.init_cuda_graph_state(8, 8)


def test_varlen_adapter_asks_the_new_signature_for_a_window_and_native_gqa():
    seen = {}
    kernel = VarlenKernel(lambda *a, **kw: seen.update(kw) or a[0], has_window=True, has_gqa=True, has_scale=True)
    q, k = torch.zeros(3, 8, 4), torch.zeros(3, 2, 4)
    kernel(q, k, k, None, None, 3, 3, 0.5, window=16)
    assert seen == {"scale": 0.5, "window_size": (15, 0), "enable_gqa": True}


def test_varlen_adapter_asks_the_old_signature_for_causal_with_repeated_kv():
    seen = {}

    def old(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        seen.update(is_causal=is_causal, kv_heads=k.shape[1])
        return q

    kernel = VarlenKernel(old, has_window=False, has_gqa=False, has_scale=False)
    kernel(torch.zeros(3, 8, 4), torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), None, None, 3, 3, 0.5, window=None)
    assert seen == {"is_causal": True, "kv_heads": 8}


def test_detects_this_torch_varlen_signature():
    kernel = tf.detect_varlen_kernel()
    assert kernel is None or kernel.has_window or not kernel.has_gqa


# --- registry and selection ----------------------------------------------------------------------


def test_registry_lists_torch_flash_and_auto():
    assert {"torch_flash", "auto", "torch_native", "triton"} <= set(registered_backends())


def test_auto_leaf_is_named_by_what_it_built_on_the_cpu():
    pool, kv, _ = make_pools(2, 64)
    assert build_backend("auto", pool, kv, 8).name == "torch_native"


@pytest.mark.parametrize(("options", "device", "pair"), [
    ({}, "cpu", ("torch_native", "torch_native")),
    ({"attention_backend": "auto"}, "cuda", ("triton", "triton")),
    ({"prefill_attention_backend": "torch_flash"}, "cuda", ("torch_flash", "triton")),
    ({"attention_backend": "torch_flash", "decode_attention_backend": "triton"}, "cuda", ("torch_flash", "triton")),
    ({"attention_backend": "torch_flash", "decode_attention_backend": "auto"}, "cuda", ("torch_flash", "triton")),
])
def test_config_pairs_resolve_auto_per_device(options, device, pair):
    assert EngineConfig(model="x", device=device, **options).attention_backends() == pair


def test_config_accepts_torch_flash_on_every_flag():
    cfg = EngineConfig(model="x", attention_backend="torch_flash", prefill_attention_backend="torch_flash",
                       decode_attention_backend="torch_flash")
    assert cfg.prefill_attention_backend == "torch_flash"


def test_hybrid_pair_of_torch_flash_prefill_and_native_decode_matches_native():
    native, flash, pool, g = backends(8, 2, 64, seed=5)
    hybrid = HybridAttnBackend(flash, TorchNativeAttnBackend(pool, native.kv_pool))
    fb = extend_batch(pool, g, [0, 7], [9, 4])
    q, k, v = qkv(fb.num_tokens, 8, 2, 64, g)
    torch.testing.assert_close(run(hybrid, fb, q, k, v, layer(8, 2, 64)), run(native, fb, q, k, v, layer(8, 2, 64)),
                               **TOL)


# --- end to end on the CPU, with the device check lifted ------------------------------------------


@pytest.fixture
def flash_runs_here(monkeypatch):
    """Lift the CUDA check so the engine builds torch_flash over the CPU (its SDPA path)."""
    monkeypatch.setattr(tf, "unavailable_reason", lambda device: None)


@pytest.mark.parametrize("pair", [("torch_flash", "torch_flash"), ("torch_flash", "torch_native")],
                         ids=["single", "hybrid"])
def test_engine_greedy_output_equals_torch_native(tiny_model_dir, flash_runs_here, pair):
    prompts = prompt_ids(6)
    ref = make_engine(tiny_model_dir("llama"), attention_backend="torch_native")
    expected = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    ref.shutdown()
    engine = make_engine(tiny_model_dir("llama"), prefill_attention_backend=pair[0],
                         decode_attention_backend=pair[1])
    assert engine.runner.attn_backend.name.startswith("torch_flash" if pair[1] == "torch_flash" else "hybrid")
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    engine.shutdown()
    assert got == expected


def test_create_attention_backend_builds_the_hybrid_pair(flash_runs_here):
    pool, kv, _ = make_pools(2, 64)
    backend = create_attention_backend(("torch_flash", "torch_native"), pool, kv, 8)
    assert backend.name == "hybrid(prefill=torch_flash,decode=torch_native)"
