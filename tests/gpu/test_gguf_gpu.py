"""GGUF checkpoints on the GPU fast path (triton backend, CUDA graphs, bf16): a tiny Llama 3 written
as an F32 GGUF holds exactly the weights of its Hugging Face directory, so both must give the same
greedy tokens; a Q8_0 file of it runs through the same path (its tokens may differ: quantization
noise against the small logit margins of a random model)."""

from __future__ import annotations

import pathlib

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import plait  # noqa: E402
from plait.testing import make_tiny_model  # noqa: E402
from plait.testing.gguf_writer import write_gguf  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7, 123, 64, 250], [11, 300, 12, 13, 401, 8]]
PARAMS = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def _greedy(model: pathlib.Path) -> list[list[int]]:
    with plait.Engine(model=str(model), device="cuda", dtype="bfloat16", max_total_tokens=4096) as engine:
        assert not engine.config.disable_cuda_graph
        return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]


def test_a_gguf_runs_the_gpu_fast_path_with_its_hf_checkpoints_tokens(tmp_path):
    src = make_tiny_model(tmp_path / "hf", "llama3", seed=0)
    (tmp_path / "f32").mkdir()
    (tmp_path / "q8").mkdir()
    f32 = write_gguf(src, tmp_path / "f32" / "model.gguf")
    q8 = write_gguf(src, tmp_path / "q8" / "model.gguf", default_type="Q8_0")
    reference = _greedy(src)
    assert _greedy(f32) == reference
    q8_tokens = _greedy(q8)
    assert [len(t) for t in q8_tokens] == [PARAMS["max_new_tokens"]] * len(PROMPTS)
    assert all(len(set(t)) > 1 for t in q8_tokens)
