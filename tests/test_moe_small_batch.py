"""The small-batch MoE path (two launches, no alignment) and the one-launch router against the torch
reference (Triton interpreter on the CPU, tiny shapes), and how many kernels one MoE layer launches
at decode batch sizes."""

from __future__ import annotations

import collections
import json

import pytest
import torch

small = pytest.importorskip("plait.layers.moe.small_batch")

from plait.layers.moe import fused_moe_triton  # noqa: E402
from plait.layers.moe.fused_router import fused_topk  # noqa: E402
from plait.layers.moe.layer import FusedMoE, SparseMoeBlock  # noqa: E402
from plait.layers.moe.reference import fused_experts_reference  # noqa: E402
from plait.layers.moe.router import RouterConfig, select_experts  # noqa: E402
from tests.test_fused_moe_triton import assert_equals_reference  # noqa: E402
from tests.test_fused_moe_triton import make_experts as experts  # noqa: E402

# Tiles smaller than the tiny shapes, so the loops take several steps and the K dimension is even.
EVEN = small.SmallBatchConfig(block_n=8, block_h=4, block_k=16)


def qwen3_routing(num_tokens: int, num_experts: int, top_k: int, seed: int = 1):
    """Softmax, top-k, renormalised (Qwen3-MoE's norm_topk_prob)."""
    g = torch.Generator().manual_seed(seed)
    return select_experts(torch.randn(num_tokens, num_experts, generator=g),
                          RouterConfig(num_experts, top_k, "softmax_topk", renormalize=True), fused=False)


def assert_matches_reference(x, w13, w2, weights, ids, activation, b13=None, b2=None, config=None):
    out = small.fused_experts_small_batch(x, w13, w2, weights, ids, activation, b13, b2, config)
    assert_equals_reference(out, x, w13, w2, weights, ids, activation, b13, b2)


# One down row per program, the whole reduction in one masked step: the widest-K tuner candidates' form.
ONE_ROW = small.SmallBatchConfig(block_n=8, block_h=1, block_k=64)
# The down kernel on its own step (I = 24: a masked K tail at 16), warps and stages.
OWN_DOWN = small.SmallBatchConfig(block_n=8, block_h=2, block_k=16, down_block_k=16, down_num_warps=2,
                                  down_num_stages=2)


@pytest.mark.parametrize("config", [EVEN, None, ONE_ROW, OWN_DOWN],
                         ids=["even-k-tiles", "default-tiles-masked-k", "one-row-one-step", "own-down-tiles"])
def test_silu_with_normalised_top_k_matches_reference(config):
    # I = 24 is not a multiple of block_n: the wrapped columns are computed and not stored.
    w13, w2, _, _ = experts(16, 32, 24, bias=False)
    weights, ids = qwen3_routing(3, 16, 4)
    assert_matches_reference(torch.randn(3, 32), w13, w2, weights, ids, "silu", config=config)


def test_down_tiles_default_to_the_gate_up_kernels_and_round_trip_through_json():
    joint = small.SmallBatchConfig(16, 8, 256, num_warps=8, num_stages=3)
    assert joint.down == (256, 8, 3)
    assert joint.to_json() == {"block_n": 16, "block_h": 8, "block_k": 256, "num_warps": 8, "num_stages": 3}
    own = small.SmallBatchConfig(16, 2, 256, 8, 3, down_block_k=512, down_num_warps=4, down_num_stages=2)
    assert own.down == (512, 4, 2)
    assert small.SmallBatchBucket.from_json({"path": "small", "config": own.to_json()}).config == own
    with pytest.raises(ValueError, match="down_block_k must be a power of two"):
        small.SmallBatchConfig(16, 2, 256, down_block_k=96)


def test_swiglu_oai_with_clamps_and_biases_matches_reference():
    # gpt-oss's activation; H = 40 leaves a partial K step; inputs scaled so the +-7 clamps bind.
    w13, w2, b13, b2 = experts(8, 40, 16, bias=True, seed=2)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 8, generator=g)
    weights, ids = select_experts(logits, RouterConfig(8, 2, "topk_softmax"), fused=False)
    x = 6 * torch.randn(2, 40, generator=g)
    assert (torch.einsum("th,eoh->teo", x, w13).abs() > 7).any()
    assert_matches_reference(x, w13, w2, weights, ids, "swiglu_oai", b13, b2, small.SmallBatchConfig(8, 8, 16))


def test_skewed_routing_on_one_expert_and_ids_of_other_ranks():
    # Every pair on expert 5, except ids -1 and E (experts another expert-parallel rank holds),
    # which contribute nothing; a token may also pick one expert twice.
    w13, w2, b13, b2 = experts(8, 32, 16, bias=True, seed=4)
    ids = torch.tensor([[5, 5, -1], [5, 8, 5]], dtype=torch.int32)
    weights = torch.rand(2, 3)
    assert_matches_reference(torch.randn(2, 32), w13, w2, weights, ids, "silu", b13, b2, EVEN)


