"""Wire messages between the HTTP process and the scheduler process (pickled over ZMQ).

HTTP process -> scheduler process: ``GenerateRequest``, ``AbortRequest``, ``FlushCacheRequest``,
``ShutdownRequest``. Scheduler process -> HTTP process: ``Ready`` once the model is loaded, then
``UpdateBatch`` per step with finished or progressed requests, ``FlushCacheReply`` for each flush,
or ``Fatal`` when the loop dies.
"""

from __future__ import annotations

import json
import operator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from plait.config import EngineConfig
from plait.sampling.params import SamplingParams
from plait.scheduler.stats import SchedulerStats


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    # A client that reads text only at the end: detokenize once, when the request finishes (stop
    # strings still decode as they need to), instead of every step.
    stream: bool = True
    # False: the HTTP process makes the text from the updates' token ids (``front_end_detokenizes``),
    # and the updates carry none.
    detokenize: bool = True
    # The HTTP process that sent it (``--tokenizer-worker-num``): its updates go back to that one.
    worker: int = 0
    # The client's request id it belongs to (SGLang's ``rid``; several samples share one), so that any
    # HTTP process can abort it (``AbortRequest.groups``).
    group: str = ""


def front_end_detokenizes(sampling_params: SamplingParams) -> bool:
    """Whether the HTTP process, not the scheduler, turns a request's tokens into text: when no stop
    string has to be matched, which only the scheduler can do as the tokens arrive (it ends the request).
    Detokenizing is then off the scheduler loop, whose time per step sets the server's token rate, and
    on the HTTP process, which has a core of its own (vLLM's split between engine core and front end)."""
    return not sampling_params.stop


@dataclass
class AbortRequest:
    rids: list[str]
    # Also every request of these client ids (``GenerateRequest.group``), whichever HTTP process sent
    # them, and with ``everything`` every request: SGLang's /abort_request under several HTTP processes.
    groups: list[str] = field(default_factory=list)
    everything: bool = False


@dataclass
class ShutdownRequest:
    pass


@dataclass
class FlushCacheRequest:
    """Empty the prefix cache (SGLang's /flush_cache): only while no request runs or waits."""

    worker: int = 0  # the HTTP process the reply goes to


@dataclass
class FlushCacheReply:
    success: bool
    message: str


@dataclass
class Ready:
    pid: int
    vocab_size: int
    max_context_len: int
    max_total_tokens: int
    max_running_requests: int
    eos_token_ids: tuple[int, ...]
    runner_info: dict[str, Any]  # device, dtype, attention backend, ...
    device_name: str  # as torch names it: "cpu", "NVIDIA H200", ...


@dataclass
class RequestUpdate:
    """What one request produced since its previous update."""

    rid: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    finish_message: str | None = None
    # finish_reason "stop": the stop token id or stop string that ended the request (SGLang's "matched").
    matched_stop: int | str | None = None
    # Prompt-token logprobs produced since the previous update (logprob_start_len >= 0): None for the
    # first prompt token, and the top ones per token (None there too).
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Set when the request failed instead of finishing: HTTP status (503 queue full, 500 internal).
    error: str | None = None
    error_status: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def _joined(parts: list[list[Any] | None]) -> list[Any] | None:
    return None if all(p is None for p in parts) else [x for p in parts for x in (p or ())]


def _merged(run: list[RequestUpdate]) -> RequestUpdate:
    """One update for consecutive ones of a request (none an error, none but the last finished):
    outputs concatenated, the counts and the finish from the last. Linear in the run's outputs."""
    if len(run) == 1:
        return run[0]
    later = run[-1]
    assert run[0].rid == later.rid and run[0].error is None and not run[-2].finished
    return RequestUpdate(
        rid=later.rid, token_ids=[t for u in run for t in u.token_ids], text="".join(u.text for u in run),
        logprobs=_joined([u.logprobs for u in run]), top_logprobs=_joined([u.top_logprobs for u in run]),
        finish_reason=later.finish_reason, finish_message=later.finish_message, matched_stop=later.matched_stop,
        input_logprobs=_joined([u.input_logprobs for u in run]),
        input_top_logprobs=_joined([u.input_top_logprobs for u in run]),
        prompt_tokens=max(u.prompt_tokens for u in run),
        completion_tokens=max(u.completion_tokens for u in run), cached_tokens=later.cached_tokens)


def merge_updates(first: RequestUpdate, later: RequestUpdate) -> RequestUpdate:
    """One update for two consecutive ones of a request, as if the scheduler had reported both at
    once: outputs concatenated, the counts and the finish from ``later``. Neither may be an error."""
    return _merged([first, later])


