"""Fused GPU layer kernels against their torch references (Triton interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

triton_ops = pytest.importorskip("plait.layers.triton_ops")

from plait.layers.activation import SiluAndMul  # noqa: E402
from plait.layers.norm import RMSNorm  # noqa: E402
from plait.layers.rotary import RotaryEmbedding  # noqa: E402


@pytest.mark.parametrize("hidden", [64, 200])
def test_rmsnorm_matches_reference(hidden):
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(5, hidden)
    torch.testing.assert_close(triton_ops.rmsnorm(x, norm.weight, 1e-5), norm.forward_native(x), atol=1e-5, rtol=1e-5)


def test_rmsnorm_with_residual_returns_norm_and_sum():
    norm = RMSNorm(128, eps=1e-6)
    x, r = torch.randn(3, 128), torch.randn(3, 128)
    y, s = triton_ops.rmsnorm(x, norm.weight, 1e-6, r)
    y_ref, s_ref = norm.forward_native(x, r)
    torch.testing.assert_close(s, s_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_matches_reference():
    x = torch.randn(4, 2 * 1500)
    torch.testing.assert_close(triton_ops.silu_and_mul(x), SiluAndMul().forward_native(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("head_dim", "hq", "hkv"), [(64, 4, 2), (128, 8, 1)])
def test_rotary_matches_reference_on_strided_views(head_dim, hq, hkv):
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    qkv = torch.randn(6, (hq + 2 * hkv) * head_dim)
    q, k, _ = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    pos = torch.tensor([0, 3, 7, 9, 30, 63])
    q_ref, k_ref = rope.forward_native(pos, q.clone(), k.clone())
    q_out, k_out = triton_ops.rotary_(pos, q, k, rope.cos_sin_cache, head_dim)
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("bs", "vocab"), [(1, 10000), (3, 4096), (2, 17)])
def test_argmax_matches_torch_argmax(bs, vocab):
    x = torch.randn(bs, vocab)
    assert torch.equal(triton_ops.argmax(x), torch.argmax(x, dim=-1))


def test_argmax_takes_the_first_of_tied_maxima_across_blocks():
    x = torch.zeros(2, 3 * triton_ops.ARGMAX_BLOCK)
    x[0, [5000, 9000]] = 7.0  # two blocks, same value: the earlier block wins
    x[1, [4097, 4098]] = 3.0  # inside one block: the earlier index wins
    assert triton_ops.argmax(x).tolist() == [5000, 4097]


def test_rotary_with_kv_store_writes_the_rotated_keys_and_the_values_at_loc():
    head_dim, hq, hkv, t = 64, 4, 2, 5
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    q, k, v = torch.randn(t, hq * head_dim), torch.randn(t, hkv * head_dim), torch.randn(t, hkv * head_dim)
    pos, loc = torch.tensor([0, 3, 7, 9, 30]), torch.tensor([11, 2, 7, 5, 13])
    k_cache, v_cache = torch.zeros(16, hkv, head_dim), torch.zeros(16, hkv, head_dim)
    q_ref, k_ref = rope.forward_native(pos, q.clone(), k.clone())
    q_out, k_out = triton_ops.rotary_(pos, q, k, rope.cos_sin_cache, head_dim, (v, k_cache, v_cache, loc))
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache[loc], k_ref.view(t, hkv, head_dim), atol=1e-5, rtol=1e-5)
    assert torch.equal(v_cache[loc], v.view(t, hkv, head_dim))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[loc] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_native_rotary_with_kv_store_matches_the_kernel():
    head_dim, hkv = 64, 2
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    q, k, v = torch.randn(3, 4 * head_dim), torch.randn(3, hkv * head_dim), torch.randn(3, hkv * head_dim)
    pos, loc = torch.tensor([1, 2, 40]), torch.tensor([4, 0, 6])
    caches = [torch.zeros(8, hkv, head_dim) for _ in range(4)]
    rope.forward(pos, q.clone(), k.clone(), kv_store=(v, caches[0], caches[1], loc))  # CPU: torch path
    triton_ops.rotary_(pos, q.clone(), k.clone(), rope.cos_sin_cache, head_dim, (v, caches[2], caches[3], loc))
    torch.testing.assert_close(caches[0], caches[2], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[1], caches[3])


def _rotary_case(head_dim: int, hq: int, hkv: int, qk_norm: bool, seed: int):
    """Three tokens at positions out of order, their q, k, v rows, cache slots and (with ``qk_norm``)
    Qwen3's q/k norm; the generator, for more inputs."""
    from plait.layers.rotary import QKNorm

    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, h * head_dim, generator=g) for h in (hq, hkv, hkv))
    wq, wk = 1 + torch.randn(head_dim, generator=g), 1 + torch.randn(head_dim, generator=g)
    norm = QKNorm(wq, wk, 1e-6) if qk_norm else None
    return rope, q, k, v, norm, torch.tensor([5, 0, 37]), torch.tensor([6, 1, 3]), g


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm-and-rope"])
def test_rotary_split_over_head_blocks_equals_one_program_per_token(monkeypatch, qk_norm):
    # 6 query and 2 key heads in blocks of 4: a partial q block and a partial k block, whose programs
    # also store K and V; every value the same as the launch that gives a token's heads to one program.
    head_dim, hq, hkv, t = 16, 6, 2, 3
    monkeypatch.setenv("PLAIT_ROTARY_SPLIT_HEADS", "4")  # the default splits only heads of 128 and more
    assert triton_ops.rotary_heads_per_program(t, hq, hkv, num_sms=8, head_dim=head_dim) == 4
    rope, q, k, v, norm, pos, loc, _ = _rotary_case(head_dim, hq, hkv, qk_norm, seed=3)
    caches = [torch.zeros(8, hkv, head_dim) for _ in range(4)]
    split = triton_ops.rotary_(pos, q.clone(), k.clone(), rope.cos_sin_cache, head_dim,
                               (v, caches[0], caches[1], loc), norm)
    monkeypatch.setenv("PLAIT_ROTARY_SPLIT_HEADS", "0")
    assert triton_ops.rotary_heads_per_program(t, hq, hkv, num_sms=8, head_dim=head_dim) == 8
    whole = triton_ops.rotary_(pos, q.clone(), k.clone(), rope.cos_sin_cache, head_dim,
                               (v, caches[2], caches[3], loc), norm)
    assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0][loc].abs().sum() > 0 and torch.equal(caches[1][loc], v.view(t, hkv, head_dim))


