"""The real trained model loads in plait and continues English text as transformers does."""

from __future__ import annotations

import pathlib

import torch

import plait
from tests.conftest import hf_model


def test_real_model_greedy_continuation_matches_transformers(real_model_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    prompt = "The capital of France is"
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    hf = hf_model(real_model_dir)  # the session's fp32 transformers model (shared with test_fp8)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    with plait.Engine(model=str(real_model_dir), dtype="float32") as engine:
        out = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert out.token_ids == ref
    assert "Paris" in out.text