def coalesce_updates(updates: list[RequestUpdate]) -> list[RequestUpdate]:
    """Updates in arrival order with each request's consecutive ones merged (``merge_updates``, in
    one pass however many queued up); an error update and anything after a finished one stay as
    they are."""
    runs: list[list[RequestUpdate]] = []
    last: dict[str, int] = {}  # rid -> index in runs of its open (mergeable) run
    for upd in updates:
        j = last.get(upd.rid)
        if j is not None and upd.error is None:
            runs[j].append(upd)
        else:
            runs.append([upd])
            j = len(runs) - 1
        if upd.finished:
            last.pop(upd.rid, None)
        else:
            last[upd.rid] = j
    return [_merged(run) for run in runs]


@dataclass(frozen=True)
class LoopSeconds:
    """Where the scheduler process's loop spent its time while it had work, cumulative since start (idle
    waits for requests excluded): ``recv_s`` taking and handling requests, ``step_s`` the scheduler's
    steps (on a GPU with overlap scheduling this includes waiting for the forward in flight),
    ``collect_s`` building the updates (detokenization), ``send_s`` sending them (pickling, ZMQ).
    ``iterations``: loop iterations that stepped the scheduler; ``prefill_iterations`` and
    ``prefill_step_s``: those of them, and their step time, that began with requests waiting or in
    prefill (a step that prefills, alone or beside decode rows), so decode-only steps are the rest."""

    iterations: int = 0
    recv_s: float = 0.0
    step_s: float = 0.0
    collect_s: float = 0.0
    send_s: float = 0.0
    prefill_iterations: int = 0
    prefill_step_s: float = 0.0


@dataclass(frozen=True)
class SchedulerSnapshot:
    """Gauges of the moment plus a copy of the scheduler's cumulative counters and of the scheduler
    process's loop times (``LoopSeconds``)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_slots_in_use: int = 0
    max_total_tokens: int = 0
    evictable_tokens: int = 0
    counters: SchedulerStats = field(default_factory=SchedulerStats)
    loop: LoopSeconds = field(default_factory=LoopSeconds)


# The fields a "plain" update may set (a running request's tokens and text): every other field at its
# default. One per request per step at full batch, so these go on the wire as columns.
_PLAIN_FIELDS = ("rid", "token_ids", "text", "prompt_tokens", "completion_tokens", "cached_tokens")
_OTHER_FIELDS = tuple(f.name for f in fields(RequestUpdate) if f.name not in _PLAIN_FIELDS)
_other_values = operator.attrgetter(*_OTHER_FIELDS)
_OTHER_DEFAULTS = tuple(f.default for f in fields(RequestUpdate) if f.name not in _PLAIN_FIELDS)


# A plain update as the scheduler appends it without building the object (``UpdateBatch.rows``):
# rid, token_ids, text, prompt_tokens, completion_tokens, cached_tokens (``_PLAIN_FIELDS``' order).
PlainRow = tuple[str, list[int], str, int, int, int]


@dataclass
class UpdateBatch:
    """What changed in one scheduler loop iteration: per-request updates in order (one request may
    have several, its acknowledgement then its first tokens) plus the scheduler's snapshot.

    ``rows``: plain updates the sender appended as ``PlainRow`` tuples rather than objects (one per
    running request per step: the scheduler's hot path); they follow ``updates`` (so no row may
    precede an update of its request there). A received batch has every update in ``updates``, in
    that order, and no rows.

    Pickled compactly (``__reduce__``): the plain updates as rows, the others (logprobs, a finish, an
    error) as objects with their positions; unpickling rebuilds the same list. Several times cheaper
    than pickling every update as an object, on both sides of the hop."""

    updates: list[RequestUpdate]
    stats: SchedulerSnapshot
    rows: list[PlainRow] = field(default_factory=list)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        rows: list[PlainRow] = []
        rich: list[tuple[int, RequestUpdate]] = []
        for i, u in enumerate(self.updates):
            if _other_values(u) != _OTHER_DEFAULTS:
                rich.append((i, u))
                continue
            rows.append((u.rid, u.token_ids, u.text, u.prompt_tokens, u.completion_tokens, u.cached_tokens))
        return _unpack_update_batch, (rows + self.rows if rows else self.rows, rich, self.stats)


def _unpack_update_batch(rows: list[PlainRow], rich: list[tuple[int, RequestUpdate]],
                         stats: SchedulerSnapshot) -> UpdateBatch:
    updates = [RequestUpdate(rid, token_ids, text, prompt_tokens=prompt, completion_tokens=completion,
                             cached_tokens=cached)
               for rid, token_ids, text, prompt, completion, cached in rows]
    for i, u in rich:  # ascending positions, all within the objects that preceded the rows
        updates.insert(i, u)
    return UpdateBatch(updates, stats)


@dataclass
class Fatal:
    message: str


def config_to_json(config: EngineConfig) -> str:
    """The scheduler process's ``--config-json`` argument: every EngineConfig field."""
    return json.dumps(asdict(config))
