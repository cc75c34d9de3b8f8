"""Shared fixtures: tiny checkpoints (written once per session) and the transformers reference."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter on CPU tensors. Set before any module that
# defines a @triton.jit kernel is imported (the decorator reads it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from plait.triton_utils import (
            patch_interpreter_for_numpy,
            patch_interpreter_fp8_casts,
            patch_interpreter_nested_calls,
        )

        patch_interpreter_for_numpy()
        patch_interpreter_fp8_casts()
        patch_interpreter_nested_calls()
    except ImportError:  # triton not installed: the Triton tests skip themselves
        pass

from plait.testing import make_tiny_model

# pytest-xdist workers share the cores: each takes its share, so the workers never oversubscribe them.
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """arch -> checkpoint directory, each written once per test session."""
    cache: dict[str, pathlib.Path] = {}

    def get(arch: str) -> pathlib.Path:
        if arch not in cache:
            cache[arch] = make_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=0)
        return cache[arch]

    return get


@dataclass
class Reference:
    tokens: list[int]  # greedy continuation
    logits: torch.Tensor  # [len(tokens), vocab] float32: logits that produced each token
    min_margin: float  # smallest top-2 margin over the steps


_HF_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture(scope="session")
def one_layer(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A 1-layer tiny llama (seed 0): what Triton-interpreter engine runs use to stay short."""
    return make_tiny_model(tmp_path_factory.mktemp("one_layer"), "llama", seed=0, num_hidden_layers=1)


def hf_model(path: pathlib.Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _HF_MODELS:
        _HF_MODELS[key] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_MODELS[key]


@torch.inference_mode()
def hf_greedy(path: pathlib.Path, prompt_ids: list[int], n: int) -> Reference:
    """transformers, one prompt at a time, no padding: greedy tokens and the logits of each step."""
    model = hf_model(path)
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1].float()
    tokens: list[int] = []
    steps: list[torch.Tensor] = []
    margins: list[float] = []
    for _ in range(n):
        steps.append(logits)
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return Reference(tokens, torch.stack(steps), min(margins))


@pytest.fixture(scope="session")
def hf_reference():
    return hf_greedy


@pytest.fixture(scope="session")
def real_model_dir() -> pathlib.Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (fetched and converted once, then cached)."""
    from plait.testing.real_model import smollm2_hf_dir

    return smollm2_hf_dir()