def test_a_token_whose_every_expert_is_remote_gets_zeros_not_its_bias():
    w13, w2, b13, b2 = experts(4, 16, 16, bias=True)
    ids = torch.tensor([[-1, 4]], dtype=torch.int32)
    out = small.fused_experts_small_batch(torch.randn(1, 16), w13, w2, torch.rand(1, 2), ids, "silu", b13, b2, EVEN)
    assert torch.equal(out, torch.zeros(1, 16))


def test_untuned_rule_takes_the_small_path_only_for_sparse_pairs_of_small_experts():
    qwen3, gpt_oss = (2048, 768), (2880, 2880)
    assert small.use_small_batch(8, 128, *qwen3) and small.use_small_batch(32, 128, *qwen3)  # 1 and 4 tokens
    assert not small.use_small_batch(64, 128, *qwen3)  # 8 tokens: pairs share experts, aligned reads each once
    assert small.use_small_batch(4, 32, 32, 16) and not small.use_small_batch(16, 32, 32, 16)
    assert not small.use_small_batch(0, 128, *qwen3)
    # gpt-oss-20b's experts (25M parameters): the aligned GEMM streams them faster even at one token.
    assert not small.use_small_batch(4, 32, *gpt_oss)


def test_default_tiles_keep_the_grid_large_at_one_token():
    cfg = small.small_batch_config(1, 8, 2048, 768)  # qwen3-30b-a3b
    assert 8 * -(-768 // cfg.block_n) >= 128 and -(-2048 // cfg.block_h) >= 128
    with pytest.raises(ValueError, match="block_h must be a power of two"):
        small.SmallBatchConfig(block_n=8, block_h=6, block_k=16)


@pytest.mark.parametrize(("scoring", "renormalize", "top_k"),
                         [("softmax_topk", True, 4), ("softmax_topk", False, 3), ("topk_softmax", False, 4)])
def test_one_launch_router_matches_torch(scoring, renormalize, top_k):
    # 12 experts (not a power of two) and bf16 logits, upcast inside the kernel.
    cfg = RouterConfig(12, top_k, scoring, renormalize)
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(7)).bfloat16()
    logits[0] = 0.0  # all tied: both take the lowest ids
    weights, ids = fused_topk(logits, top_k, scoring == "softmax_topk", renormalize)
    ref_w, ref_ids = select_experts(logits, cfg, fused=False)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids[1:], ref_ids[1:]) and torch.equal(ids[0], torch.arange(top_k, dtype=torch.int32))
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_router_through_the_small_m_gemv_equals_linear_and_picks_the_same_experts(num_tokens):
    # What Router.forward runs on CUDA for decode batches (dense_linear's GEMV, then the bias), here in
    # the interpreter: 12 experts (not a multiple of the row tile) with gpt-oss's router bias, in fp16
    # (the GEMV takes half-precision weights; the interpreter has no bf16).
    from plait.layers.moe.layer import Router
    from plait.layers.quantization.gemv import gemv

    g = torch.Generator().manual_seed(num_tokens)
    router = Router(12, 64, bias=True, dtype=torch.float16)
    router.weight.data.copy_(torch.randn(12, 64, generator=g) / 8)
    router.bias.data.copy_(torch.randn(12, generator=g))
    x = torch.randn(num_tokens, 64, generator=g).half()
    through_gemv = gemv(x, router.weight) + router.bias
    reference = torch.nn.functional.linear(x.float(), router.weight.float(), router.bias.float())
    assert through_gemv.dtype == router(x).dtype == torch.float16  # logits in the activations' dtype either way
    torch.testing.assert_close(through_gemv.float(), reference, atol=2e-3, rtol=2e-3)
    cfg = RouterConfig(12, 4, "topk_softmax")
    ids, ref_ids = (select_experts(logits, cfg, fused=False)[1] for logits in (through_gemv, reference))
    assert torch.equal(ids, ref_ids)


def test_router_takes_the_gemv_unless_the_switch_is_off(monkeypatch):
    from plait.layers.moe.layer import Router

    assert Router(8, 16).small_m_gemv
    monkeypatch.setenv("PLAIT_BF16_GEMV", "0")
    assert not Router(8, 16).small_m_gemv


def test_router_refuses_a_top_k_above_the_experts():
    with pytest.raises(ValueError, match="top_k"):
        fused_topk(torch.randn(2, 4), 5, True, False)


