"""The fused MoE Triton pipeline against the reference loop over experts (Triton interpreter on the
CPU, small shapes), and the invariants of the expert alignment it starts from."""

from __future__ import annotations

import json

import pytest
import torch

fused = pytest.importorskip("plait.layers.moe.fused_moe_triton")

from plait.layers.moe import kernel_config  # noqa: E402
from plait.layers.moe.align import max_padded_size, moe_align_block_size  # noqa: E402
from plait.layers.moe.kernel_config import MoeKernelConfig  # noqa: E402
from plait.layers.moe.reference import fused_experts_reference  # noqa: E402

SMALL = MoeKernelConfig(block_m=16, block_n=32, block_k=16, group_m=2)
SMALL_FUSED = MoeKernelConfig(block_m=16, block_n=32, block_k=16, group_m=1, fuse_activation=True)


def make_experts(num_experts: int, hidden: int, inter: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    b13 = torch.randn(num_experts, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=g) if bias else None
    return w13, w2, b13, b2


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def assert_equals_reference(out, x, w13, w2, weights, ids, activation, b13=None, b2=None):
    """``out`` (a kernel path's result) against the reference loop over experts on the same inputs."""
    ref = fused_experts_reference(x, w13, w2, weights, ids, activation, b13, b2)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def check_against_reference(x, w13, w2, weights, ids, activation, b13, b2, config):
    out = fused.fused_experts_with_config(x, w13, w2, weights, ids, activation, b13, b2, config)
    assert_equals_reference(out, x, w13, w2, weights, ids, activation, b13, b2)


@pytest.mark.parametrize("config", [SMALL, SMALL_FUSED], ids=["separate-activation", "fused-activation"])
def test_silu_matches_reference(config):
    w13, w2, _, _ = make_experts(4, 32, 32, bias=False)
    weights, ids = random_routing(16, 4, 2)
    check_against_reference(torch.randn(16, 32), w13, w2, weights, ids, "silu", None, None, config)


@pytest.mark.parametrize("config", [SMALL, SMALL_FUSED], ids=["separate-activation", "fused-activation"])
def test_swiglu_oai_with_biases_matches_reference(config):
    # Inputs scaled so some gate/up values pass the +-7 clamps.
    w13, w2, b13, b2 = make_experts(4, 64, 32, bias=True)
    weights, ids = random_routing(12, 4, 2, seed=3)
    x = 6 * torch.randn(12, 64)
    gate_up = torch.einsum("th,eoh->teo", x, w13)
    assert (gate_up.abs() > 7).any()
    check_against_reference(x, w13, w2, weights, ids, "swiglu_oai", b13, b2, config)


def test_skewed_routing_all_tokens_on_one_expert():
    # 16 tokens on expert 2 fill one block exactly; the other experts receive nothing.
    w13, w2, _, _ = make_experts(4, 32, 32, bias=False)
    ids = torch.full((16, 1), 2, dtype=torch.int32)
    weights = torch.rand(16, 1)
    check_against_reference(torch.randn(16, 32), w13, w2, weights, ids, "silu", None, None, SMALL)


def test_experts_without_tokens_and_a_partial_block():
    # Experts 0 and 3 receive no pair; expert 1 gets 18 pairs (a full block and two rows over),
    # expert 2 exactly one block.
    w13, w2, b13, b2 = make_experts(4, 32, 32, bias=True)
    ids = torch.tensor([[1, 2]] * 9 + [[2, 1]] * 8, dtype=torch.int32)
    ids[0, 1] = 1  # token 0 routes to expert 1 twice: both pairs count
    weights = torch.rand(17, 2)
    check_against_reference(torch.randn(17, 32), w13, w2, weights, ids, "swiglu_oai", b13, b2, SMALL)


def test_single_token():
    w13, w2, _, _ = make_experts(4, 32, 32, bias=False)
    weights, ids = random_routing(1, 4, 2)
    check_against_reference(torch.randn(1, 32), w13, w2, weights, ids, "silu", None, None, SMALL_FUSED)


def test_no_tokens_gives_an_empty_result():
    w13, w2, _, _ = make_experts(4, 32, 32, bias=False)
    out = fused.fused_experts_with_config(torch.randn(0, 32), w13, w2, torch.rand(0, 2),
                                          torch.zeros(0, 2, dtype=torch.int32), "silu", None, None, SMALL)
    assert out.shape == (0, 32)


def test_expert_ids_outside_range_contribute_nothing():
    # Expert parallelism marks experts another rank holds with -1 or E: those pairs add nothing,
    # and a token whose every expert is remote gets zeros.
    w13, w2, b13, b2 = make_experts(4, 32, 32, bias=True)
    ids = torch.tensor([[0, -1], [4, 1], [-1, 4], [3, 3]], dtype=torch.int64)
    weights = torch.rand(4, 2)
    x = torch.randn(4, 32)
    out = fused.fused_experts_with_config(x, w13, w2, weights, ids, "swiglu_oai", b13, b2, SMALL)
    torch.testing.assert_close(out, fused_experts_reference(x, w13, w2, weights, ids, "swiglu_oai", b13, b2),
                               atol=1e-4, rtol=1e-4)
    assert torch.equal(out[2], torch.zeros(32))


def test_public_entry_point_uses_the_default_config_without_a_tuned_file():
    w13, w2, _, _ = make_experts(4, 32, 32, bias=False)
    weights, ids = random_routing(3, 4, 2)
    x = torch.randn(3, 32)
    assert kernel_config.load_configs(4, 32, "cpu") is None
    torch.testing.assert_close(fused.fused_experts_triton(x, w13, w2, weights, ids),
                               fused_experts_reference(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_fp8_experts_without_their_block_scales_are_refused_naming_the_layout():
    w13, w2, _, _ = make_experts(2, 32, 32, bias=False)
    weights, ids = random_routing(2, 2, 1)
    with pytest.raises(ValueError, match="block-FP8"):
        fused.fused_experts_triton(torch.randn(2, 32), w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn),
                                   weights, ids)


@pytest.mark.parametrize(("field", "kwargs", "match"), [
    ("activation", {"activation": "gelu"}, "activation must be one of"),
    ("b13", {"b13": torch.zeros(4, 10)}, "b13 must be"),
    ("b2", {"b2": torch.zeros(4, 10)}, "b2 must be"),
])
def test_bad_arguments_are_refused_naming_the_field(field, kwargs, match):
    w13, w2, _, _ = make_experts(4, 32, 32, bias=False)
    weights, ids = random_routing(2, 4, 2)
    with pytest.raises(ValueError, match=match):
        fused.fused_experts_triton(torch.randn(2, 32), w13, w2, weights, ids, **kwargs)


def test_mismatched_weights_are_refused():
    w13, w2, _, _ = make_experts(4, 32, 32, bias=False)
    weights, ids = random_routing(2, 4, 2)
    with pytest.raises(ValueError, match="expert weights do not match"):
        fused.fused_experts_triton(torch.randn(2, 32), w13, w2[:, :, :16], weights, ids)


# --- the alignment ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m"), [(1, 2, 4, 16), (13, 3, 5, 4),
                                                                            (16, 1, 4, 16), (40, 4, 8, 8)])
