"""SGLang's and vLLM's spellings of plait's engine flags, the values they accept, and the parser that
names the closest flag when a user types one plait does not have.

One argparse action per option carries every spelling (``--tp-size``, ``--tp``,
``--tensor-parallel-size``), so an alias cannot drift from plait's own flag: it is the same action,
with the same type, default and ``dest`` (the ``EngineConfig`` field). docs/sglang-compat.md is the
table of all of them.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from plait.config import GRAMMAR_BACKENDS, WARMUP_MODES

# EngineConfig fields whose flags are declared here (with their aliases) instead of being generated
# from the dataclass by plait.cli.add_dataclass_flags.
ALIASED_FIELDS: tuple[str, ...] = (
    "tokenizer", "dtype", "mem_fraction_static", "max_running_requests", "context_length",
    "chunked_prefill_size", "tp_size", "dp_size", "warmup", "cuda_graph_bs", "disable_cuda_graph",
    "disable_radix_cache", "decode_log_interval", "grammar_backend", "json_model_override_args",
)

# --dtype: vLLM's and SGLang's names -> EngineConfig.dtype.
DTYPE_ALIASES: dict[str, str] = {
    "auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
    "float": "float32", "float32": "float32",
}

# Suffixes of token counts as vLLM reads them: lower case decimal, upper case binary.
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}
_COUNT = re.compile(r"(?P<num>\d+(?:\.\d+)?)(?P<suffix>[kmgKMG]?)")


def parse_token_count(raw: str) -> int:
    """``32k`` -> 32000, ``32K`` -> 32768, ``1.5k`` -> 1500, ``4096`` -> 4096; anything else raises
    ``ValueError`` (a binary suffix takes a whole number, as in vLLM)."""
    m = _COUNT.fullmatch(raw.strip())
    if m is None:
        raise ValueError(raw)
    num, suffix = m["num"], m["suffix"]
    if suffix in _BINARY:
        if "." in num:
            raise ValueError(raw)
        return int(num) * _BINARY[suffix]
    scale = _DECIMAL.get(suffix, 1)
    value = float(num) * scale if "." in num else int(num) * scale
    if value != int(value):
        raise ValueError(raw)
    return int(value)


def token_count_type(flag: str) -> Callable[[str], int]:
    """argparse type for a token count; argparse prefixes the error with the flag's spellings."""

    def parse(raw: str) -> int:
        try:
            return parse_token_count(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a token count: a whole number, or one with a suffix as vLLM reads it "
                f"(k = 1000, m = 10^6, K = 1024, M = 2^20: 32k = 32000, 32K = 32768); got {raw!r}") from None

    return parse


def dtype_type(raw: str) -> str:
    try:
        return DTYPE_ALIASES[raw]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"--dtype must be one of {', '.join(DTYPE_ALIASES)}; got {raw!r}") from None


