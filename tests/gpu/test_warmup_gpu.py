"""The start-up warm-up on the GPU: after it, the first long prompt and the first offline run compile
no Triton kernel (every launch-shape class they meet was warmed), measured in a fresh process over an
empty Triton cache; and greedy output with the warm-up equals output without it."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.bench.shapes import SHAPES  # noqa: E402
from plait.bench.warm_start import measure_in_subprocess  # noqa: E402
from plait.bench.workloads import make_engine, random_prompts  # noqa: E402

SHAPE = "llama-3.2-1b"
VOCAB = SHAPES[SHAPE]["vocab_size"]


def test_first_requests_after_the_warmup_compile_no_triton_kernel(shape_dir, tmp_path):
    spec = {"shape_dir": shape_dir, "vocab": VOCAB, "warmup": "on", "ttft_prompt_len": 8192, "num_requests": 64,
            "input_len": 512, "output_len": 32, "context_length": 16384}
    out = measure_in_subprocess(spec, str(tmp_path / "triton-cache"), timeout_s=400)
    compiles = out["triton_compiles"]
    assert compiles["start"]["total"] > 0  # the cache was cold: the warm-up compiled
    for stage in ("ttft_first", "ttft_second", "offline_first", "offline_second"):
        assert compiles[stage]["total"] == 0, (stage, compiles[stage]["by_kernel"])


def test_greedy_output_with_the_warmup_equals_output_without_it(shape_dir):
    prompts = random_prompts(8, [17, 64, 65, 300, 1000, 5, 2048, 129], VOCAB, seed=3)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 16}
    tokens = []
    for mode in ("off", "on"):
        engine = make_engine(shape_dir, warmup=mode, context_length=4096)
        tokens.append([o.token_ids for o in engine.generate(prompts, params)])
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[1]
