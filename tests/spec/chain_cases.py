"""What the tests of chained NGRAM verifies over verify graphs share (test_launch_ahead.py,
test_stage_next.py): three prompts, greedy params, the chain engine on the Triton backend under the
interpreter with the verify graphs' EagerGraph stand-in, its drafter's cache holding the reference."""

from __future__ import annotations

import pathlib
from typing import Any

import plait
from plait.executor.graph_utils import EagerGraph, capture_batch_sizes
from plait.executor.verify_graph_runner import VerifyGraphRunner
from tests.helpers import make_engine, prompt_ids

PROMPTS = prompt_ids(3)
GREEDY = {"temperature": 0.0, "max_new_tokens": 16}
CHAIN = {"attention_backend": "triton", "speculative_algorithm": "NGRAM",
         "speculative_ngram_min_match_window_size": 1, "max_total_tokens": 1024}


def chain_engine(one_layer: pathlib.Path, max_running_requests: int, reference: list[list[int]] | None = None,
                 **flags: Any) -> plait.Engine:
    """Verify graphs for the batch sizes the engine can run (each capture runs the interpreter); with
    ``reference``, the drafter's cache holds each prompt followed by its reference output."""
    engine = make_engine(one_layer, max_running_requests=max_running_requests, **CHAIN, **flags)
    engine.runner.verify_graph_runner = VerifyGraphRunner(
        engine.runner.capture_target(), capture_batch_sizes(max_running_requests), (2, 3, 4), graph_factory=EagerGraph)
    if reference is not None:
        for p, ref in zip(PROMPTS, reference, strict=True):
            engine.scheduler.spec_worker.drafter.cache.insert(p + ref)
    return engine
