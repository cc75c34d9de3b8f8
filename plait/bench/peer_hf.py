"""The peer: Hugging Face transformers on the same shape (random weights), timed like plait."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from plait.bench.hardware import bench_device, bench_dtype, sync
from plait.bench.shapes import SHAPES

# Architectures whose transformers attention has no SDPA path (gpt-oss: its sinks join the softmax):
# their peer runs eager attention ("paged|eager" under generate_batch).
NO_SDPA = frozenset({"gpt_oss"})


def attention_for(shape: str, paged: bool = False) -> str:
    eager = SHAPES[shape]["model_type"] in NO_SDPA
    return ("paged|eager" if eager else "paged|sdpa") if paged else ("eager" if eager else "sdpa")


# transformers' paged eager attention materialises a whole batch's scores, [heads, T, T + cached] in
# bf16 (then more copies: the sinks joined, an fp32 softmax). At its default of 8192 tokens per batch
# that is 8 GiB a copy for gpt-oss-20b's 64 heads, more than the share of memory its KV cache sizing
# leaves free (90% of what the model leaves goes to the cache): the 16-request peer ran out of memory
# on an H200 and generated nothing. Eager peers batch at most this many tokens (a 512-token prompt
# workload still prefills four requests per batch) and give the cache a smaller share of memory (16
# requests of 640 tokens need under 1 GiB of it).
EAGER_MAX_BATCH_TOKENS = 2048
EAGER_CACHE_MEMORY_FRACTION = 0.6


def gpu_batching_config(shape: str) -> Any:
    """The ``ContinuousBatchingConfig`` of the shape's ``generate_batch`` peer on a GPU: bounded for
    eager-attention shapes (see ``EAGER_MAX_BATCH_TOKENS``), None (transformers' defaults) otherwise."""
    if SHAPES[shape]["model_type"] not in NO_SDPA:
        return None
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(max_batch_tokens=EAGER_MAX_BATCH_TOKENS,
                                    max_memory_percent=EAGER_CACHE_MEMORY_FRACTION)


def hf_model(shape: str, attn_implementation: str | None = None) -> torch.nn.Module:
    """The shape with random weights, on the benchmark's device and dtype (plait.bench.hardware);
    ``attn_implementation`` defaults to ``attention_for(shape)``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {k: v for k, v in SHAPES[shape].items() if k not in ("architectures",)}
    cfg = AutoConfig.for_model(**cfg_dict)
    with torch.device(bench_device()):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, bench_dtype()),
                                                 attn_implementation=attn_implementation or attention_for(shape))
    return model.eval()


def free(*objs: Any) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.inference_mode()
def _timed_generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, **kwargs: Any) -> float:
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    sync()
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t0


def decode_bs1(shape: str, prompt: list[int], new_tokens: int, compiled: bool) -> dict[str, float]:
    """Decode tokens/s at bs=1: (new_tokens - 1) / (t(new_tokens) - t(1)), prefill excluded.
    ``compiled``: static cache + torch.compile(mode="reduce-overhead"), transformers' fastest form."""
    model = hf_model(shape)
    ids = torch.tensor([prompt], device=bench_device())
    kwargs: dict[str, Any] = {}
    if compiled:
        # transformers compiles the forward itself for a static cache (its CompileConfig:
        # torch.compile(fullgraph=True, mode="reduce-overhead")); compiling model.forward by hand
        # as well breaks its cudagraph bookkeeping.
        from transformers import CompileConfig

        kwargs["cache_implementation"] = "static"
        kwargs["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
    t_compile = time.perf_counter()
    # Warm-up. A static cache is sized by prompt + max_new_tokens, so the compiled form compiles (and
    # records its CUDA graphs) once per length: warm up exactly the two timed lengths, or the timed
    # calls would include compilation.
    for n in ((new_tokens, 1) if compiled else (min(16, new_tokens),)):
        for _ in range(2):
            _timed_generate(model, ids, n, **kwargs)
    warmup_s = time.perf_counter() - t_compile
    t_one = min(_timed_generate(model, ids, 1, **kwargs) for _ in range(2))
    t_all = _timed_generate(model, ids, new_tokens, **kwargs)
    free(model)
    return {"tok_s": (new_tokens - 1) / (t_all - t_one), "prefill_s": t_one, "total_s": t_all, "warmup_s": warmup_s,
            "attn_implementation": attention_for(shape)}


def generate_batch_throughput(shape: str, prompts: list[list[int]], new_tokens: list[int] | int
                              ) -> dict[str, Any]:
    """transformers' continuous batching (``generate_batch``): output tokens/s over all requests."""
    from transformers import GenerationConfig

    attn = attention_for(shape, paged=True)
    model = hf_model(shape, attn_implementation=attn)
    max_new = new_tokens if isinstance(new_tokens, int) else max(new_tokens)
    gen_cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    config = {"attn_implementation": attn, "max_new_tokens": max_new, "do_sample": False,
              "eos_token_id": None, "note": "per-request lengths not supported: every request runs max_new_tokens"
              if not isinstance(new_tokens, int) else None}
    cb = gpu_batching_config(shape) if torch.cuda.is_available() else _cpu_batching_config(prompts, max(max_new, 8))
    config["continuous_batching_config"] = None if cb is None else vars(cb)
    model.generate_batch(inputs=prompts[:4], generation_config=GenerationConfig(max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=0), continuous_batching_config=cb, progress_bar=False)
    sync()
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen_cfg, continuous_batching_config=cb,
                                   progress_bar=False)
    sync()
    seconds = time.perf_counter() - t0
    generated = sum(len(r.generated_tokens) for r in results.values())
    free(model)
    return {"output_tok_s": generated / seconds, "seconds": seconds, "generated_tokens": generated, "config": config}


def _cpu_batching_config(prompts: list[list[int]], max_new: int) -> Any:
    """A paged cache sized for the workload: on the CPU transformers otherwise sizes it from the
    machine's memory, and a run of a tiny shape spends its time on the cache, not the model."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 64
    pages = sum(-(-(len(p) + max_new) // page) for p in prompts) + 4
    return ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=256, page_size=page, use_cuda_graph=False)
