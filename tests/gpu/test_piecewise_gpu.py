"""Piecewise graphs on the GPU (llama-3.2-1b shape, random weights, bf16): EXTEND and MIXED steps
replayed as breakable CUDA graphs give the eager path's greedy tokens and prefill logits."""

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
# One bucket each (16, 64, 256, 512) and one above the maximum (eager); then all of them batched
# with chunks of 512, so later steps are MIXED (decode rows beside a prefill chunk).
LENGTHS = [7, 50, 200, 500, 700]
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 16}


def _run(shape_dir: str, **options):
    engine = make_engine(shape_dir, chunked_prefill_size=MAX_TOKENS, disable_radix_cache=True, **options)
    first: dict[str, torch.Tensor] = {}

    def record(reqs, logits):
        for req, row in zip(reqs, logits, strict=True):
            first.setdefault(req.rid, row.float().clone())

    engine.scheduler.on_logits = record
    prompts = random_prompts(len(LENGTHS), LENGTHS, VOCAB, seed=3)
    single = [engine.generate([p], GREEDY)[0] for p in prompts]
    batched = engine.generate(prompts, GREEDY)
    runner = engine.runner.piecewise_runner
    stats = (dict(runner.replays), dict(runner.replayed_modes),
             isinstance(next(iter(runner.graphs.values())), CudaBreakableGraph)) if runner else None
    logits = torch.stack([first[o.rid] for o in single])
    tokens = [o.token_ids for o in single], [o.token_ids for o in batched]
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, logits, stats


def test_piecewise_graphs_match_the_eager_path(shape_dir):
    (off_single, off_batched), off_logits, _ = _run(shape_dir)
    (on_single, on_batched), on_logits, stats = _run(shape_dir, enable_piecewise_cuda_graph=True,
                                                     piecewise_cuda_graph_max_tokens=MAX_TOKENS)
    replays, modes, cuda = stats
    assert cuda
    assert {16, 64, 256, 512} <= set(replays), replays
    assert modes.get(ForwardMode.MIXED, 0) >= 1, modes
    torch.testing.assert_close(on_logits, off_logits, atol=5e-2, rtol=5e-2)
    assert on_single == off_single
    assert on_batched == off_batched
