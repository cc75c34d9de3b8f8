"""``plait bench agreement``: plait in bf16 against an fp32 reference, beside transformers' own bf16 run
on the same prompts (the correctness bar of docs/benchmarks.md: plait's agreement at least as high as
transformers').

The reference is transformers in float32 on the same weights, with TF32 off: its greedy continuation
of each prompt (``new_tokens`` tokens, one cached forward per token, EOS not special). Two measures
per bf16 run, each over every prompt:

- ``teacher_forced``: the fraction of the reference's continuation positions where the run's top-1
  token, given the reference's prefix, is the reference's token. plait scores the prompt plus the
  reference continuation as one request (prompt-token top logprobs, its prefill path);
  transformers runs one forward over the same ids.
- ``greedy_prefix``: the run's own greedy continuation (plait: the engine's decode steps, CUDA
  graphs included; transformers: one cached forward per token), the mean fraction of it that
  equals the reference before the first difference.

The headline (``plait``) is plait's teacher-forced agreement and the peer transformers'; ``meets_bar``
holds when each of plait's two measures is at least transformers' less two binomial standard errors of
the positions or prompts counted (so two runs equal up to the sample do not fail on noise).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import pathlib
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch

# The default checkpoint: the tiny Llama preset grown to realistic per-layer sizes (hidden 2048, 32
# query / 8 KV heads of 64, MLP 8192), so bf16 runs the GEMV, GEMM and attention kernels a 1b-class
# model uses; eight layers keep the fp32 reference quick. Its tiny tokenizer leaves about 500 live ids.
DEFAULT_OVERRIDES: dict[str, int] = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 8,
                                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}
# Prompt ids are drawn from [FIRST_ID, vocabulary): the tiny tokenizer's specials sit below it.
FIRST_ID = 4


@dataclasses.dataclass(frozen=True)
class Agreement:
    """One bf16 run against the reference: ``teacher_forced`` over ``positions`` continuation
    positions, ``greedy_prefix`` over ``prompts`` continuations (each a fraction in [0, 1])."""

    teacher_forced: float
    greedy_prefix: float
    positions: int
    prompts: int
    greedy_exact: float  # continuations equal to the reference in full


def standard_error(p: float, n: int) -> float:
    """The binomial standard error of a fraction ``p`` over ``n`` draws."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / max(n, 1))


def meets_bar(run: Agreement, peer: Agreement) -> bool:
    """``run`` at least as high as ``peer`` on both measures, less two standard errors of the peer's."""
    tf_ok = run.teacher_forced >= peer.teacher_forced - 2 * standard_error(peer.teacher_forced, peer.positions)
    greedy_ok = run.greedy_prefix >= peer.greedy_prefix - 2 * standard_error(peer.greedy_prefix, peer.prompts)
    return tf_ok and greedy_ok


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, vocab, (num, length), generator=gen).tolist()


def prompt_vocab(model_dir: str, cap: int = 32000) -> int:
    """Prompt ids are drawn below this: the checkpoint's vocabulary size, at most ``cap``."""
    from transformers import AutoConfig

    return min(AutoConfig.from_pretrained(model_dir).vocab_size, cap)


def compare(reference: Sequence[Sequence[int]], teacher_forced: Sequence[Sequence[int]],
            greedy: Sequence[Sequence[int]]) -> Agreement:
    """``teacher_forced[i][j]``: the run's top-1 token for position j of prompt i's reference
    continuation; ``greedy[i]``: the run's own continuation of prompt i."""
    if not (len(reference) == len(teacher_forced) == len(greedy)):
        raise ValueError("compare: one teacher-forced row and one greedy row per reference")
    hits = positions = 0
    prefix_fractions: list[float] = []
    exact = 0
    for ref, tf, own in zip(reference, teacher_forced, greedy, strict=True):
        if len(tf) != len(ref) or len(own) != len(ref):
            raise ValueError(f"compare: rows of {len(tf)} and {len(own)} tokens for a reference of {len(ref)}")
        hits += sum(a == b for a, b in zip(tf, ref, strict=True))
        positions += len(ref)
        same = next((j for j, (a, b) in enumerate(zip(own, ref, strict=True)) if a != b), len(ref))
        prefix_fractions.append(same / len(ref))
        exact += same == len(ref)
    return Agreement(hits / positions, sum(prefix_fractions) / len(prefix_fractions), positions, len(reference),
                     exact / len(reference))


