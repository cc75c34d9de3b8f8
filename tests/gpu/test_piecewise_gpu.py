"""Piecewise graphs on the GPU (llama-3.2-1b shape, random weights, bf16): EXTEND and MIXED steps
replayed as breakable CUDA graphs give the eager path's greedy tokens and logits.

The graphs run the projections at the bucket's row count, so cuBLAS may pick other kernels than at
the live count: logits agree within a bf16 tolerance, not bit for bit, and a greedy token may differ
only where the eager step's top-2 margin is inside that tolerance (after which the sequences part)."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.bench.shapes import SHAPES  # noqa: E402
from plait.bench.workloads import make_engine, random_prompts  # noqa: E402
from plait.executor.piecewise_graph_runner import CudaBreakableGraph  # noqa: E402
from plait.forward_batch import ForwardMode  # noqa: E402

VOCAB = SHAPES["llama-3.2-1b"]["vocab_size"]
MAX_TOKENS = 512
# One bucket each (16, 64, 256, 512) and one above the maximum, chunked to 512 + 188; then all of
# them batched, so later steps are MIXED (decode rows beside a prefill chunk).
LENGTHS = [7, 50, 200, 500, 700]
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 16}
REL_TOL = 2e-2  # of the logit scale, as the decode-graph test (tests/gpu/test_engine_gpu.py)


def _run(shape_dir: str, **options):
    """Per request (single runs, then the batched run): its tokens and the logits of each step."""
    engine = make_engine(shape_dir, chunked_prefill_size=MAX_TOKENS, disable_radix_cache=True, **options)
    steps: dict[str, list[torch.Tensor]] = {}

    def record(reqs, logits):
        for req, row in zip(reqs, logits, strict=True):
            steps.setdefault(req.rid, []).append(row.float().cpu())

    engine.scheduler.on_logits = record
    prompts = random_prompts(len(LENGTHS), LENGTHS, VOCAB, seed=3)
    outs = [engine.generate([p], GREEDY)[0] for p in prompts] + engine.generate(prompts, GREEDY)
    runner = engine.runner.piecewise_runner
    stats = None
    if runner is not None:
        stats = (dict(runner.replays), dict(runner.replayed_modes),
                 all(isinstance(g, CudaBreakableGraph) for g in runner.graphs.values()))
    results = [(o.token_ids, torch.stack(steps[o.rid])) for o in outs]
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return results, stats


def test_piecewise_graphs_match_the_eager_path(shape_dir):
    eager, _ = _run(shape_dir)
    piecewise, stats = _run(shape_dir, enable_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=MAX_TOKENS)
    replays, modes, cuda = stats
    assert cuda
    assert {16, 64, 256, 512} <= set(replays), replays
    assert modes.get(ForwardMode.MIXED, 0) >= 1, modes
    for (want, want_logits), (got, got_logits) in zip(eager, piecewise, strict=True):
        tol = REL_TOL * want_logits.abs().max().item()
        for t, (a, b) in enumerate(zip(want, got, strict=True)):
            spread = (got_logits[t] - want_logits[t]).abs().max().item()
            assert spread <= tol, f"step {t}: piecewise vs eager logits differ by {spread} (tolerance {tol})"
            if a != b:
                top2 = want_logits[t].topk(2).values
                assert (top2[0] - top2[1]).item() <= 2 * tol, f"step {t}: token {b} != {a} at a clear margin"
                break
