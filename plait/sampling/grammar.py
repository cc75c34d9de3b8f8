"""Constrained decoding on xgrammar: grammar validation, compilation, per-request matchers and the
token bitmask.

A request names at most one grammar through its ``SamplingParams`` (``json_schema``, ``regex``,
``ebnf`` or ``structural_tag``); ``grammar_spec`` turns that into a ``GrammarKey`` (kind, text).

- ``validate_grammar(key)`` parses the grammar without a tokenizer (cheap, cached) and raises
  ``ValueError`` naming the field and xgrammar's message; ``SamplingParams`` calls it at
  construction, so a bad grammar fails before anything is scheduled.
- ``GrammarBackend`` owns the tokenizer info (the model's padded vocabulary: token ids past the
  tokenizer's are never allowed) and a compiler; ``request(key)`` returns a future of the compiled
  grammar, compiled on a thread pool and cached by key, so the scheduler never waits for a compile.
- ``GrammarMatcherState`` is one request's matcher. Invariant: it has accepted exactly the
  request's output tokens the host knows (``num_accepted == len(req.output_ids)``), so a retracted
  request keeps its matcher as is and a rejected token is never half-applied.
- ``fill_vocab_mask`` writes a batch's bitmask (int32 ``[rows, ceil(V / 32)]``, bit set = allowed);
  ``apply_vocab_mask`` sets the disallowed logits to -inf in place on the logits' device (xgrammar's
  CUDA/Triton kernel on a GPU, its CPU kernel otherwise).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from plait.models.loader import ModelConfig

logger = logging.getLogger(__name__)

GrammarKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]
GRAMMAR_FIELDS: tuple[GrammarKind, ...] = ("json_schema", "regex", "ebnf", "structural_tag")
GrammarKey = tuple[GrammarKind, str]

# JSON nesting (objects and arrays) a json_schema document may have. xgrammar's conversion time grows
# steeply with depth (hundreds of levels take minutes), and no practical schema comes near this.
MAX_JSON_SCHEMA_DEPTH = 64
# Whitespace characters a JSON output may put between two tokens of its syntax: pretty-printing up
# to 7 levels of 2-space indentation fits, but a model cannot burn its tokens on whitespace loops
# (small models do).
JSON_MAX_WHITESPACE = 16
# Prefix of xgrammar's C++ log lines ("[20:31:21] /project/cpp/x.cc:94: "): not part of the message.
_XGR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A grammar that xgrammar rejects; the message names the request field."""


def _xgr_message(e: BaseException) -> str:
    text = str(e).strip()
    return _XGR_LOG_PREFIX.sub("", text.splitlines()[0] if text else type(e).__name__)