def add_engine_alias_flags(parser: argparse.ArgumentParser) -> None:
    """The engine flags that have other spellings (SGLang's first, then vLLM's)."""
    group = parser.add_argument_group("engine flags with SGLang / vLLM spellings")
    group.add_argument("--model", "--model-path", dest="model", default=None,
                       help="Hugging Face checkpoint directory or GGUF file (default: the demo model, "
                       "SmolLM2-135M-Instruct)")
    group.add_argument("--tokenizer", "--tokenizer-path", dest="tokenizer", default=None,
                       help="tokenizer directory (default: the --model directory)")
    group.add_argument("--dtype", type=dtype_type, default=None, metavar="{" + ",".join(DTYPE_ALIASES) + "}",
                       help="weights and activations (half = float16, float = float32; auto: the checkpoint's)")
    group.add_argument("--tp-size", "--tp", "--tensor-parallel-size", dest="tp_size", type=int, default=None,
                       help="tensor-parallel ranks")
    group.add_argument("--dp-size", "--dp", "--data-parallel-size", dest="dp_size", type=int, default=None,
                       help="data-parallel replicas (or DP-attention ranks with --enable-dp-attention)")
    group.add_argument("--mem-fraction-static", "--gpu-memory-utilization", dest="mem_fraction_static",
                       type=float, default=None, help="fraction of GPU memory for weights and the KV pool")
    group.add_argument("--max-running-requests", "--max-num-seqs", dest="max_running_requests", type=int,
                       default=None, help="requests decoded together at most")
    group.add_argument("--context-length", "--max-model-len", dest="context_length",
                       type=token_count_type("--context-length"), default=None,
                       help="longest prompt + output in tokens (32k = 32000, 32K = 32768; default: the model's)")
    group.add_argument("--chunked-prefill-size", "--max-num-batched-tokens", dest="chunked_prefill_size", type=int,
                       default=None, help="prefill tokens per step (the running requests' decode tokens come on "
                       "top); longer prompts are split (-1: no chunking, a prompt is prefilled in one step)")
    group.add_argument("--no-enable-chunked-prefill", dest="chunked_prefill_size", action="store_const", const=-1,
                       help="vLLM's spelling of --chunked-prefill-size -1")
    group.add_argument("--enable-chunked-prefill", action="store_true", default=False,
                       help="accepted for vLLM commands: chunked prefill is on unless --chunked-prefill-size -1")
    group.add_argument("--disable-radix-cache", "--no-enable-prefix-caching", dest="disable_radix_cache",
                       action="store_true", default=None, help="no prefix cache: every prompt is prefilled whole")
    group.add_argument("--enable-prefix-caching", action="store_true", default=False,
                       help="accepted for vLLM commands: the prefix cache is on unless --disable-radix-cache")
    group.add_argument("--disable-cuda-graph", "--enforce-eager", dest="disable_cuda_graph", action="store_true",
                       default=None, help="run every step eagerly (no CUDA graphs)")
    group.add_argument("--pipeline-parallel-size", "--pp-size", default="1", help="accepted as 1 only",
                       type=only_value("1", "plait has no pipeline parallelism (split a model over GPUs with "
                                       "--tp-size)"))
    group.add_argument("--speculative-config", type=json_object_type("--speculative-config"), default=None,
                       metavar="JSON", help="vLLM's speculative decoding config ({\"method\": \"ngram\" | \"eagle\" | "
                       "\"eagle3\" | \"draft_model\", \"model\", \"num_speculative_tokens\", \"prompt_lookup_min\", "
                       "\"prompt_lookup_max\"}), as plait's --speculative-* flags")
    group.add_argument("--cpu-offload-gb", default="0", help="accepted as 0 only",
                       type=only_value("0", "plait keeps every weight on the device"))
    group.add_argument("--tokenizer-mode", default="auto", help="accepted as auto only (the fast tokenizer)",
                       type=only_value("auto", "plait loads the fast (Rust) tokenizer"))
    group.add_argument("--num-scheduler-steps", default="1", help="accepted as 1 only",
                       type=only_value("1", "plait schedules every step (it overlaps the next step's scheduling "
                                       "with the forward instead)"))
    group.add_argument("--enable-expert-parallel", action="store_true", default=False,
                       help="vLLM's: the experts of a mixture-of-experts model spread over the tensor-parallel "
                       "ranks (--ep-size equal to --tp-size)")
    group.add_argument("--grammar-backend", "--guided-decoding-backend", dest="grammar_backend",
                       choices=GRAMMAR_BACKENDS, default=None,
                       help="xgrammar compiles constrained requests; none refuses them")
    group.add_argument("--json-model-override-args", "--hf-overrides", dest="json_model_override_args", default=None,
                       metavar="JSON", help="config.json fields to replace, as a JSON object (e.g. a YaRN "
                       "rope_scaling with a larger max_position_embeddings)")
    group.add_argument("--decode-log-interval", dest="decode_log_interval", type=int, default=None,
                       help="plait serve: the scheduler process logs its load and throughput every this many "
                       "steps (0: never)")
    group.add_argument("--disable-log-stats", dest="decode_log_interval", action="store_const", const=0,
                       help="vLLM's spelling of --decode-log-interval 0")
    group.add_argument("--warmup", dest="warmup", choices=WARMUP_MODES, default=None,
                       help="warm every launch-shape class at start (auto: on a GPU only)")
    group.add_argument("--skip-warmup", "--skip-server-warmup", dest="warmup", action="store_const", const="off",
                       help="start without the warm-up (the first requests then pay Triton's compiles)")
    group.add_argument("--cuda-graph-bs", dest="cuda_graph_bs", type=int, nargs="+", default=None, metavar="BS",
                       help="batch sizes to capture CUDA graphs for, ascending (default: 1 2 4 8, then steps of 8 "
                       "up to --cuda-graph-max-bs); a larger batch runs eagerly")
    group.add_argument("--enable-mixed-chunk", action="store_true", default=False,
                       help="accepted for SGLang commands: plait's steps always carry the running requests' decode "
                       "tokens beside a prefill chunk")
    group.add_argument("--trust-remote-code", action="store_true", default=False,
                       help="accepted for SGLang / vLLM commands; plait runs no code from checkpoints, and one "
                       "that needs it (auto_map, an architecture plait does not implement) is refused")


# vLLM's --speculative-config methods -> plait's speculative algorithms.
VLLM_SPECULATIVE_METHODS: dict[str, str] = {"ngram": "NGRAM", "eagle": "EAGLE", "eagle3": "EAGLE3",
                                            "draft_model": "STANDALONE"}
VLLM_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def json_object_type(flag: str) -> Callable[[str], dict[str, Any]]:
    def parse(raw: str) -> dict[str, Any]:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object, got {raw!r}")
        return value

    return parse


