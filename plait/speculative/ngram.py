"""NGRAM drafter: prompt lookup in the request's own tokens, then a bounded global n-gram cache.

No draft model: at each tree node the drafter looks for earlier occurrences of the last n tokens
(n from ``max_window`` down to ``min_window``) of the request's context extended by the path to that
node, and proposes what followed them; when the request's own tokens have no match it asks the
global cache, built from the prompts and outputs of finished requests. The cache holds at most
``capacity`` n-gram keys and forgets the oldest first. It may propose nothing; the request
then decodes normally. ``NgramWorker`` is the speculative worker that drafts with it.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from plait.config import EngineConfig
from plait.scheduler.interface import SchedulerAPI
from plait.scheduler.req import Req
from plait.speculative.tree import DraftTree
from plait.speculative.worker import BaseSpecWorker

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner

# Per-request cooling: a request whose acceptance average falls below COLD_ACCEPT drafts nothing
# for COLD_STEPS drafting opportunities, then probes again (depth 1, from the average).
COLD_ACCEPT = 0.3
COLD_STEPS = 8


class RequestIndex:
    """n-gram -> end positions (exclusive) of its occurrences in one request's tokens, for n in
    [min_window, max_window] (the only lengths looked up); grows as the request does (tokens are only
    ever appended)."""

    def __init__(self, max_window: int, min_window: int = 1) -> None:
        self.min_window, self.max_window = min_window, max_window
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        if len(tokens) < len(self.tokens):
            raise ValueError("a request's tokens only grow")
        for end in range(len(self.tokens) + 1, len(tokens) + 1):
            for n in range(self.min_window, min(self.max_window, end) + 1):
                self.ends.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self.tokens.extend(tokens[len(self.tokens) :])  # only the new tail: O(new tokens) per step

    def followers(self, key: tuple[int, ...], limit: int) -> list[int]:
        """Distinct tokens that followed ``key``, most recent occurrence first."""
        out: list[int] = []
        for end in reversed(self.ends.get(key, ())):
            if end < len(self.tokens):
                tok = self.tokens[end]
                if tok not in out:
                    out.append(tok)
                    if len(out) == limit:
                        break
        return out


class NgramCache:
    """Global n-gram -> {next token: count}, bounded to ``capacity`` keys. Eviction is oldest first
    by when a key was first inserted (a dict keeps insertion order): refreshing a key's age on every
    hit cost a reorder per n-gram of every finished request, the largest host cost of a step that
    retires requests."""

    def __init__(self, min_window: int, max_window: int, capacity: int) -> None:
        self.min_window, self.max_window, self.capacity = min_window, max_window, capacity
        self.table: dict[tuple[int, ...], dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.table)

    def insert(self, tokens: list[int]) -> None:
        table = self.table
        for n in range(self.min_window, self.max_window + 1):
            for end in range(n, len(tokens)):
                counts = table.setdefault(tuple(tokens[end - n : end]), {})
                nxt = tokens[end]
                counts[nxt] = counts.get(nxt, 0) + 1
        excess = len(table) - self.capacity
        if excess > 0:
            for key in list(itertools.islice(table, excess)):
                del table[key]

    def followers(self, key: tuple[int, ...], limit: int) -> list[int]:
        counts = self.table.get(key)
        if not counts:
            return []
        if limit == 1:  # chains: the most frequent follower (the first seen among equals, as sorted gives)
            return [max(counts, key=counts.__getitem__)]
        return [t for t, _ in sorted(counts.items(), key=lambda kv: -kv[1])[:limit]]


class NgramDrafter:
    def __init__(self, min_window: int, max_window: int, capacity: int) -> None:
        self.min_window, self.max_window = min_window, max_window
        self.cache = NgramCache(min_window, max_window, capacity)
        self.indices: dict[str, RequestIndex] = {}

    def forget(self, rid: str) -> None:
        """A request finished: drop its index (its tokens reach the global cache through
        ``cache.insert``, which the worker runs as deferred work)."""
        self.indices.pop(rid, None)

    def _candidates(self, index: RequestIndex, seq: list[int], limit: int) -> list[int]:
        for n in range(min(self.max_window, len(seq)), self.min_window - 1, -1):
            key = tuple(seq[-n:])
            found = index.followers(key, limit) or self.cache.followers(key, limit)
            if found:
                return found
        return []

    def index(self, rid: str, context: list[int]) -> RequestIndex:
        """The request's index, brought up to ``context`` (its tokens so far)."""
        index = self.indices.get(rid)
        if index is None:
            index = self.indices[rid] = RequestIndex(self.max_window, self.min_window)
        index.extend(context)
        return index

    def propose(self, rid: str, context: list[int], max_depth: int, max_nodes: int, topk: int) -> DraftTree | None:
        """A tree of at most ``max_nodes`` nodes (root included) and ``max_depth`` levels below the
        root, at most ``topk`` children per node, grown breadth first; None when nothing matches."""
        index = self.index(rid, context)
        # Lookups read at most max_window trailing tokens: grow paths on that tail, not the context.
        tail = context[-self.max_window :]
        tree_tokens, parents, paths = [context[-1]], [-1], [[]]
        frontier = [0]
        depth = 0
        while frontier and depth < max_depth and len(tree_tokens) < max_nodes:
            nxt = []
            for node in frontier:
                for tok in self._candidates(index, tail + paths[node], topk):
                    if len(tree_tokens) == max_nodes:
                        break
                    tree_tokens.append(tok)
                    parents.append(node)
                    paths.append(paths[node] + [tok])
                    nxt.append(len(tree_tokens) - 1)
            frontier, depth = nxt, depth + 1
        if len(tree_tokens) == 1:
            return None
        return DraftTree(tree_tokens, parents)