def _json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON document (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = list(node.values())
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((c, depth + 1) for c in children)
    return deepest


def normalize_json_schema(schema: Any) -> str:
    """The json_schema field as the string xgrammar reads: a dict (or bool) is serialised; a string
    must parse as JSON. Raises ``GrammarError`` for anything else, or past MAX_JSON_SCHEMA_DEPTH."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from e
        text = schema
    elif isinstance(schema, dict | bool):
        parsed = schema
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError, RecursionError) as e:
            raise GrammarError(f"json_schema is not serialisable as JSON: {e}") from e
    else:
        raise GrammarError(f"json_schema must be a JSON string or a dict, got {type(schema).__name__}")
    depth = _json_depth(parsed)
    if depth > MAX_JSON_SCHEMA_DEPTH:
        raise GrammarError(f"json_schema is too deep to compile: nesting depth {depth} exceeds the limit of "
                           f"{MAX_JSON_SCHEMA_DEPTH}")
    return text


def _structural_tag_grammar(text: str) -> xgr.Grammar:
    """SGLang's structural_tag: either xgrammar's own format (``{"type": "structural_tag", "format":
    ...}``) or the legacy ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``."""
    try:
        tag = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"structural_tag is not valid JSON: {e}") from e
    if isinstance(tag, dict) and "structures" in tag:
        try:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            triggers = list(tag["triggers"])
        except (KeyError, TypeError) as e:
            raise GrammarError(f"structural_tag: each of 'structures' needs 'begin', 'schema' and 'end', and "
                               f"'triggers' must be a list ({e!r})") from e
        return xgr.Grammar.from_structural_tag(items, triggers)
    return xgr.Grammar.from_structural_tag(text)


def _parse(key: GrammarKey) -> xgr.Grammar:
    kind, text = key
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    if kind == "structural_tag":
        return _structural_tag_grammar(text)
    raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_FIELDS)}")


@lru_cache(maxsize=1024)
def validate_grammar(key: GrammarKey) -> None:
    """Raise ``GrammarError`` (a ValueError) naming the field when xgrammar cannot parse the grammar.

    Tokenizer-independent (no compile), cached by key: a request repeating a schema pays nothing.
    """
    kind, _ = key
    try:
        _parse(key)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError, RecursionError) as e:
        raise GrammarError(f"{kind} is not a valid grammar: {_xgr_message(e)}") from e


def grammar_spec(json_schema: Any = None, regex: str | None = None, ebnf: str | None = None,
                 structural_tag: Any = None) -> GrammarKey | None:
    """The one grammar among the four fields (None when none is set); normalised, not validated.
    Raises ``GrammarError`` when more than one is set or a field has the wrong type."""
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf),
                               ("structural_tag", structural_tag)) if v is not None}
    if len(given) > 1:
        # The first field leads the message: the server names it as the request's faulty parameter.
        first, *rest = given
        raise GrammarError(f"{first} is set with {', '.join(rest)}: at most one of {', '.join(GRAMMAR_FIELDS)} may "
                           "be set")
    if not given:
        return None
    (kind, value), = given.items()
    if kind == "json_schema":
        return "json_schema", normalize_json_schema(value)
    if kind == "structural_tag" and isinstance(value, dict):
        return "structural_tag", json.dumps(value)
    if not isinstance(value, str):
        raise GrammarError(f"{kind} must be a str, got {type(value).__name__}")
    if not value:
        raise GrammarError(f"{kind} must not be empty")
    return kind, value  # type: ignore[return-value]


# --- compilation ----------------------------------------------------------------------------------
# Upper bounds (seconds) of the compile-time histogram buckets; the last bucket is +Inf.
COMPILE_TIME_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class GrammarStats:
    """Compiles and cache hits of one backend (plain numbers: they travel to the metrics endpoint)."""

    compiles: int = 0  # grammars compiled (each key at most once while cached)
    compile_failures: int = 0
    cache_hits: int = 0  # requests whose grammar was compiled, or being compiled, already
    compile_seconds_sum: float = 0.0
    # compile_seconds_buckets[i]: compiles that took <= COMPILE_TIME_BUCKETS[i] (non-cumulative);
    # the extra last entry counts the slower ones.
    compile_seconds_buckets: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_TIME_BUCKETS) + 1))

    @property
    def bucket_bounds(self) -> tuple[float, ...]:
        return COMPILE_TIME_BUCKETS

    def observe_compile(self, seconds: float) -> None:
        self.compiles += 1
        self.compile_seconds_sum += seconds
        i = next((i for i, b in enumerate(COMPILE_TIME_BUCKETS) if seconds <= b), len(COMPILE_TIME_BUCKETS))
        self.compile_seconds_buckets[i] += 1


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a Hugging Face tokenizer for a model whose logits have ``vocab_size``
    columns: ids the tokenizer does not have (lm_head padding) are never allowed by any mask."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_token_ids) or None)


class GrammarBackend:
    """Compiles grammars off the caller's thread and caches them by key.

    ``request(key)`` returns at once: a future that a worker thread resolves with the
    ``CompiledGrammar`` (or the ``GrammarError`` of a grammar that does not compile). The scheduler
    polls the future; nothing on its path blocks on a compile. A failed compile is cached too (the
    same bad grammar fails at once again) up to the cache's size.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = (),
                 max_workers: int = 4, cache_size: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_workers = max_workers
        self.stats = GrammarStats()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="plait-grammar")
        self._cache: dict[GrammarKey, Future[xgr.CompiledGrammar]] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the cache and the stats: compiles finish on worker threads
        # Built by the first compile, on a worker thread (reading a large vocabulary takes a while):
        # an engine that never sees a constrained request never pays for it.
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._batch_filler: xgr.BatchGrammarMatcher | None = None  # used on the scheduler's thread only

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                # xgrammar's own compile cache is off: ours, keyed by (kind, text), holds the futures.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_workers, cache_enabled=False)
            return self._compiler

    def request(self, key: GrammarKey) -> Future[xgr.CompiledGrammar]:
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self.stats.cache_hits += 1
                self._cache[key] = self._cache.pop(key)  # most recently used last
                return fut
            fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            return fut

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        """Blocking compile through the cache (benchmarks, tests)."""
        return self.request(key).result()

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, text = key
        compiler = self.compiler  # outside the timing: the first call builds the tokenizer info
        start = time.perf_counter()
        try:
            compiled = self._compile_uncached(compiler, key)
        except GrammarError:
            with self._lock:
                self.stats.compile_failures += 1
            raise
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:
            with self._lock:
                self.stats.compile_failures += 1
            raise GrammarError(f"{kind} failed to compile: {_xgr_message(e)}") from e
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats.observe_compile(seconds)
        logger.debug("compiled %s grammar (%d chars) in %.3f s", kind, len(text), seconds)
        return compiled

    @staticmethod
    def _compile_uncached(compiler: xgr.GrammarCompiler, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, text = key
        if kind == "json_schema":
            return compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        return compiler.compile_grammar(_parse(key))

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> GrammarMatcherState:
        return GrammarMatcherState(xgr.GrammarMatcher(compiled), self.vocab_size)

    def fill_vocab_mask(self, matchers: Sequence[GrammarMatcherState | None]) -> torch.Tensor:
        """A batch's host bitmask over this backend's vocabulary (``fill_vocab_mask``), rows filled
        by xgrammar's thread pool."""
        if self._batch_filler is None:
            self._batch_filler = xgr.BatchGrammarMatcher(max_threads=min(self.max_workers, os.cpu_count() or 1))
        return fill_vocab_mask(matchers, self.vocab_size, self._batch_filler)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# --- matching -------------------------------------------------------------------------------------
class GrammarMatcherState:
    """One request's position in its grammar (owned by the scheduler's Req).

    ``num_accepted`` counts the tokens accepted so far; the scheduler keeps it equal to the
    request's host-known output length.
    """

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0

    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the grammar does not allow it. Past
        the grammar's end (a stop token accepted, and the request goes on: ``ignore_eos``) every
        token is allowed, as the mask says (``fill``)."""
        if self.matcher.is_terminated():
            self.num_accepted += 1
            return True
        if not self.matcher.accept_token(token):
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may follow."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (host int32 tensor). A terminated
        matcher allows everything: its request has finished and its token is discarded."""
        if self.matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_draft_tree(self, first_child: torch.Tensor, next_sibling: torch.Tensor, tokens: torch.Tensor,
                        bitmask: torch.Tensor) -> None:
        """Fill one bitmask row per node of a draft tree (``bitmask``: host int32 [nodes, words]):
        node i's row allows what may follow the tokens on the path from the root to i (the root's
        token is the request's last accepted one). ``first_child`` / ``next_sibling``: int64 [nodes],
        -1 for none. Nodes under a draft token the grammar rejects get whatever xgrammar leaves there;
        acceptance never reaches them, since that token is masked at its parent."""
        if self.matcher.is_terminated():
            bitmask.fill_(-1)
            return
        self.matcher.traverse_draft_tree(first_child, next_sibling, tokens, bitmask)


def allocate_vocab_mask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host int32 bitmask [rows, ceil(vocab_size / 32)], every token allowed."""
    return xgr.allocate_token_bitmask(rows, vocab_size)


def fill_vocab_mask(matchers: Sequence[GrammarMatcherState | None], vocab_size: int,
                    batch: xgr.BatchGrammarMatcher | None = None) -> torch.Tensor:
    """The bitmask of one batch on the host: row i from ``matchers[i]``, all ones where None or
    terminated (that request has finished; its token is discarded). ``batch``: xgrammar's
    multi-threaded filler for the rows of several matchers at once."""
    bitmask = allocate_vocab_mask(len(matchers), vocab_size)
    live = [(i, m.matcher) for i, m in enumerate(matchers) if m is not None and not m.matcher.is_terminated()]
    if batch is not None and len(live) > 1:
        batch.batch_fill_next_token_bitmask([m for _, m in live], bitmask, [i for i, _ in live])
    else:
        for i, m in live:
            m.fill_next_token_bitmask(bitmask, i)
    return bitmask


def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """Set logits of disallowed tokens to -inf in place. ``logits``: float32 [rows, V];
    ``vocab_mask``: int32 [rows, ceil(V / 32)] on the logits' device."""
    xgr.apply_token_bitmask_inplace(logits, vocab_mask, vocab_size=logits.shape[1])


MatcherFactory = Callable[[xgr.CompiledGrammar], GrammarMatcherState]


def grammar_backend_for(tokenizer: Any, model_config: ModelConfig) -> GrammarBackend | None:
    """The grammar compiler of one scheduler: the tokenizer over the model's (padded) vocabulary, the
    model's EOS ids as the grammars' stop tokens. Cheap until the first constrained request. None
    without a tokenizer (EngineConfig.skip_tokenizer_init): the front end refuses grammars then."""
    if tokenizer is None:
        return None
    return GrammarBackend(tokenizer, model_config.vocab_size, model_config.eos_token_ids)