def test_rotary_splits_heads_of_128_and_keeps_narrower_heads_whole_by_default():
    assert triton_ops.rotary_heads_per_program(1, 32, 4, num_sms=132, head_dim=128) == triton_ops.ROTARY_SPLIT_HEADS
    assert triton_ops.rotary_heads_per_program(1, 32, 8, num_sms=132, head_dim=64) == 32


def test_rotary_keeps_one_program_per_token_once_the_split_grid_would_exceed_four_programs_per_sm(monkeypatch):
    # 6 + 2 heads in blocks of 4 are 3 programs a token: 10 tokens on 8 SMs are 30 programs (split),
    # 11 tokens 33 (> 32: one program per token).
    assert triton_ops.rotary_heads_per_program(10, 6, 2, num_sms=8, head_dim=128) == 4
    assert triton_ops.rotary_heads_per_program(11, 6, 2, num_sms=8, head_dim=128) == 8
    monkeypatch.setenv("PLAIT_ROTARY_SPLIT_HEADS", "2")
    assert triton_ops.rotary_heads_per_program(1, 6, 2, num_sms=8, head_dim=128) == 2


def test_pdl_preload_moves_only_the_step_constant_loads_before_the_wait():
    """The sm_90 build (the interpreter has no PDL): with PRELOAD the RMSNorm kernel loads its weight, the
    rotary kernel its position, cos / sin, cache slot and norm weights and decode attention its split
    layout and first slots before the grid-dependency wait, the rest after it; without PRELOAD nothing
    comes before the wait (plait/layers/pdl.py)."""
    from tests.layer_ops_aot import compile_in_subprocess

    cases = [("rmsnorm", False), ("rmsnorm", True), ("rotary", False), ("rotary", True), ("decode", False),
             ("decode", True)]
    norm, norm_pre, rot, rot_pre, dec, dec_pre = compile_in_subprocess(cases)
    assert dec["loads_before_wait"] == 0 and dec_pre["loads_before_wait"] > 0  # the split layout, first slots
    assert dec_pre["loads_before_wait"] + dec_pre["loads_after_wait"] == dec["loads_after_wait"]
    assert norm["loads_before_wait"] == rot["loads_before_wait"] == 0
    total = norm["loads_after_wait"]
    assert norm_pre["loads_before_wait"] == total // 3  # the weight's share of x, residual and weight
    assert norm_pre["loads_before_wait"] + norm_pre["loads_after_wait"] == total
    assert 0 < rot_pre["loads_before_wait"] < rot["loads_after_wait"]
    assert rot_pre["loads_before_wait"] + rot_pre["loads_after_wait"] == rot["loads_after_wait"]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm-and-rope"])