class LaunchCounter:
    """Counts what a forward launches: Triton kernels (the interpreter's launch entry) and the aten
    ops that compute (views, allocations and metadata ops launch nothing on a GPU)."""

    NO_KERNEL = {"empty", "empty_strided", "view", "_unsafe_view", "reshape", "t", "transpose", "as_strided",
                 "detach", "alias", "split", "split_with_sizes", "slice", "select", "unsqueeze", "squeeze",
                 "expand", "permute", "lift_fresh"}

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from triton.runtime.interpreter import InterpretedFunction

        self.counts: collections.Counter[str] = collections.Counter()
        original = InterpretedFunction.run
        counts = self.counts
        inside = [False]  # the interpreter's own tensor copies are not the layer's ops

        def run(fn, *args, **kwargs):
            counts[f"triton:{fn.__name__}"] += 1
            inside[0] = True
            try:
                return original(fn, *args, **kwargs)
            finally:
                inside[0] = False

        monkeypatch.setattr(InterpretedFunction, "run", run)

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name not in LaunchCounter.NO_KERNEL and not inside[0]:
                    counts[f"aten:{name}"] += 1
                return func(*args, **(kwargs or {}))

        self.ops = Ops()


def moe_block(num_experts: int, top_k: int, hidden: int, inter: int, scoring: str, bias: bool) -> SparseMoeBlock:
    experts_mod = FusedMoE(num_experts, hidden, inter, activation="swiglu_oai" if bias else "silu", bias=bias,
                           fused_kernels=True)
    block = SparseMoeBlock(RouterConfig(num_experts, top_k, scoring, renormalize=scoring == "softmax_topk"),
                           experts_mod, hidden, router_bias=bias)
    g = torch.Generator().manual_seed(0)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block


@pytest.mark.parametrize("arch", ["qwen3-moe", "gpt-oss"])
def test_moe_layer_at_one_token_launches_the_router_gemm_and_three_kernels(arch, monkeypatch):
    # qwen3: softmax top-k renormalised, silu; gpt-oss: router bias, top-k then softmax, clamped
    # activation with expert biases. Either way: router GEMM, fused top-k, gate/up+act, down+sum.
    block = (moe_block(32, 8, 32, 16, "softmax_topk", bias=False) if arch == "qwen3-moe"
             else moe_block(32, 4, 32, 16, "topk_softmax", bias=True))
    counter = LaunchCounter(monkeypatch)
    x = torch.randn(1, 32)
    with torch.inference_mode(), counter.ops:
        out = block(x)
    triton_launches = {k: v for k, v in counter.counts.items() if k.startswith("triton:")}
    assert triton_launches == {"triton:_fused_topk_kernel": 1, "triton:_small_gate_up_kernel": 1,
                               "triton:_small_down_sum_kernel": 1}
    torch_ops = {k: v for k, v in counter.counts.items() if not k.startswith("triton:")}
    # The router projection (with gpt-oss's bias) is the only torch op: one GEMM, whichever name
    # the dispatcher gives it on this device.
    assert len(torch_ops) == 1 and set(torch_ops) <= {"aten:linear", "aten:mm", "aten:addmm"}, torch_ops
    assert sum(torch_ops.values()) == 1
    block.experts.fused_kernels = False
    torch.testing.assert_close(out, block(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 2, 8])
def test_moe_layer_with_fused_kernels_equals_the_torch_path_across_the_switch(num_tokens):
    # 32 experts, top 4: 1 and 2 tokens take the small path, 8 tokens the aligned pipeline.
    block = moe_block(32, 4, 32, 16, "softmax_topk", bias=False)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(num_tokens))
    with torch.inference_mode():
        fused = block(x)
        block.experts.fused_kernels = False
        torch.testing.assert_close(fused, block(x), atol=1e-4, rtol=1e-4)
    assert small.use_small_batch(num_tokens * 4, 32, 32, 16) == (num_tokens <= 2)


def test_public_entry_point_can_force_either_path():
    w13, w2, _, _ = experts(32, 32, 16, bias=False)
    weights, ids = qwen3_routing(1, 32, 2)
    x = torch.randn(1, 32)
    ref = fused_experts_reference(x, w13, w2, weights, ids, "silu")
    for forced in (True, False):
        out = fused_moe_triton.fused_experts_triton(x, w13, w2, weights, ids, "silu", small_batch=forced)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3-moe", "gpt-oss"])