@contextlib.contextmanager
def full_fp32_matmuls() -> Iterator[None]:
    """float32 matmuls without TF32 (the reference must be the float32 result)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations, one cached forward per token over the whole batch (prompts of one
    length), EOS an ordinary token as under ``ignore_eos``."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    out = model(ids, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1)
    tokens = [nxt]
    for _ in range(new_tokens - 1):
        out = model(nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)
        tokens.append(nxt)
    return torch.stack(tokens, dim=1).tolist()


@torch.inference_mode()
def hf_teacher_forced(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                      reference: Sequence[Sequence[int]]) -> list[list[int]]:
    """Top-1 tokens at each reference position given the reference prefix: one forward over
    prompt + reference[:-1]."""
    device = next(model.parameters()).device
    p, n = len(prompts[0]), len(reference[0])
    ids = torch.tensor([[*pr, *ref[:-1]] for pr, ref in zip(prompts, reference, strict=True)], device=device)
    return model(ids).logits[:, p - 1: p - 1 + n].argmax(-1).tolist()


def hf_load(model_dir: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def hf_run(model_dir: str, dtype: torch.dtype, device: str, prompts: Sequence[Sequence[int]], new_tokens: int,
           reference: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """transformers on ``model_dir`` in ``dtype``: (greedy continuations, teacher-forced top-1 tokens
    over ``reference``)."""
    from plait.bench.peer_hf import free

    model = hf_load(model_dir, dtype, device)
    greedy, forced = hf_greedy(model, prompts, new_tokens), hf_teacher_forced(model, prompts, reference)
    free(model)
    return greedy, forced


def plait_run(model_dir: str, dtype: str, device: str, prompts: Sequence[Sequence[int]], new_tokens: int,
              reference: Sequence[Sequence[int]], **engine_options: Any) -> tuple[list[list[int]], list[list[int]]]:
    """plait's Engine with its defaults for ``device``: (greedy continuations, teacher-forced top-1
    tokens over ``reference``, from the prompt-token top logprobs of prompt + reference)."""
    from plait.engine import Engine

    engine = Engine(model=model_dir, device=device, dtype=dtype, **engine_options)
    try:
        greedy = [o.token_ids for o in engine.generate(
            input_ids=[list(p) for p in prompts],
            sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True})]
        scored = engine.generate(
            input_ids=[[*p, *ref] for p, ref in zip(prompts, reference, strict=True)],
            sampling_params={"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
            return_logprob=True, logprob_start_len=len(prompts[0]), top_logprobs_num=1)
    finally:
        engine.shutdown()
    # input_top_logprobs[j]: [[logprob, id, text]] for the prompt token at logprob_start_len + j.
    forced = [[entry[0][1] for entry in o.meta_info["input_top_logprobs"]] for o in scored]
    return greedy, forced


def write_tiny_checkpoint(root: str, overrides: dict[str, int], seed: int) -> str:
    from plait.models.tiny import make_tiny_model

    return str(make_tiny_model(pathlib.Path(root) / "agreement-llama", "llama", seed=seed, **overrides))


def measure(model_dir: str, device: str, prompts: Sequence[Sequence[int]], new_tokens: int,
            dtype: str = "bfloat16", **engine_options: Any) -> dict[str, Any]:
    """The reference, then transformers and plait in ``dtype`` on ``device``; each run's Agreement
    and whether plait meets the bar."""
    from plait.bench.peer_hf import free

    with full_fp32_matmuls():
        fp32 = hf_load(model_dir, torch.float32, device)
        reference = hf_greedy(fp32, prompts, new_tokens)
        free(fp32)
    torch_dtype = getattr(torch, dtype)
    hf_greedy_ids, hf_forced = hf_run(model_dir, torch_dtype, device, prompts, new_tokens, reference)
    plait_greedy_ids, plait_forced = plait_run(model_dir, dtype, device, prompts, new_tokens, reference,
                                               **engine_options)
    hf = compare(reference, hf_forced, hf_greedy_ids)
    ours = compare(reference, plait_forced, plait_greedy_ids)
    return {"plait": ours, "transformers": hf, "meets_bar": meets_bar(ours, hf)}


def cmd_agreement(args: argparse.Namespace) -> int:
    from plait.bench.hardware import bench_device
    from plait.bench.results import write_result

    device = bench_device()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_tiny_checkpoint(tmp, DEFAULT_OVERRIDES, args.seed)
        prompts = random_prompts(args.num_prompts, args.prompt_len, prompt_vocab(model_dir, args.max_prompt_id),
                                 args.seed)
        result = measure(model_dir, device, prompts, args.new_tokens, dtype=args.dtype)
    ours, hf = result["plait"], result["transformers"]
    shape = pathlib.Path(args.model).name if args.model else "llama-agreement"
    write_result(args.out, "bf16-agreement", shape,
                 "teacher_forced_top1_agreement", ours.teacher_forced, f"transformers {args.dtype}",
                 hf.teacher_forced, None,
                 {"dtype": args.dtype, "device": device, "model": args.model or {"tiny llama": DEFAULT_OVERRIDES},
                  "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                  "seed": args.seed},
                 tag=args.dtype, reference="transformers float32, TF32 off", plait_detail=dataclasses.asdict(ours),
                 peer_detail=dataclasses.asdict(hf), meets_bar=result["meets_bar"])
    print(f"agreement with fp32: plait {args.dtype} teacher-forced {ours.teacher_forced:.4f}, greedy prefix "
          f"{ours.greedy_prefix:.4f} (exact {ours.greedy_exact:.3f}); transformers {args.dtype} "
          f"{hf.teacher_forced:.4f}, {hf.greedy_prefix:.4f} (exact {hf.greedy_exact:.3f}); "
          f"meets bar: {result['meets_bar']}")
    return 0 if result["meets_bar"] else 1


def add_agreement_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser("agreement", help="bf16 against an fp32 reference, plait beside transformers' bf16 run")
    p.add_argument("--model", default=None,
                   help="a Hugging Face checkpoint directory (default: a random Llama of 1b-class layer sizes)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-id", type=int, default=32000,
                   help="prompt ids are drawn below this and below the vocabulary size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=cmd_agreement)
