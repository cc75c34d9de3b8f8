"""Expert parallelism's all-to-all dispatch (``--moe-a2a-backend all_to_all``) over two real
processes (gloo): each rank routes only its own tokens, sends each (token, expert) pair to the rank
holding the expert and combines the returned results per token in float32. The layer's output must
match the reference loop over all experts on one rank, and whole engines must produce one rank's
greedy tokens (fp32; reduction order differs, the argmax must not)."""

from __future__ import annotations

import pytest
import torch

import plait.layers.moe.all_to_all as a2a
from plait.config import EngineConfig
from plait.distributed.all_to_all import all_to_all_rows, exchange_counts
from plait.distributed.parallel_state import SINGLE, TPGroup
from plait.forward_batch import DPPaddingMode, ForwardBatch, ForwardMode
from plait.layers.moe.all_to_all import dispatch_combine, split_rows
from plait.layers.moe.layer import FusedMoE, SparseMoeBlock, all_to_all_step
from plait.layers.moe.reference import fused_experts_reference
from plait.layers.moe.router import RouterConfig
from tests.helpers import make_engine, prompt_ids, run_two_ranks, single_rank_outputs, two_rank_group

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}
E, H, INTER, K = 4, 8, 6, 2  # experts, hidden, intermediate, top-k; ep 2: experts 0, 1 on rank 0, 2, 3 on rank 1
CASES = ("mixed lengths", "rank 0 sends all to rank 1", "idle rank 1")


def _full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w13": torch.randn(E, 2 * INTER, H, generator=g) * 0.3, "w2": torch.randn(E, H, INTER, generator=g) * 0.3,
            "b13": torch.randn(E, 2 * INTER, generator=g) * 0.1, "b2": torch.randn(E, H, generator=g) * 0.1}


