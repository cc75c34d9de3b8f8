"""End-to-end GPU checks on the H200 (bf16): graph replay vs eager, triton vs torch_native by
teacher-forced logits, and a 2000-request soak that must end with every KV slot free."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.bench.shapes import SHAPES  # noqa: E402
from plait.bench.workloads import make_engine, random_prompts  # noqa: E402
from plait.executor.graph_utils import CudaGraph, warm_and_capture  # noqa: E402
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode  # noqa: E402

SHAPE = "llama-3.2-1b"
VOCAB = SHAPES[SHAPE]["vocab_size"]


def release(engine) -> None:
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def teacher_forced_logits(engine, sequences: list[list[int]], prompt_len: int) -> torch.Tensor:
    """Prefill each sequence's first ``prompt_len`` tokens, then decode the rest one token per step
    feeding the given tokens (not sampled ones). Returns float32 [steps, bs, vocab] logits; every
    sequence runs in one batch, so the batch size is len(sequences)."""
    runner = engine.runner
    bs = len(sequences)
    rows = [runner.req_to_token_pool.alloc() for _ in range(bs)]
    total = len(sequences[0])
    slots = runner.allocator.alloc(bs * total).view(bs, total)
    for r, row in enumerate(rows):
        runner.req_to_token_pool.write(row, 0, slots[r])
    dev = runner.device
    ids = torch.tensor([s[:prompt_len] for s in sequences], device=dev)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=ids.flatten(),
        req_pool_indices=torch.tensor(rows, device=dev), seq_lens=torch.full((bs,), prompt_len, device=dev),
        out_cache_loc=slots[:, :prompt_len].flatten(), positions=torch.arange(prompt_len, device=dev).repeat(bs),
        seq_lens_cpu=[prompt_len] * bs, seq_lens_sum=bs * prompt_len,
        extend=ExtendInfo(num_tokens=bs * prompt_len, seq_lens=torch.full((bs,), prompt_len, device=dev),
                          prefix_lens=torch.zeros(bs, dtype=torch.long, device=dev),
                          start_loc=torch.arange(bs, device=dev) * prompt_len, seq_lens_cpu=[prompt_len] * bs,
                          prefix_lens_cpu=[0] * bs),
        logits_indices=torch.arange(1, bs + 1, device=dev) * prompt_len - 1)
    out = [runner.forward(fb).next_token_logits.float().clone()]
    for t in range(prompt_len, total):
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.tensor([s[t] for s in sequences],
                                                                                  device=dev),
            req_pool_indices=torch.tensor(rows, device=dev), seq_lens=torch.full((bs,), t + 1, device=dev),
            out_cache_loc=slots[:, t].contiguous(), positions=torch.full((bs,), t, device=dev),
            seq_lens_cpu=[t + 1] * bs, seq_lens_sum=bs * (t + 1))
        out.append(runner.forward(fb).next_token_logits.float().clone())
    runner.allocator.free(slots.flatten())
    for row in rows:
        runner.req_to_token_pool.free(row)
    return torch.stack(out)


def test_graph_replay_matches_eager_on_the_same_batch(shape_dir):
    seqs = random_prompts(5, 96, VOCAB, seed=3)  # bs 5 pads to the 8 bucket
    engine = make_engine(shape_dir)
    assert engine.runner.graph_runner is not None
    graph = teacher_forced_logits(engine, seqs, 64)
    runner = engine.runner.graph_runner
    engine.runner.graph_runner = None
    eager = teacher_forced_logits(engine, seqs, 64)
    engine.runner.graph_runner = runner
    release(engine)
    spread = (graph - eager).abs().max().item()
    scale = eager.abs().max().item()
    assert spread <= 2e-2 * scale, f"graph vs eager max diff {spread} (logit scale {scale})"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_second_replica_replays_graphs_captured_on_its_own_gpu(shape_dir):
    """Two replicas (dp_size 2): replica 1 captures on GPU 1 (a capture stream of its own device;
    torch's default one belongs to the first capturing device) and its replay matches its eager run."""
    from types import SimpleNamespace

    engine = make_engine(shape_dir, dp_size=2)
    dp = engine.runner
    replica = dp.replicas[1]
    assert replica.graph_runner is not None
    seqs = random_prompts(5, 96, VOCAB, seed=3)
    with dp.on_replica(1):
        view = SimpleNamespace(runner=replica)
        graph = teacher_forced_logits(view, seqs, 64)
        runner, replica.graph_runner = replica.graph_runner, None
        eager = teacher_forced_logits(view, seqs, 64)
        replica.graph_runner = runner
    release(engine)
    assert graph.device == torch.device("cuda", 1)
    spread = (graph - eager).abs().max().item()
    scale = eager.abs().max().item()
    assert spread <= 2e-2 * scale, f"replica 1 graph vs eager max diff {spread} (logit scale {scale})"


def test_triton_logits_match_torch_native_within_its_own_batch_spread(shape_dir):
    seqs = random_prompts(4, 80, VOCAB, seed=4)
    native = make_engine(shape_dir, attention_backend="torch_native", disable_cuda_graph=True)
    ref_bs4 = teacher_forced_logits(native, seqs, 48)
    ref_bs1 = torch.cat([teacher_forced_logits(native, [s], 48) for s in seqs], dim=1)
    release(native)
    engine = make_engine(shape_dir, attention_backend="triton")
    got = teacher_forced_logits(engine, seqs, 48)
    release(engine)
    spread = (ref_bs4 - ref_bs1).abs().max().item()
    diff = (got - ref_bs4).abs().max().item()
    tolerance = max(3 * spread, 1e-3 * ref_bs4.abs().max().item())
    assert diff <= tolerance, f"triton vs torch_native {diff}, torch_native bs4 vs bs1 spread {spread}"
    # Greedy tokens agree wherever the reference's top-2 margin is clear of the spread.
    top2 = ref_bs4.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * tolerance
    assert clear.float().mean() > 0.5
    assert torch.equal(got.argmax(-1)[clear], ref_bs4.argmax(-1)[clear])


def test_soak_of_2000_requests_ends_with_every_kv_slot_free(shape_dir):
    engine = make_engine(shape_dir, max_running_requests=256)
    prompts = random_prompts(2000, 96, VOCAB, seed=6)
    outs = engine.generate(prompts, {"temperature": 0.8, "ignore_eos": True, "max_new_tokens": 32})
    assert all(len(o.token_ids) == 32 for o in outs)
    assert engine.scheduler.kv_tokens_in_use() == 0
    assert engine.scheduler.tree_cache.protected_size() == 0
    assert engine.runner.req_to_token_pool.available_size() == engine.runner.req_to_token_pool.size
    release(engine)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_nccl_row_collectives_place_uneven_and_idle_counts_like_gloo():
    """The NCCL paths of all_gather_rows / reduce_scatter_rows (base collectives for equal counts,
    grouped broadcasts and reduces for uneven ones, padding when a rank has no rows)."""
    from tests.distributed.test_row_collectives import run_both_ranks

    run_both_ranks(nccl=True)


def _copy_engine_setup(port: int, rank: int) -> tuple[Any, Any, list[Any], torch.Generator, torch.device]:
    """Rank ``rank``'s NCCL group, a CopyEngineRows of 64 rows per rank, and three random sharded MLP
    layers (hidden 256) of a copy-engine check."""
    from datetime import timedelta
    from types import SimpleNamespace

    from plait.distributed.copy_engine_rows import CopyEngineRows
    from plait.models.llama import LlamaMLP
    from tests.helpers import two_rank_nccl

    store, group = two_rank_nccl(port, rank)
    device = torch.device("cuda", rank)
    rows = CopyEngineRows(group, store, 64, 256, torch.bfloat16, device, timedelta(seconds=30))
    gen = torch.Generator(device=device).manual_seed(rank)
    layers = []
    for _ in range(3):
        mlp = LlamaMLP(SimpleNamespace(hidden_size=256, intermediate_size=512), group, bias=False)
        mlp = mlp.to(device=device, dtype=torch.bfloat16)
        for p in mlp.parameters():
            p.data = torch.randn(p.shape, generator=gen, device=device, dtype=torch.bfloat16) / 16
        layers.append(mlp)
    return group, rows, layers, gen, device


def _copy_engine_rank(port: int, rank: int) -> None:
    """Rank ``rank`` of the copy-engine check: its MLP rows through CopyEngineRows equal NCCL's, over
    several consecutive layers (the buffers and signals are reused without double buffering)."""
    from plait.distributed.dp_mlp import dp_gathered_mlp
    from plait.forward_batch import DPPaddingMode

    group, rows, layers, gen, device = _copy_engine_setup(port, rank)
    for counts in ([40, 40], [33, 7], [0, 21], [64, 1]):
        empty = torch.empty(0, dtype=torch.int64, device=device)
        fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=0, input_ids=empty, req_pool_indices=empty,
                          seq_lens=empty, out_cache_loc=empty, positions=empty)
        fb.mlp_sync.global_num_tokens_cpu, fb.mlp_sync.padding_mode = counts, DPPaddingMode.SUM_LEN
        x = torch.randn(counts[rank], 256, generator=gen, device=device, dtype=torch.bfloat16)
        nccl, copied = x, x
        for mlp in layers:
            fb.dp_row_exchange = None
            nccl = dp_gathered_mlp(mlp, nccl, fb, group)
            fb.dp_row_exchange = rows
            copied = dp_gathered_mlp(mlp, copied, fb, group)
        torch.testing.assert_close(copied, nccl, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_copy_engine_rows_match_nccl_over_consecutive_layers():
    from tests.helpers import run_two_ranks

    run_two_ranks(_copy_engine_rank, spawn_both=True)


def _copy_engine_graph_rank(port: int, rank: int) -> None:
    """Rank ``rank`` of the MAX_LEN check: three MLP layers through ``CopyEngineRows.mlp_equal`` (the
    symmetric-memory kernels), eager
    and replayed from a CUDA graph on fresh inputs, equal NCCL's eager result (padded rows included)."""
    from plait.distributed.dp_mlp import dp_gathered_mlp
    from plait.forward_batch import DPPaddingMode

    group, rows, layers, gen, device = _copy_engine_setup(port, rank)
    empty = torch.empty(0, dtype=torch.int64, device=device)

    def stack(x: torch.Tensor, counts: list[int], via: Any) -> torch.Tensor:
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=0, input_ids=empty, req_pool_indices=empty,
                          seq_lens=empty, out_cache_loc=empty, positions=empty)
        fb.mlp_sync.global_num_tokens_cpu, fb.mlp_sync.padding_mode = counts, DPPaddingMode.MAX_LEN
        fb.dp_row_exchange = via
        for mlp in layers:
            x = dp_gathered_mlp(mlp, x, fb, group)
        return x

    for counts in ([24, 24], [24, 9], [0, 5]):  # a padded rank, and one with no rows of its own
        x = torch.randn(counts[rank], 256, generator=gen, device=device, dtype=torch.bfloat16)
        torch.testing.assert_close(stack(x, counts, rows), stack(x, counts, None), rtol=2e-2, atol=2e-2)
    static = torch.zeros(32, 256, device=device, dtype=torch.bfloat16)
    graph = CudaGraph()
    captured = warm_and_capture(graph, lambda: stack(static, [32, 32], rows), None, sync=True)
    for _ in range(3):  # each replay reuses the buffers and signals of the one before
        static.copy_(torch.randn(32, 256, generator=gen, device=device, dtype=torch.bfloat16))
        graph.replay()
        torch.testing.assert_close(captured, stack(static, [32, 32], None), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_copy_engine_rows_kernels_of_max_len_rounds_match_nccl_eager_and_in_a_cuda_graph():
    from tests.helpers import run_two_ranks

    run_two_ranks(_copy_engine_graph_rank, spawn_both=True)


def _p2p_all_reduce_rank(port: int, rank: int) -> None:
    """Rank ``rank`` of the custom all-reduce check: bit-equal to NCCL's sum for sizes from one row to
    the largest, eager and from a CUDA graph of an odd number of calls replayed between eager calls
    (so the alternating buffer halves meet every order)."""
    from dataclasses import replace

    from plait.distributed.p2p_all_reduce import P2PAllReduce
    from tests.helpers import two_rank_nccl

    store, group = two_rank_nccl(port, rank)
    device = torch.device("cuda", rank)
    fast = replace(group, p2p_all_reduce=P2PAllReduce(group, store, torch.bfloat16, device))
    gen = torch.Generator(device=device).manual_seed(rank)

    def sample(numel: int) -> torch.Tensor:
        return torch.randn(numel, generator=gen, device=device).to(torch.bfloat16)

    for numel in (1, 4096, 3 * 4096 + 17, 128 * 4096, fast.p2p_all_reduce.max_numel):
        x = sample(numel)
        assert fast.p2p_all_reduce.fits(x)
        torch.testing.assert_close(fast.all_reduce(x.clone()), group.all_reduce(x.clone()), rtol=0, atol=0)
    static = [sample(64 * 4096) for _ in range(3)]
    graph = CudaGraph()
    warm_and_capture(graph, lambda: [fast.all_reduce(t) for t in static], None, sync=True)
    for _ in range(3):
        inputs = [sample(t.numel()) for t in static]
        for t, x in zip(static, inputs, strict=True):
            t.copy_(x)
        graph.replay()
        eager = sample(4096)
        torch.testing.assert_close(fast.all_reduce(eager.clone()), group.all_reduce(eager.clone()), rtol=0, atol=0)
        for t, x in zip(static, inputs, strict=True):
            torch.testing.assert_close(t, group.all_reduce(x), rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_custom_all_reduce_equals_nccl_bit_for_bit_eager_and_in_a_cuda_graph():
    from tests.helpers import run_two_ranks

    run_two_ranks(_p2p_all_reduce_rank, spawn_both=True)