def test_rotary_and_rmsnorm_with_their_inputs_loaded_before_the_pdl_wait_compute_the_same(monkeypatch, qk_norm):
    # PLAIT_PDL_PRELOAD moves loads, not arithmetic: every value equals the launch without it (the
    # interpreter has no PDL: the same code, the loads in the new order).
    head_dim, hq, hkv, t = 128, 6, 2, 3
    rope, q, k, v, norm, pos, loc, g = _rotary_case(head_dim, hq, hkv, qk_norm, seed=4)
    x, r, w = torch.randn(t, 200, generator=g), torch.randn(t, 200, generator=g), torch.randn(200, generator=g)
    runs = []
    for preload in ("0", "1"):
        monkeypatch.setenv("PLAIT_PDL_PRELOAD", preload)
        caches = [torch.zeros(8, hkv, head_dim) for _ in range(2)]
        rq, rk = triton_ops.rotary_(pos, q.clone(), k.clone(), rope.cos_sin_cache, head_dim,
                                    (v, caches[0], caches[1], loc), norm)
        runs.append((rq, rk, *caches, *triton_ops.rmsnorm(x, w, 1e-6, r)))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_every_variant_of_the_rotary_rmsnorm_decode_and_moe_down_kernels_builds_for_sm90():
    """The interpreter accepts code the GPU compiler refuses (a helper returning two shapes): each
    constexpr combination these kernels launch with, built for an H200 with the wheel's ptxas."""
    import itertools

    from tests.layer_ops_aot import compile_in_subprocess

    cases = [("rotary", pre, {"STORE": store, "QK_NORM": qk, "BLOCK_H": bh})
             for pre, store, qk, bh in itertools.product((False, True), (False, True), (False, True), (4, 32))]
    cases += [("rmsnorm", pre, {"HAS_RESIDUAL": res}) for pre, res in itertools.product((False, True), (False, True))]
    cases += [("decode", pre, {"KV_PACK": pack, "BLOCK_N": 64 if pack == 2 else 128, "HAS_SINKS": sinks,
                               "FUSED_REDUCE": fused, "GPU_FENCE": fused})
              for pre, pack, sinks, fused in itertools.product((False, True), (1, 2), (False, True), (False, True))]
    cases += [("moe_down", False, {"EVEN_K": even, "HAS_BIAS": not even}) for even in (False, True)]
    results = compile_in_subprocess(cases)
    assert len(results) == len(cases)
    assert all(r["loads_before_wait"] == 0 for r, case in zip(results, cases, strict=True) if not case[1])