def test_greedy_tokens_through_the_triton_kernels_equal_transformers(arch, tiny_model_dir, hf_reference,
                                                                     monkeypatch):
    # The engine's MoE layers switched to the Triton kernels (interpreter): the fused router every
    # step, the aligned pipeline for the 7-token prefill, the small-batch path for each one-token
    # decode step (8 experts, top 2: one token is 2 pairs <= 8 / 4).
    from tests.helpers import make_engine, prompt_ids

    path = tiny_model_dir(arch)
    prompt = prompt_ids(3)[1]
    ref = hf_reference(path, prompt, 6)
    counter = LaunchCounter(monkeypatch)
    with make_engine(path, max_total_tokens=256) as engine:
        moes = [m for m in engine.runner.model.modules() if isinstance(m, FusedMoE)]
        assert moes
        for m in moes:
            m.fused_kernels = True
        (out,) = engine.generate([prompt], {"temperature": 0.0, "max_new_tokens": 6})
    assert out.token_ids == ref.tokens
    launches = {k.removeprefix("triton:"): v for k, v in counter.counts.items()}
    calls = len(moes) * 6  # per sparse layer: the prefill and five decode steps
    assert launches["_fused_topk_kernel"] == calls
    assert launches["_small_gate_up_kernel"] == launches["_small_down_sum_kernel"] == len(moes) * 5
    assert launches["fused_moe_kernel"] == 2 * len(moes)  # the prefill: gate/up and down


def write_small_table(directory, buckets: dict[int, tuple[str, small.SmallBatchConfig]], experts=32, inter=16,
                      device="cpu") -> None:
    """A table as ``tune_fused_moe.py --small-batch`` writes it."""
    table = {str(m): {"path": path, "config": cfg.to_json(), "us": {"small": 1.0, "aligned": 2.0}}
             for m, (path, cfg) in buckets.items()}
    (directory / small.small_config_file_name(experts, inter, device)).write_text(json.dumps(table))


def test_tuned_small_batch_table_of_the_nearest_bucket_is_read_from_the_config_dir(tmp_path, monkeypatch):
    one, four = small.SmallBatchConfig(8, 4, 256), small.SmallBatchConfig(16, 8, 128, num_warps=8, num_stages=4)
    write_small_table(tmp_path, {1: ("small", one), 4: ("small", four)}, 128, 768, "Fake GPU")
    monkeypatch.setenv("PLAIT_MOE_CONFIG_DIR", str(tmp_path))
    assert small.get_small_batch_config(2, 128, 8, 2048, 768, "Fake GPU") == one
    assert small.get_small_batch_config(3, 128, 8, 2048, 768, "Fake GPU") == four
    untuned = small.get_small_batch_config(1, 128, 8, 2048, 768, "Other GPU")
    assert untuned == small.small_batch_config(1, 8, 2048, 768)
    monkeypatch.delenv("PLAIT_MOE_CONFIG_DIR")
    assert small.get_small_batch_config(2, 128, 8, 2048, 768, "Fake GPU") == small.small_batch_config(2, 8, 2048, 768)


def test_dispatcher_takes_the_path_the_table_measured_faster_per_bucket(tmp_path, monkeypatch):
    tiles = small.SmallBatchConfig(8, 4, 16)
    # The untuned rule would take the small path at 1 and 2 tokens (4 and 8 pairs, 32 experts).
    write_small_table(tmp_path, {1: ("aligned", tiles), 2: ("small", tiles), 4: ("aligned", tiles)})
    monkeypatch.setenv("PLAIT_MOE_CONFIG_DIR", str(tmp_path))
    plan = [small.small_batch_plan(m, 32, 4, 32, 16, "cpu") for m in (1, 2, 3, 4, 5, 64)]
    assert plan == [None, tiles, tiles, None, None, None]  # 3: nearest bucket 2 (ties go down); 5+: above the table
    # Without a table: the untuned rule, with the default tiles.
    monkeypatch.delenv("PLAIT_MOE_CONFIG_DIR")
    assert small.small_batch_plan(1, 32, 4, 32, 16, "cpu") == small.small_batch_config(1, 4, 32, 16)
    assert small.small_batch_plan(4, 32, 4, 32, 16, "cpu") is None


def test_fused_experts_follows_the_table_and_both_paths_match_the_reference(tmp_path, monkeypatch):
    w13, w2, _, _ = experts(32, 32, 16, bias=False)
    write_small_table(tmp_path, {1: ("aligned", EVEN), 2: ("small", EVEN)})
    monkeypatch.setenv("PLAIT_MOE_CONFIG_DIR", str(tmp_path))
    counter = collections.Counter()
    for name in ("fused_experts_small_batch", "fused_experts_with_config"):
        original = getattr(fused_moe_triton, name)
        monkeypatch.setattr(fused_moe_triton, name,
                            lambda *a, _f=original, _n=name, **k: (counter.update([_n]), _f(*a, **k))[1])
    for num_tokens in (1, 2):
        weights, ids = qwen3_routing(num_tokens, 32, 4, seed=num_tokens)
        x = torch.randn(num_tokens, 32)
        out = fused_moe_triton.fused_experts_triton(x, w13, w2, weights, ids, "silu")
        assert_equals_reference(out, x, w13, w2, weights, ids, "silu")
    assert counter == {"fused_experts_with_config": 1, "fused_experts_small_batch": 1}


def test_a_bucket_naming_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path must be one of"):
        small.SmallBatchBucket.from_json({"path": "fast", "config": EVEN.to_json()})