def _routing(case: str, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens [n, H], weights [n, K] and global expert ids [n, K] in ``case``."""
    g = torch.Generator().manual_seed(2 * CASES.index(case) + rank)
    n = {"mixed lengths": (3, 5), "rank 0 sends all to rank 1": (4, 2), "idle rank 1": (5, 0)}[case][rank]
    if case == "rank 0 sends all to rank 1" and rank == 0:
        experts = torch.tensor([2, 3])  # rank 0's own experts get none of its tokens
    elif case == "mixed lengths":
        experts = torch.tensor([0, 1, 2])  # expert 3 receives no token from anyone
    else:
        experts = torch.arange(E)
    ids = torch.stack([experts[torch.randperm(len(experts), generator=g)[:K]] for _ in range(n)]) if n else \
        torch.empty(0, K, dtype=torch.int64)
    weights = torch.softmax(torch.randn(n, K, generator=g), dim=-1)
    return torch.randn(n, H, generator=g), weights, ids.to(torch.int32)


def _rank_experts(group: TPGroup, w: dict[str, torch.Tensor]) -> FusedMoE:
    experts = FusedMoE(E, H, INTER, group, ep_size=2, activation="swiglu_oai", bias=True)
    first = experts.first_expert
    for name, param in (("w13", experts.w13_weight), ("w2", experts.w2_weight), ("b13", experts.w13_bias),
                        ("b2", experts.w2_bias)):
        param.data.copy_(w[name][first : first + experts.num_local_experts])
    return experts


def _check_dispatch(port: int, rank: int, nccl: bool = False) -> None:
    """NCCL (tests/gpu): CUDA tensors, and the received pairs go through the fused Triton kernels."""
    group = two_rank_group(port, rank, nccl)
    device = f"cuda:{rank}" if nccl else "cpu"
    w = {name: t.to(device) for name, t in _full_weights().items()}
    experts = _rank_experts(group, w).to(device)
    for case in CASES:
        x, weights, ids = (t.to(device) for t in _routing(case, rank))
        out = dispatch_combine(x, weights, ids, group, experts.num_local_experts, experts.forward_received)
        expected = fused_experts_reference(x, w["w13"], w["w2"], weights, ids, "swiglu_oai", w["b13"], w["b2"])
        assert out.shape == (x.shape[0], H), case
        tol = 2e-2 if nccl else 1e-5  # the Triton kernels' tf32 dot products
        torch.testing.assert_close(out, expected, rtol=tol, atol=tol, msg=case)


def test_dispatch_combine_equals_the_reference_over_all_experts_in_every_routing_case():
    """Mixed token counts with an expert no token picks, a rank whose tokens all go to the other
    rank, and an IDLE rank (no tokens, still in both exchanges)."""
    run_two_ranks(_check_dispatch)


def _block(group: TPGroup, w: dict[str, torch.Tensor], whole: bool) -> SparseMoeBlock:
    """Router + experts + a Qwen2-MoE-style gated shared expert (replicated): this rank's all-to-all
    block, or (``whole``) the one-rank block holding every expert."""
    from types import SimpleNamespace

    from plait.models.llama import LlamaMLP

    experts = FusedMoE(E, H, INTER, SINGLE, activation="swiglu_oai", bias=True) if whole else _rank_experts(group, w)
    if whole:
        for name, param in (("w13", experts.w13_weight), ("w2", experts.w2_weight), ("b13", experts.w13_bias),
                            ("b2", experts.w2_bias)):
            param.data.copy_(w[name])
    shared = LlamaMLP(SimpleNamespace(hidden_size=H, intermediate_size=INTER), SINGLE, bias=False)
    block = SparseMoeBlock(RouterConfig(E, K), experts, H, SINGLE if whole else group, shared_expert=shared,
                           all_to_all=not whole)
    g = torch.Generator().manual_seed(1)
    for param in (block.gate.weight, block.shared_expert_gate.weight, shared.gate_up_proj.weight,
                  shared.down_proj.weight):
        param.data.copy_(torch.randn(param.shape, generator=g) * 0.3)
    return block


def _check_both_paths(port: int, rank: int) -> None:
    group = two_rank_group(port, rank)
    w = _full_weights()
    block, whole = _block(group, w, whole=False), _block(group, w, whole=True)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))  # replicated, as under plain TP
    expected = whole(x)
    # The gather path a graph capture keeps: rank 0 alone adds the replicated shared expert.
    torch.testing.assert_close(group.all_reduce(block.forward_partial(x)), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block.forward_scattered(x), expected, rtol=1e-5, atol=1e-5)


def test_a_replicated_shared_expert_counts_once_on_the_gather_path_and_the_all_to_all_path():
    run_two_ranks(_check_both_paths)


def _check_rows(port: int, rank: int, nccl: bool = False) -> None:
    group = two_rank_group(port, rank, nccl)
    device = f"cuda:{rank}" if nccl else "cpu"
    send = [[1, 2], [0, 3]][rank]  # rows rank r sends to rank 0, to rank 1
    x = torch.arange(sum(send), dtype=torch.float32, device=device).unsqueeze(1) + 10 * rank
    recv = exchange_counts(group, torch.tensor(send, device=device))
    assert recv == [[1, 0], [2, 3]][rank]
    got = all_to_all_rows(group, x, send, recv)
    # Rank 0 gets rank 0's row 0 and nothing of rank 1; rank 1 gets rank 0's rows 1, 2 and rank 1's 0..2.
    assert got.squeeze(1).tolist() == [[0.0], [1.0, 2.0, 10.0, 11.0, 12.0]][rank]


def test_rows_reach_their_destination_in_source_rank_order_with_uneven_and_empty_splits():
    run_two_ranks(_check_rows)


def test_split_rows_gives_every_rank_a_near_equal_consecutive_share():
    assert split_rows(5, 2) == [3, 2] and split_rows(1, 2) == [1, 0] and split_rows(0, 2) == [0, 0]


def _spy_all_to_all(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows this process's rank sent through the layer's all-to-all exchanges (the real exchange
    runs; a rank on the gather path while the other dispatches would hang, so one count proves both)."""
    sent: list[int] = []

    def counting(group, x, send_counts, recv_counts):  # noqa: ANN001, ANN202
        sent.append(int(x.shape[0]))
        return all_to_all_rows(group, x, send_counts, recv_counts)

    monkeypatch.setattr(a2a, "all_to_all_rows", counting)
    return sent


@pytest.mark.parametrize(("arch", "layout"), [
    # DP attention: every rank routes its own requests (an IDLE rank when one prompt runs alone); the
    # shared expert replicated on both ranks.
    ("qwen2-moe", {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}),
    # A dense layer (mlp_only_layers) between sparse ones keeps the gather path, an IDLE rank too.
    ("qwen3-moe", {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}),
    # Plain TP: each rank dispatches its half of the replicated rows, the outputs all-gathered back;
    # expert biases and sinks.
    ("gpt-oss", {"tp_size": 2}),
])
def test_all_to_all_greedy_tokens_equal_one_rank(arch, layout, tiny_model_dir, monkeypatch):
    path = tiny_model_dir(arch)
    prompts = prompt_ids(3)  # lengths 3, 7, 12
    alone = prompts[1:2]
    expected = single_rank_outputs(path, prompts, GREEDY)
    sent = _spy_all_to_all(monkeypatch)
    with make_engine(path, dist_timeout=60, max_total_tokens=256, ep_size=2, moe_a2a_backend="all_to_all",
                     **layout) as engine:
        block = next(m.mlp for m in engine.runner.model.model.layers if isinstance(m.mlp, SparseMoeBlock))
        assert block.all_to_all and block.experts.num_local_experts == 4
        if block.shared_expert is not None:  # replicated: the whole intermediate width on each rank
            assert block.shared_expert.down_proj.tp.size == 1
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [expected[tuple(p)] for p in prompts]
        assert sent, "the layers dispatched by all-to-all"
        assert [o.token_ids for o in engine.generate(alone, GREEDY)] == [expected[tuple(alone[0])]]


@pytest.mark.parametrize(("layout", "message"), [
    ({"tp_size": 2}, "needs whole experts on every rank: --ep-size equal to --tp-size"),
    ({"tp_size": 4, "ep_size": 2}, "needs whole experts on every rank: --ep-size equal to --tp-size"),
    ({"tp_size": 2, "ep_size": 2, "enable_two_batch_overlap": True}, "does not run under --enable-two-batch-overlap"),
])
def test_all_to_all_refuses_layouts_it_does_not_support_naming_the_flag(layout, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", moe_a2a_backend="all_to_all", **layout)


def test_unknown_a2a_backend_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"moe_a2a_backend must be one of \('none', 'all_to_all'\)"):
        EngineConfig(model="m", moe_a2a_backend="deepep")


def test_a_layer_without_whole_experts_per_rank_refuses_all_to_all():
    experts = FusedMoE(E, H, INTER, SINGLE)
    with pytest.raises(ValueError, match="needs whole experts on every rank"):
        SparseMoeBlock(RouterConfig(E, K), experts, H, SINGLE, all_to_all=True)


def test_cli_flag_sets_the_backend_and_refuses_unknown_names():
    from plait.cli import build_parser, engine_options

    argv = ["generate", "--model", "/m", "--prompt", "hi", "--tp-size", "2", "--ep-size", "2"]
    args = build_parser().parse_args([*argv, "--moe-a2a-backend", "all_to_all"])
    assert engine_options(args)["moe_a2a_backend"] == "all_to_all"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--moe-a2a-backend", "deepep"])


def _step(mode: ForwardMode, padding: DPPaddingMode | None = None) -> ForwardBatch:
    empty = torch.empty(0, dtype=torch.int64)
    fb = ForwardBatch(forward_mode=mode, batch_size=0, input_ids=empty, req_pool_indices=empty, seq_lens=empty,
                      out_cache_loc=empty, positions=empty)
    fb.mlp_sync.padding_mode = padding
    return fb


def test_on_cuda_only_steps_graphs_are_never_captured_for_dispatch_by_all_to_all():
    """A graph's warm-up runs and its capture must take one path: on CUDA the kinds of steps graphs are
    captured for (DP attention: MAX_LEN; plain TP: decode, verify) keep the gather path."""
    extend, decode = _step(ForwardMode.EXTEND), _step(ForwardMode.DECODE)
    assert all_to_all_step(decode, on_cuda=False, capturing=False)  # no graphs off CUDA
    assert all_to_all_step(extend, on_cuda=True, capturing=False)
    assert not all_to_all_step(decode, on_cuda=True, capturing=False)
    assert not all_to_all_step(_step(ForwardMode.TARGET_VERIFY), on_cuda=True, capturing=False)
    assert not all_to_all_step(extend, on_cuda=True, capturing=True)
    # DP attention: the step's global padding mode decides, whatever this rank's own mode (IDLE here).
    assert all_to_all_step(_step(ForwardMode.IDLE, DPPaddingMode.SUM_LEN), on_cuda=True, capturing=False)
    assert not all_to_all_step(_step(ForwardMode.EXTEND, DPPaddingMode.MAX_LEN), on_cuda=True, capturing=False)
