"""Programmatic dependent launch (plait.layers.pdl) changes when kernels start, never what they
compute: with ``PLAIT_PDL=1`` a graph-replayed engine gives the very logits and tokens it gives
without it (H200, bf16, llama-3.2-1b shape with random weights)."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.bench.shapes import SHAPES  # noqa: E402
from plait.bench.workloads import make_engine, random_prompts  # noqa: E402

SHAPE = "llama-3.2-1b"
VOCAB = SHAPES[SHAPE]["vocab_size"]
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 48}


def _run(shape_dir: str, pdl: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], torch.Tensor]:
    monkeypatch.setenv("PLAIT_PDL", pdl)
    engine = make_engine(shape_dir, max_running_requests=8, disable_radix_cache=True)
    assert engine.runner.graph_runner is not None
    prompts = random_prompts(6, 40, VOCAB, seed=5)  # bs 6: a padded graph bucket
    outs = engine.generate(prompts, {**GREEDY, "logprobs": True})
    tokens = [o.token_ids for o in outs]
    logprobs = torch.tensor([[lp[0] for lp in o.meta_info["output_token_logprobs"]] for o in outs])
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, logprobs


def test_pdl_launches_give_the_same_tokens_and_logprobs_as_plain_launches(shape_dir, monkeypatch):
    plain_tokens, plain_lp = _run(shape_dir, "0", monkeypatch)
    pdl_tokens, pdl_lp = _run(shape_dir, "1", monkeypatch)
    assert pdl_tokens == plain_tokens
    assert torch.equal(pdl_lp, plain_lp)


def test_pdl_with_the_pre_wait_loads_gives_the_same_tokens_and_logprobs_as_plain_launches(shape_dir, monkeypatch):
    # PLAIT_PDL_PRELOAD: RMSNorm's weight and rotary's table, positions and slots load before the wait.
    plain_tokens, plain_lp = _run(shape_dir, "0", monkeypatch)
    monkeypatch.setenv("PLAIT_PDL_PRELOAD", "1")
    pdl_tokens, pdl_lp = _run(shape_dir, "1", monkeypatch)
    assert pdl_tokens == plain_tokens
    assert torch.equal(pdl_lp, plain_lp)
