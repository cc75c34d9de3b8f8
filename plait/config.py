"""Engine configuration: frozen dataclasses validated at construction.

Every field has one meaning and one validator; an invalid value raises ``ValueError`` naming the
field, the limit and what to change. Nothing mutates a config, during construction or after it:
values derived from other fields (the speculative numbers an algorithm defaults) are computed by
``EngineConfig.from_kwargs`` before the dataclass is built, and ``__post_init__`` only checks. Derive a
new config with ``EngineConfig.replace``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal

from plait import envs

ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch_native", "triton", "torch_flash")
# ``auto`` (and an unset --attention-backend): the measured-best (prefill, decode) pair per device.
# CPU: torch_native (triton there is the interpreter, for tests; torch_flash needs CUDA).
# CUDA: triton for both halves, since no pair with torch_flash is ahead end to end
# (docs/attention-backends.md): torch_flash's prefill kernel alone is faster, but its decode is not
# graph-safe.
AUTO_BACKENDS: dict[str, tuple[str, str]] = {"cuda": ("triton", "triton"), "cpu": ("torch_native", "torch_native")}
DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")
# EngineConfig.device: "auto" takes CUDA when torch sees a GPU, else the CPU. A GPU is chosen by
# base_gpu_id (and the rank), not by "cuda:N".
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "gguf", "dummy")
# --quantization: the weight formats plait runs (plait.layers.quantization). ``fp8`` quantizes a
# bf16/fp16 checkpoint at load and is implied by an FP8 checkpoint's quantization_config.
QUANTIZATIONS: tuple[str, ...] = ("fp8",)
# --kv-cache-dtype: ``auto`` stores K/V in the model dtype; ``fp8`` is vLLM's alias of ``fp8_e4m3``.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
SAMPLING_DEFAULTS: tuple[str, ...] = ("model", "openai")
# EngineConfig.warmup: "auto" on a GPU only (not on the CPU, not under the Triton interpreter).
WARMUP_MODES: tuple[str, ...] = ("auto", "on", "off")
# --moe-a2a-backend (SGLang's name): how expert parallelism moves tokens to their experts. "none":
# every rank sees every token (all-gather / replicated) and the partial sums are reduced;
# "all_to_all": each rank routes its own tokens and sends each (token, expert) pair to the rank holding
# the expert (plait.layers.moe.all_to_all). docs/moe.md says which layouts take which.
MOE_A2A_BACKENDS: tuple[str, ...] = ("none", "all_to_all")
# --schedule-policy (SGLang's names): the order admission takes waiting requests in
# (plait.scheduler.policy). "fcfs": arrival; "lpm": longest cached prefix first; "lof": longest
# output (max_new_tokens) first; "random".
SCHEDULE_POLICIES: tuple[str, ...] = ("fcfs", "lpm", "lof", "random")
# --grammar-backend (SGLang's): "xgrammar" compiles json_schema / regex / ebnf / structural_tag
# requests; "none" turns constrained decoding off (such requests are refused naming the field).
GRAMMAR_BACKENDS: tuple[str, ...] = ("xgrammar", "none")


def auto_backends(device_type: str) -> tuple[str, str]:
    """The ``auto`` (prefill, decode) pair for a device type ("cuda", "cpu", ...)."""
    return AUTO_BACKENDS.get(device_type, AUTO_BACKENDS["cpu"])


# Speculative decoding (SGLang's flag names). ``speculative_num_draft_tokens`` counts the tokens
# verified per request per step *including the root* (the last accepted token): steps=3, topk=1,
# draft tokens=4 is a chain of three guesses and a step gains at most four tokens.
SPECULATIVE_ALGORITHMS: tuple[str, ...] = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
SPECULATIVE_ATTENTION_MODES: tuple[str, ...] = ("prefill", "decode")
DEFAULT_SPECULATIVE_NUM_STEPS = 3
DEFAULT_SPECULATIVE_EAGLE_TOPK = 1
# The speculative numbers an algorithm fills in when they are unset.
SPECULATIVE_DERIVED_FIELDS: tuple[str, ...] = (
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _flag(name: str) -> str:
    """A field's command-line spelling: what the user changes."""
    return "--" + name.replace("_", "-")