def vllm_speculative_options(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's --speculative-config as plait's speculative EngineConfig fields: ``num_speculative_tokens``
    k is a chain of k guesses (k steps, top-k 1, k + 1 draft tokens with the root); ``prompt_lookup_*``
    are the n-gram match windows; a method-less config with a ``model`` is a draft model."""
    unknown = sorted(set(spec) - set(VLLM_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unknown key(s) {unknown}; plait takes "
                         f"{', '.join(VLLM_SPECULATIVE_KEYS)}")
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    if method not in VLLM_SPECULATIVE_METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not one plait runs; choose one of "
                         f"{', '.join(VLLM_SPECULATIVE_METHODS)}")
    out: dict[str, Any] = {"speculative_algorithm": VLLM_SPECULATIVE_METHODS[method]}
    if spec.get("model") is not None:
        out["speculative_draft_model_path"] = spec["model"]
    k = spec.get("num_speculative_tokens")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        out |= {"speculative_num_steps": k, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1}
    for key, field in (("prompt_lookup_min", "speculative_ngram_min_match_window_size"),
                       ("prompt_lookup_max", "speculative_ngram_max_match_window_size")):
        if spec.get(key) is not None:
            out[field] = spec[key]
    return out


def only_value(value: str, why: str) -> Callable[[str], str]:
    """argparse type of a flag plait takes at one value only (what it always does): that value, else
    an error saying ``why``."""

    def parse(raw: str) -> str:
        if raw.strip() != value:
            raise argparse.ArgumentTypeError(f"{why}: it must be {value}; got {raw!r}")
        return value

    return parse


# SGLang and vLLM flags that tune their own kernels or memory and have no counterpart here: accepted,
# so that such a command runs as it is, with a warning that says what plait does instead.
# dest -> that sentence.
UNUSED_FLAGS: dict[str, str] = {
    "enable_torch_compile": "--enable-torch-compile is not used: plait's decode runs its own fused Triton kernels "
    "under CUDA graphs",
    "torch_compile_max_bs": "--torch-compile-max-bs is not used: plait does not run torch.compile",
    "page_size": "--page-size is not used: plait's KV cache and prefix cache work per token (page size 1)",
    "block_size": "--block-size is not used: plait's KV cache and prefix cache work per token (block size 1)",
    "swap_space": "--swap-space is not used: a retracted request recomputes its KV instead of swapping it to the CPU",
    "enable_reasoning": "--enable-reasoning is not needed: --reasoning-parser alone splits the reasoning out",
    "max_seq_len_to_capture": "--max-seq-len-to-capture is not used: plait's decode graphs hold every context length",
    "disable_frontend_multiprocessing": "--disable-frontend-multiprocessing is not used: plait's HTTP front end "
    "always runs in its own process, apart from the scheduler's",
    "sampling_backend": "--sampling-backend is not used: plait samples with its own batched sampler",
    "enable_p2p_check": "--enable-p2p-check is not used: plait's symmetric-memory collectives fall back to NCCL "
    "where the build lacks them",
    "show_time_cost": "--show-time-cost is not used: the scheduler process's decode line (--decode-log-interval) "
    "and /metrics report the timings",
}


def add_unused_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("accepted for SGLang / vLLM commands, not used (a warning says so)")
    group.add_argument("--enable-torch-compile", action="store_true", default=False)
    group.add_argument("--torch-compile-max-bs", type=int, default=None)
    group.add_argument("--page-size", type=int, default=None)
    group.add_argument("--block-size", type=int, default=None)
    group.add_argument("--swap-space", type=float, default=None)
    group.add_argument("--enable-reasoning", action="store_true", default=False)
    group.add_argument("--max-seq-len-to-capture", type=int, default=None)
    group.add_argument("--disable-frontend-multiprocessing", action="store_true", default=False)
    group.add_argument("--sampling-backend", default=None)
    group.add_argument("--enable-p2p-check", action="store_true", default=False)
    group.add_argument("--show-time-cost", action="store_true", default=False)


def unused_flag_warnings(args: argparse.Namespace) -> list[str]:
    """One sentence per UNUSED_FLAGS flag the command line set."""
    return [why for dest, why in UNUSED_FLAGS.items() if getattr(args, dest, None) not in (None, False)]


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    # argparse has no public list of a parser's flags; its actions are the one source.
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def unrecognized_message(extras: Sequence[str], known: Sequence[str]) -> str:
    """'unrecognized argument --x; the closest flag is --y' for each unknown flag in ``extras``."""
    parts = []
    for arg in extras:
        if not arg.startswith("-"):
            continue  # the value of an unknown flag
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f"; the closest flag is {close[0]}" if close else "; see --help for the flags"
        parts.append(f"unrecognized argument {name} (plait does not implement it){hint}")
    return "; ".join(parts) or f"unrecognized arguments: {' '.join(extras)}"


class PlaitArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose error for an unknown flag names the closest flag of the (sub)command
    that was given it, not just 'unrecognized arguments'."""

    _UNKNOWN_FROM = "_plait_unknown_flags_parser"

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        # The innermost subcommand parser runs first (argparse calls it from its parent's action)
        # and records itself; its parents see the attribute already set.
        if extras and not hasattr(ns, self._UNKNOWN_FROM):
            setattr(ns, self._UNKNOWN_FROM, self)
        return ns, extras

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        owner: Any = getattr(ns, self._UNKNOWN_FROM, self)
        if extras:
            owner.error(unrecognized_message(extras, option_strings(owner)))
        if hasattr(ns, self._UNKNOWN_FROM):
            delattr(ns, self._UNKNOWN_FROM)
        return ns
