"""plait against Hugging Face transformers on the same tiny weights (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from plait.testing import TINY_ARCHS
from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids

PROMPTS = prompt_ids(8)


@pytest.fixture(scope="module")
def references(tiny_model_dir, hf_reference):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tiny_model_dir(arch)
            cache[arch] = [hf_reference(path, p, 32) for p in PROMPTS]
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_reference_outputs_are_informative(arch, references):
    for ref in references(arch):
        assert len(set(ref.tokens)) >= 8, "reference output too repetitive to prove anything"
        assert ref.min_margin > 1e-4, "a near-tie in the reference could flip on another CPU"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_tokens_equal_transformers(arch, tiny_model_dir, references):
    engine = make_engine(tiny_model_dir(arch))
    outs = engine.generate(PROMPTS, GREEDY)
    for out, ref in zip(outs, references(arch), strict=True):
        assert out.token_ids == ref.tokens
        assert out.finish_reason == "length"
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_close_to_transformers_at_prefill_and_16_decode_steps(arch, tiny_model_dir, references):
    engine = make_engine(tiny_model_dir(arch))
    seen: dict[str, list[torch.Tensor]] = {}

    def record(reqs, logits):
        for req, row in zip(reqs, logits, strict=True):
            seen.setdefault(req.rid, []).append(row.clone())

    engine.scheduler.on_logits = record
    outs = engine.generate(PROMPTS, {"temperature": 0.0, "max_new_tokens": 17})
    for out, ref in zip(outs, references(arch), strict=True):
        got = torch.stack(seen[out.rid])
        assert got.dtype == torch.float32
        assert got.shape == ref.logits[:17].shape
        torch.testing.assert_close(got, ref.logits[:17], atol=1e-4, rtol=1e-4)