def step_max_tokens(chunked_prefill_size: int, max_running_requests: int) -> int:
    """The most tokens one EXTEND or MIXED step carries under chunking: a chunk of prompt tokens and a
    decode row per running request."""
    return chunked_prefill_size + max_running_requests


def piecewise_graphs_fit(values: Mapping[str, Any]) -> bool:
    """Whether piecewise CUDA graphs run with the other options among ``values`` (every EngineConfig field
    by name): the combinations ``EngineConfig`` refuses with them (DP attention, two-batch overlap, the
    all-to-all expert dispatch, buckets above the largest step) are the ones it cannot serve."""
    chunk = values["chunked_prefill_size"]
    return (not values["enable_dp_attention"] and not values["enable_two_batch_overlap"]
            and values["moe_a2a_backend"] != "all_to_all"
            and (chunk == -1 or values["piecewise_cuda_graph_max_tokens"]
                 <= step_max_tokens(chunk, values["max_running_requests"])))


def resolve_speculative(values: Mapping[str, Any]) -> dict[str, int]:
    """Validate the speculative fields among ``values`` (every EngineConfig field by name) and return
    the three numbers of ``SPECULATIVE_DERIVED_FIELDS`` as the algorithm resolves them: the given
    value, or the algorithm's default for an unset one. Empty when speculation is off. Every error
    names the flag to change in its command-line spelling."""
    algo = values["speculative_algorithm"]
    mode = values["speculative_attention_mode"]
    _check(mode in SPECULATIVE_ATTENTION_MODES,
           f"{_flag('speculative_attention_mode')} must be one of {SPECULATIVE_ATTENTION_MODES}, got {mode!r}")
    if algo is None:
        for name in ("speculative_draft_model_path", *SPECULATIVE_DERIVED_FIELDS,
                     "speculative_draft_attention_backend"):
            _check(values[name] is None,
                   f"{_flag(name)} is set but speculative decoding is off: set {_flag('speculative_algorithm')} "
                   f"to one of {SPECULATIVE_ALGORITHMS} or drop {_flag(name)}")
        return {}
    _check(algo in SPECULATIVE_ALGORITHMS,
           f"{_flag('speculative_algorithm')} must be one of {SPECULATIVE_ALGORITHMS} (or unset), got {algo!r}")
    if algo == "NGRAM":
        _check(values["speculative_draft_model_path"] is None,
               f"{_flag('speculative_algorithm')} NGRAM uses no draft model: drop "
               f"{_flag('speculative_draft_model_path')} or pick STANDALONE")
    else:
        _check(bool(values["speculative_draft_model_path"]),
               f"{_flag('speculative_algorithm')} {algo} needs a draft model: set "
               f"{_flag('speculative_draft_model_path')} to a checkpoint directory")
    backend = values["speculative_draft_attention_backend"]
    _check(backend is None or backend in ATTENTION_BACKENDS,
           f"{_flag('speculative_draft_attention_backend')} must be one of {ATTENTION_BACKENDS} (or unset), "
           f"got {backend!r}")
    for name in ("speculative_num_steps", "speculative_eagle_topk"):
        value = values[name]
        _check(value is None or value >= 1, f"{_flag(name)} must be >= 1, got {value}")
    steps = values["speculative_num_steps"]
    steps = DEFAULT_SPECULATIVE_NUM_STEPS if steps is None else steps
    topk = values["speculative_eagle_topk"]
    topk = DEFAULT_SPECULATIVE_EAGLE_TOPK if topk is None else topk
    # The most nodes a tree of `steps` levels with `topk` new nodes per level can hold, plus the root
    # (SGLang's bound: each step keeps topk branches).
    most = 1 + steps * topk
    draft = values["speculative_num_draft_tokens"]
    draft = most if draft is None else draft
    _check(draft >= 2,
           f"{_flag('speculative_num_draft_tokens')} counts the root too, so it must be >= 2, got {draft}")
    _check(topk != 1 or draft == steps + 1,
           f"with {_flag('speculative_eagle_topk')} 1 (a chain) {_flag('speculative_num_draft_tokens')} must be "
           f"{_flag('speculative_num_steps')} + 1 = {steps + 1}, got {draft}: change one of them")
    _check(draft <= most,
           f"{_flag('speculative_num_draft_tokens')} {draft} exceeds what {steps} steps of topk {topk} can "
           f"propose ({most} with the root): lower it or raise {_flag('speculative_num_steps')} / "
           f"{_flag('speculative_eagle_topk')}")
    lo, hi = values["speculative_ngram_min_match_window_size"], values["speculative_ngram_max_match_window_size"]
    _check(1 <= lo <= hi,
           f"{_flag('speculative_ngram_min_match_window_size')} ({lo}) must be >= 1 and <= "
           f"{_flag('speculative_ngram_max_match_window_size')} ({hi})")
    capacity = values["speculative_ngram_capacity"]
    _check(capacity >= 1, f"{_flag('speculative_ngram_capacity')} must be >= 1, got {capacity}")
    return {"speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": draft}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. ``model`` is a Hugging Face checkpoint directory or a GGUF
    file (or a directory holding one: ``load_format`` ``auto`` reads it as ``gguf``)."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    # SGLang's --json-model-override-args: a JSON object of config.json fields to replace, e.g.
    # '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, ...}, "max_position_embeddings": 131072}'.
    json_model_override_args: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    # Attention: one base field plus optional per-phase overrides. Decision code reads
    # ``attention_backends()``, never ``attention_backend`` directly.
    attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    # Memory
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    max_running_requests: int = 256
    context_length: int | None = None
    disable_radix_cache: bool = False
    # Scheduling
    # Prefill tokens per step (decode tokens of running requests come on top); longer prompts are
    # split into chunks of at most this many tokens. -1 (SGLang's): no chunking, see prefill_token_budget.
    chunked_prefill_size: int = 8192
    # SGLang's --max-prefill-tokens: prefill tokens one step may carry over every admitted request
    # (the chunk size bounds it too). A prompt longer than it still runs, alone or in chunks.
    max_prefill_tokens: int | None = None
    schedule_policy: str = "fcfs"
    grammar_backend: str = "xgrammar"
    # SGLang's --skip-tokenizer-init: no tokenizer is loaded (the checkpoint may have none). Requests
    # are token ids and results token ids with empty text; what needs the tokenizer (text prompts, stop
    # strings, grammars, chat templates, token strings) is refused naming the field.
    skip_tokenizer_init: bool = False
    # SGLang's --allow-auto-truncate: a request over the context limit is cut to fit instead of refused
    # (plait.engine.frontend.Frontend.fit says how).
    allow_auto_truncate: bool = False
    schedule_conservativeness: float = 1.0
    # Streaming (SGLang's --stream-interval): a running request's progress is reported every this many
    # output tokens (its first token and its end at once); the tokens and text are the same, in fewer pieces.
    # None: adaptive (plait.engine.core.adaptive_stream_interval): every token while at most 64 requests
    # are live in the server's scheduler, then fewer updates per stream as more are, so the per-update
    # work of both processes stays bounded per step; a number fixes it.
    stream_interval: int | None = None
    # Parallelism. tp_size ranks, one process each (rank 0 is the engine's process).
    # dp_size alone: dp_size independent replicas (each tp_size ranks, its own KV cache and
    # scheduler) behind a shortest-queue balancer (plait.parallel.data_parallel). dp_size with
    # enable_dp_attention: each rank runs attention over its own requests (dp_size ==
    # tp_size). nnodes/node_rank/dist_init_addr: ranks spread over several machines (node 0 hosts
    # rank 0 and the store at dist_init_addr). dist_timeout: seconds a collective may wait before
    # a dead or hung rank ends the engine with an error.
    tp_size: int = 1
    # Expert parallelism (mixture-of-experts models): the tp_size ranks form ep_size groups, each
    # holding num_experts / ep_size whole experts sharded over its tp_size / ep_size ranks.
    ep_size: int = 1
    moe_a2a_backend: str = "none"
    dp_size: int = 1
    enable_dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 120.0
    # DP attention on CUDA: the MLP's rows move through symmetric memory (plait.distributed.copy_engine_rows:
    # copy engines in SUM_LEN rounds, Triton kernels in MAX_LEN ones) where the build supports it; set to
    # use NCCL for every round.
    disable_copy_engine_rows: bool = False
    # Tensor parallelism on CUDA: all-reduces up to 8 MB (decode steps) run as one Triton kernel over
    # symmetric memory (plait.distributed.p2p_all_reduce) where the build supports it; set to use NCCL's.
    disable_custom_all_reduce: bool = False
    # First GPU of this engine (SGLang's --base-gpu-id): rank r uses GPU base_gpu_id + r; data-parallel
    # replica i starts at base_gpu_id + i * tp_size.
    base_gpu_id: int = 0
    # Two-batch overlap (SGLang's --enable-two-batch-overlap): a batch whose halves both keep at
    # least tbo_min_split_tokens rows runs as two micro-batches, one's tensor-parallel sums (under
    # DP attention: its MLP's gather and reduce-scatter, the halves counted over every rank) in
    # flight while the other computes; only where there is communication to hide (tp_size > 1).
    # tbo_token_distribution_threshold: an extend batch whose best request boundary leaves a side
    # under this share of the tokens is cut inside a request instead (0 disables that cut).
    enable_two_batch_overlap: bool = False
    tbo_token_distribution_threshold: float = 0.48
    tbo_min_split_tokens: int = 190
    # GPU fast path; accepted on the CPU and ignored there.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # SGLang's --cuda-graph-bs: the batch sizes captured (ascending; the largest is the graph limit,
    # so it replaces cuda_graph_max_bs). Unset: 1, 2, 4, 8, then steps of 8 (graph_utils).
    cuda_graph_bs: tuple[int, ...] | None = None
    # SGLang's --disable-cuda-graph-padding: a batch between two captured sizes runs eagerly instead
    # of replaying the larger graph on padding rows.
    disable_cuda_graph_padding: bool = False
    # EXTEND and MIXED steps of at most piecewise_cuda_graph_max_tokens tokens as breakable graphs,
    # one per token bucket, cut at every attention call (plait.executor.piecewise_graph_runner).
    enable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int = 2048
    disable_overlap_schedule: bool = False
    # The bounded warm-up at start (plait.engine.warmup): one request of every launch-shape class, so
    # Triton's compiles happen before the first request. "auto": on a GPU only; "off": --skip-warmup.
    warmup: str = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # The server's scheduler process (SGLang's flags): a step running longer than watchdog_timeout
    # seconds ends the process, so the server fails instead of hanging (None: no watchdog); every
    # decode_log_interval steps it logs the running and queued requests, the KV use and the
    # generation throughput (0: never).
    watchdog_timeout: float | None = 300.0
    decode_log_interval: int = 40
    # Defaults of sampling parameters a request leaves unset (plait.engine.generation_config):
    # SGLang's sampling_defaults ("model": the checkpoint's generation_config.json, "openai": plait's
    # own) and vLLM's generation_config ("auto": the model directory, "vllm": none, or a directory).
    sampling_defaults: str = "model"
    generation_config: str = "auto"
    # vLLM's --override-generation-config: a JSON object of sampling defaults over the file's.
    override_generation_config: str | None = None
    # Speculative decoding (SGLang's flag names). ``from_kwargs`` fills the unset numbers of
    # SPECULATIVE_DERIVED_FIELDS with the algorithm's defaults (resolve_speculative, which also
    # validates every combination); a constructed config with an algorithm has all three set.
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_attention_mode: str = "prefill"
    speculative_draft_attention_backend: str | None = None
    speculative_ngram_min_match_window_size: int = 2
    speculative_ngram_max_match_window_size: int = 4
    speculative_ngram_capacity: int = 100_000

    def __post_init__(self) -> None:
        _check(bool(self.model), "model must be a checkpoint directory path, got an empty value")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.override_generation_config is None or _is_json_object(self.override_generation_config),
               f"override_generation_config must be a JSON object of sampling defaults, got "
               f"{self.override_generation_config!r}")
        _check(self.json_model_override_args is None or _is_json_object(self.json_model_override_args),
               f"json_model_override_args must be a JSON object of config.json fields, got "
               f"{self.json_model_override_args!r}")
        _check(self.device in DEVICES, f"device must be one of {DEVICES} (pick a GPU with base_gpu_id), got "
               f"{self.device!r}")
        _check(
            self.load_format in LOAD_FORMATS,
            f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}",
        )
        _check(self.quantization is None or self.quantization in QUANTIZATIONS,
               f"quantization must be one of {QUANTIZATIONS} (or unset for the checkpoint's own format), got "
               f"{self.quantization!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            value = getattr(self, name)
            _check(
                value is None or value in ATTENTION_BACKENDS,
                f"{name} must be one of {ATTENTION_BACKENDS} (or unset), got {value!r}",
            )
        _check(
            0.0 < self.mem_fraction_static < 1.0,
            f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}",
        )
        _check(
            self.max_total_tokens is None or self.max_total_tokens >= 16,
            f"max_total_tokens must be >= 16 (or unset to size from memory), got {self.max_total_tokens}",
        )
        _check(
            self.max_running_requests >= 1,
            f"max_running_requests must be >= 1, got {self.max_running_requests}",
        )
        _check(self.stream_interval is None or self.stream_interval >= 1,
               f"stream_interval must be >= 1 output token (or unset: adaptive), got {self.stream_interval}")
        _check(
            self.context_length is None or self.context_length >= 2,
            f"context_length must be >= 2 (or unset to use the model's), got {self.context_length}",
        )
        _check(
            self.chunked_prefill_size >= 1 or self.chunked_prefill_size == -1,
            f"chunked_prefill_size must be >= 1 token (or -1 to turn chunking off), got {self.chunked_prefill_size}",
        )
        _check(self.max_prefill_tokens is None or self.max_prefill_tokens >= 1,
               f"max_prefill_tokens must be >= 1 token (or unset: the chunk size alone), got {self.max_prefill_tokens}")
        _check(self.watchdog_timeout is None or self.watchdog_timeout > 0,
               f"watchdog_timeout must be > 0 seconds (or unset: no watchdog), got {self.watchdog_timeout}")
        _check(self.decode_log_interval >= 0,
               f"decode_log_interval must be >= 0 steps (0: never), got {self.decode_log_interval}")
        _check(not (self.skip_tokenizer_init and self.tokenizer),
               f"skip_tokenizer_init loads no tokenizer: leave tokenizer unset (got {self.tokenizer!r})")
        _check(self.grammar_backend in GRAMMAR_BACKENDS,
               f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}")
        _check(self.schedule_policy in SCHEDULE_POLICIES,
               f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.cuda_graph_bs is not None:
            sizes = tuple(self.cuda_graph_bs)
            _check(len(sizes) > 0 and all(isinstance(b, int) and b >= 1 for b in sizes)
                   and list(sizes) == sorted(set(sizes)),
                   f"cuda_graph_bs must be distinct batch sizes >= 1 in ascending order, got {list(sizes)}")
            _check(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs == sizes[-1],
                   f"cuda_graph_max_bs ({self.cuda_graph_max_bs}) and cuda_graph_bs (largest {sizes[-1]}) disagree: "
                   "give one of the two")
        _check(
            self.schedule_conservativeness > 0,
            f"schedule_conservativeness must be > 0, got {self.schedule_conservativeness}",
        )
        _check(
            self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
            f"cuda_graph_max_bs must be >= 1 (or unset for the default), got {self.cuda_graph_max_bs}",
        )
        _check(self.piecewise_cuda_graph_max_tokens >= 1,
               f"piecewise_cuda_graph_max_tokens must be >= 1 token, got {self.piecewise_cuda_graph_max_tokens}")
        step_max = step_max_tokens(self.chunked_prefill_size, self.max_running_requests)
        _check(not self.enable_piecewise_cuda_graph or self.chunked_prefill_size == -1
               or self.piecewise_cuda_graph_max_tokens <= step_max,
               f"piecewise_cuda_graph_max_tokens ({self.piecewise_cuda_graph_max_tokens}) must be <= "
               f"chunked_prefill_size + max_running_requests ({step_max}): an extend or mixed step carries at most "
               "that many tokens, so larger buckets are never replayed; lower --piecewise-cuda-graph-max-tokens")
        _check(not (self.enable_piecewise_cuda_graph and self.enable_dp_attention),
               "--enable-piecewise-cuda-graph does not run with --enable-dp-attention (the MLP of an extend step "
               "gathers every rank's tokens, a count the graphs cannot fix): drop one of the two")
        _check(not (self.enable_piecewise_cuda_graph and self.enable_two_batch_overlap),
               "--enable-piecewise-cuda-graph does not run with --enable-two-batch-overlap (the attention backend "
               "splits an extend batch into micro-batches while planning it, after the graph was chosen): drop one "
               "of the two")
        _check(not self.enable_piecewise_cuda_graph or self.moe_a2a_backend != "all_to_all",
               "--enable-piecewise-cuda-graph does not run with --moe-a2a-backend all_to_all (its prefill "
               "dispatch reads the per-rank row counts on the host, which a graph cannot): drop one of the two")
        _check(self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}")
        _check(self.ep_size >= 1 and self.tp_size % self.ep_size == 0,
               f"ep_size ({self.ep_size}) must be >= 1 and divide tp_size ({self.tp_size}): expert parallelism "
               "splits the tensor-parallel ranks into ep_size groups")
        _check(self.moe_a2a_backend in MOE_A2A_BACKENDS,
               f"moe_a2a_backend must be one of {MOE_A2A_BACKENDS}, got {self.moe_a2a_backend!r}")
        if self.moe_a2a_backend == "all_to_all":
            _check(self.ep_size > 1 and self.ep_size == self.tp_size,
                   f"--moe-a2a-backend all_to_all needs whole experts on every rank: --ep-size equal to --tp-size "
                   f"and > 1 (got ep_size {self.ep_size}, tp_size {self.tp_size})")
            _check(not self.enable_two_batch_overlap,
                   "--moe-a2a-backend all_to_all does not run under --enable-two-batch-overlap (its micro-batches "
                   "would take the gather path): drop one of the two")
        _check(self.nnodes >= 1 and self.tp_size % self.nnodes == 0,
               f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes}): each node runs "
               "tp_size / nnodes ranks")
        _check(0 <= self.node_rank < self.nnodes, f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        _check(self.nnodes == 1 or bool(self.dist_init_addr),
               "dist_init_addr (HOST:PORT of node 0) is required when nnodes > 1")
        _check(self.dist_timeout > 0, f"dist_timeout must be > 0 seconds, got {self.dist_timeout}")
        _check(self.dp_size >= 1, f"dp_size must be >= 1, got {self.dp_size}")
        _check(self.base_gpu_id >= 0, f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        _check(0.0 <= self.tbo_token_distribution_threshold <= 0.5,
               f"tbo_token_distribution_threshold must be in [0, 0.5], got {self.tbo_token_distribution_threshold}")
        _check(self.tbo_min_split_tokens >= 1,
               f"tbo_min_split_tokens must be >= 1, got {self.tbo_min_split_tokens}")
        _check(not self.enable_dp_attention or self.tp_size > 1,
               "enable_dp_attention needs several ranks (tp_size = dp_size >= 2)")
        _check(not self.enable_dp_attention or self.dp_size == self.tp_size,
               f"enable_dp_attention needs dp_size == tp_size (got dp_size {self.dp_size}, tp_size "
               f"{self.tp_size})")
        if self.dp_size > 1 and not self.enable_dp_attention:
            # Plain data parallelism: dp_size independent replicas of tp_size ranks, on this machine.
            _check(self.nnodes == 1 and not self.dist_init_addr,
                   f"dp_size {self.dp_size} without enable_dp_attention runs its replicas on one machine: "
                   "nnodes and dist_init_addr are not supported with it")
        _check(self.warmup in WARMUP_MODES, f"warmup must be one of {WARMUP_MODES}, got {self.warmup!r}")
        _check(self.sampling_defaults in SAMPLING_DEFAULTS,
               f"sampling_defaults must be one of {SAMPLING_DEFAULTS}, got {self.sampling_defaults!r}")
        _check(bool(self.generation_config),
               "generation_config must be 'auto', 'vllm' or a directory holding generation_config.json")
        _check(self.sampling_defaults == "model" or self.generation_config in ("auto", "vllm"),
               f"--generation-config {self.generation_config} reads sampling defaults from that directory but "
               "--sampling-defaults openai ignores them: drop one of the two")
        for name, value in resolve_speculative(vars(self)).items():
            given = getattr(self, name)
            _check(given == value,
                   f"{name} is unset with speculative_algorithm {self.speculative_algorithm}: set "
                   f"{_flag(name)} ({value} is the algorithm's default), or build the config with "
                   "EngineConfig.from_kwargs, which fills the defaults")

    def attention_backends(self) -> tuple[str, str]:
        """The (prefill, decode) backend pair: each the phase-specific flag or else the base field.

        ``auto`` or an unset base resolves per half from ``AUTO_BACKENDS`` for the device, so the
        pair always names concrete backends.
        """
        auto = auto_backends(self.resolved_device())
        base = self.attention_backend or "auto"
        prefill = self.prefill_attention_backend or base
        decode = self.decode_attention_backend or base
        return (auto[0] if prefill == "auto" else prefill, auto[1] if decode == "auto" else decode)

    def prefill_token_budget(self, max_context_len: int) -> int:
        """Prefill tokens one step may carry at most: ``chunked_prefill_size``, or with -1 (chunking
        off) the whole context, so that every prompt is prefilled in one step."""
        return max_context_len if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    @property
    def causal_chain_verify(self) -> bool:
        """Whether TARGET_VERIFY batches run without a tree mask: every draft is a chain (top-k 1), so
        node i attends causally (the prefix and nodes 0..i), which the attention kernels do without a
        mask. On one rank only: tensor-parallel and DP-attention ranks receive the mask with the batch."""
        return (self.speculative_algorithm is not None and self.speculative_eagle_topk == 1
                and self.tp_size == 1 and not self.enable_dp_attention)

    def prefill_room(self, max_context_len: int, taken: int) -> int:
        """Prefill tokens a step that carries ``taken`` already may add. A step's first prompt may
        fill the whole budget; with ``max_prefill_tokens`` the ones after it stop at that many tokens
        in all (SGLang's rule: one prompt longer than it still runs, alone)."""
        budget = self.prefill_token_budget(max_context_len)
        if taken == 0 or self.max_prefill_tokens is None:
            return budget - taken
        return min(budget, self.max_prefill_tokens) - taken

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown keys with the list of known ones, with the
        derived fields (the algorithm's speculative defaults) filled in before construction."""
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {unknown}; known options: {sorted(cls.field_names())}"
            )
        defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
        values = {**defaults, **kwargs}
        # resolve_speculative returns a given number as it is and a default for an unset one.
        derived: dict[str, Any] = dict(resolve_speculative(values))
        if values["cuda_graph_bs"] is not None:  # argparse and a JSON round trip give a list
            derived["cuda_graph_bs"] = tuple(values["cuda_graph_bs"])
        if "enable_piecewise_cuda_graph" not in kwargs and envs.PIECEWISE_CUDA_GRAPH.get():
            derived["enable_piecewise_cuda_graph"] = piecewise_graphs_fit(values)
        return cls(**{**kwargs, **derived})

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