class NgramWorker(BaseSpecWorker):
    joins_admissions = True

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        super().__init__(config, runner)
        self.drafter = NgramDrafter(config.speculative_ngram_min_match_window_size,
                                    config.speculative_ngram_max_match_window_size,
                                    config.speculative_ngram_capacity)
        self._cold_waits: dict[str, int] = {}  # rid -> drafting opportunities skipped while cold
        # Finished requests' tokens, fed to the global cache as deferred work (an insert walks every
        # n-gram of the request: on a step's critical path it delays the next verify launch).
        self._finished: list[list[int]] = []

    def propose(self, sched: SchedulerAPI, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        return [None if self._cooling(r) else self.drafter.propose(r.rid, r.fill_ids, d, self.num_draft_tokens,
                                                                   self.topk)
                for r, d in zip(reqs, max_depths, strict=True)]

    def _cooling(self, req: Req) -> bool:
        """Whether ``req`` skips drafting now: its guesses keep failing (acceptance average below
        COLD_ACCEPT), so a verify row would cost more than the plain decode it replaces. Every
        COLD_STEPS-th opportunity it probes again."""
        if self.accept_ema.get(req.rid, float(self.num_steps)) >= COLD_ACCEPT:
            return False
        waited = self._cold_waits.get(req.rid, 0) + 1
        if waited >= COLD_STEPS:
            self._cold_waits.pop(req.rid, None)
            return False
        self._cold_waits[req.rid] = waited
        return True

    def reset(self) -> None:
        super().reset()
        self.drafter = NgramDrafter(self.config.speculative_ngram_min_match_window_size,
                                    self.config.speculative_ngram_max_match_window_size,
                                    self.config.speculative_ngram_capacity)
        self._cold_waits.clear()
        self._finished.clear()

    def on_finish(self, req: Req) -> None:
        super().on_finish(req)
        self._cold_waits.pop(req.rid, None)
        self.drafter.forget(req.rid)
        self._finished.append(req.fill_ids)

    def deferred_work(self, sched: SchedulerAPI) -> None:
        """Feed finished requests to the global cache, and index the prompts of the requests the
        scheduler admits next (their first proposal then only indexes what they generated)."""
        finished, self._finished = self._finished, []
        for tokens in finished:
            self.drafter.cache.insert(tokens)
        # The scheduler admits waiting requests as running ones finish, often right after this
        # verify: index at least one (beyond the free places) so its first proposal finds it ready.
        budget = max(1, self.config.max_running_requests - sched.num_running())
        for req in sched.waiting:
            if budget == 0:
                break
            if req.rid not in self.drafter.indices:
                self.drafter.index(req.rid, req.fill_ids)
                budget -= 1