def test_align_lays_out_every_valid_pair_once_in_expert_blocks(num_tokens, top_k, num_experts, block_m):
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(-1, num_experts + 1, (num_tokens, top_k), generator=g)  # -1 and E are dropped
    sorted_ids, expert_ids, post = moe_align_block_size(ids, block_m, num_experts)
    num_pairs = num_tokens * top_k
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)

    assert sorted_ids.shape == (max_padded_size(num_pairs, num_experts, block_m),)
    assert expert_ids.shape == (sorted_ids.shape[0] // block_m,)
    assert sorted_ids.dtype == expert_ids.dtype == post.dtype == torch.int32
    counts = torch.bincount(flat[valid], minlength=num_experts)
    assert int(post) == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(post) % block_m == 0
    # Every valid pair exactly once; everything else is the sentinel.
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == torch.nonzero(valid).reshape(-1).tolist()
    assert (sorted_ids[int(post):] == num_pairs).all()
    # Each block holds only its expert's pairs, padding only at the end of an expert's run; experts ascend.
    for b in range(int(post) // block_m):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        pairs = block[block < num_pairs]
        assert len(pairs) > 0, "no block is all padding"
        assert (flat[pairs.long()] == expert_ids[b]).all()
        assert (block[:len(pairs)] < num_pairs).all()
    assert expert_ids[:int(post) // block_m].tolist() == sorted(expert_ids[:int(post) // block_m].tolist())
    assert (expert_ids[int(post) // block_m:] == num_experts).all()


def test_align_sizes_do_not_depend_on_the_routing():
    # What CUDA graphs need: the same T, K, E, block_m give the same shapes for any routing.
    skewed = torch.zeros(8, 2, dtype=torch.int32)
    spread = torch.arange(16, dtype=torch.int32).reshape(8, 2) % 4
    a, b = moe_align_block_size(skewed, 16, 4), moe_align_block_size(spread, 16, 4)
    assert [t.shape for t in a] == [t.shape for t in b]


# --- tuned configs as data ----------------------------------------------------------------------------


def test_tuned_config_of_the_nearest_bucket_is_read(tmp_path, monkeypatch):
    table = {"1": SMALL.to_json(), "64": SMALL_FUSED.to_json()}
    (tmp_path / kernel_config.config_file_name(8, 96, "Fake GPU")).write_text(json.dumps(table))
    monkeypatch.setattr(kernel_config, "CONFIG_DIR", tmp_path)
    assert kernel_config.get_config(20, 8, 96, 2, "Fake GPU") == SMALL
    assert kernel_config.get_config(50, 8, 96, 2, "Fake GPU") == SMALL_FUSED
    assert kernel_config.get_config(50, 8, 96, 2, "Other GPU") == kernel_config.default_config(50, 8, 2)


def test_the_moe_config_dir_is_read_before_the_shipped_tables(tmp_path, monkeypatch):
    table = {"1": SMALL_FUSED.to_json()}
    (tmp_path / kernel_config.config_file_name(128, 768, "NVIDIA H200")).write_text(json.dumps(table))
    shipped = kernel_config.get_config(1, 128, 768, 8, "NVIDIA H200")
    monkeypatch.setenv("PLAIT_MOE_CONFIG_DIR", str(tmp_path))
    assert kernel_config.get_config(1, 128, 768, 8, "NVIDIA H200") == SMALL_FUSED != shipped


def test_shipped_tuned_configs_parse_and_cover_the_benchmark_shapes():
    for experts, inter in ((128, 768), (32, 2880)):  # qwen3-30b-a3b, gpt-oss-20b experts
        table = kernel_config.load_configs(experts, inter, "NVIDIA H200")
        assert table is not None and min(table) == 1 and max(table) >= 4096
        assert all(isinstance(cfg, MoeKernelConfig) for cfg in table.values())
    for path in kernel_config.CONFIG_DIR.glob("*.json"):
        raw = json.loads(path.read_text())
        assert all(int(m) > 0 for m in raw)
        if path.name.startswith("small_"):  # the small-batch path's tables (small_batch.SmallBatchBucket)
            from plait.layers.moe.small_batch import SmallBatchBucket

            assert all(SmallBatchBucket.from_json(bucket).config.to_json() == bucket["config"]
                       for bucket in raw.values())
        else:
            assert all(MoeKernelConfig.from_json(cfg).to_json() == cfg for cfg in raw.values())


def test_config_validates_block_sizes():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        MoeKernelConfig(block_m=16, block_n=48, block_k=16)
