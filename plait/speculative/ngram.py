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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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

    def followers(self, key: tuple[int, ...], limit: int, pending: Sequence[int] = ()) -> list[int]:
        """Distinct tokens that followed ``key``, most recent occurrence first, in the indexed tokens
        followed by ``pending`` (tokens not indexed: a hypothesised continuation). The answer is the
        one ``extend(tokens + pending)`` then ``followers(key, limit)`` gives, without the extend."""
        out: list[int] = []
        m = len(self.tokens)
        if pending:
            # Occurrences ending inside the pending tokens (end in (m, m + len(pending)), newest
            # first): scanned, since the index holds ends up to m only.
            n = len(key)
            off = max(0, m - n)
            seq = self.tokens[off:] + list(pending)  # seq[j] is token off + j of the whole sequence
            want = list(key)
            for end in range(m + len(pending) - 1, max(m, n - 1), -1):
                if seq[end - n - off : end - off] == want:
                    tok = seq[end - off]
                    if tok not in out:
                        out.append(tok)
                        if len(out) == limit:
                            return out
        total = m + len(pending)
        for end in reversed(self.ends.get(key, ())):
            if end < total:
                tok = self.tokens[end] if end < m else pending[end - m]
                if tok not in out:
                    out.append(tok)
                    if len(out) == limit:
                        break
        return out


class NgramCache:
    """Global n-gram -> {next token: count}, bounded to ``capacity`` keys. Eviction is oldest first
    by when a key was first inserted (a dict keeps insertion order): refreshing a key's age on every
    hit cost a reorder per n-gram of every finished request, the largest host cost of a step that
    retires requests. A key's followers are ordered by when each was last seen (its count dict is
    reordered, a few entries at most), so that among equally frequent followers the latest text
    wins: a repeated request continues as its latest run did, not its first."""

    def __init__(self, min_window: int, max_window: int, capacity: int) -> None:
        self.min_window, self.max_window, self.capacity = min_window, max_window, capacity
        self.table: dict[tuple[int, ...], dict[int, int]] = {}
        self.version = 0  # bumped by every insert: proposals prepared before one are stale after it

    def __len__(self) -> int:
        return len(self.table)

    def insert(self, tokens: list[int]) -> None:
        self.version += 1
        table = self.table
        for n in range(self.min_window, self.max_window + 1):
            for end in range(n, len(tokens)):
                counts = table.setdefault(tuple(tokens[end - n : end]), {})
                nxt = tokens[end]
                counts[nxt] = counts.pop(nxt, 0) + 1  # re-inserted: the last seen is last
        excess = len(table) - self.capacity
        if excess > 0:
            for key in list(itertools.islice(table, excess)):
                del table[key]

    def followers(self, key: tuple[int, ...], limit: int) -> list[int]:
        counts = self.table.get(key)
        if not counts:
            return []
        # Newest first, then by count: sorted and max keep the first of equals, so the latest seen.
        if limit == 1:  # chains: the most frequent follower, without a sort
            return [max(reversed(counts), key=counts.__getitem__)]
        return [t for t, _ in sorted(reversed(counts.items()), key=lambda kv: -kv[1])[:limit]]


class NgramDrafter:
    def __init__(self, min_window: int, max_window: int, capacity: int) -> None:
        self.min_window, self.max_window = min_window, max_window
        self.cache = NgramCache(min_window, max_window, capacity)
        self.indices: dict[str, RequestIndex] = {}

    def forget(self, rid: str) -> None:
        """A request finished: drop its index (its tokens reach the global cache through
        ``cache.insert``, which the worker runs as deferred work)."""
        self.indices.pop(rid, None)

    def _candidates(self, index: RequestIndex, seq: list[int], limit: int, pending: Sequence[int] = ()
                    ) -> list[int]:
        for n in range(min(self.max_window, len(seq)), self.min_window - 1, -1):
            key = tuple(seq[-n:])
            found = index.followers(key, limit, pending) or self.cache.followers(key, limit)
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

    def propose(self, rid: str, context: list[int], max_depth: int, max_nodes: int, topk: int,
                pending: Sequence[int] = ()) -> DraftTree | None:
        """A tree of at most ``max_nodes`` nodes (root included) and ``max_depth`` levels below the
        root, at most ``topk`` children per node, grown breadth first; None when nothing matches.

        ``pending``: tokens that follow ``context`` but are not the request's yet (a hypothesised
        outcome of the verify in flight): the tree is the one proposed once the request's tokens are
        ``context + pending``, while the request's index is brought up to ``context`` only."""
        index = self.index(rid, context)
        return self._grow(index, (context[-self.max_window :] + list(pending))[-self.max_window :], pending,
                          max_depth, max_nodes, topk)

    def _grow(self, index: RequestIndex, tail: list[int], pending: Sequence[int], max_depth: int,
              max_nodes: int, topk: int) -> DraftTree | None:
        # Lookups read at most max_window trailing tokens: paths grow on that tail, not the context.
        tree_tokens, parents, paths = [tail[-1]], [-1], [[]]
        frontier = [0]
        depth = 0
        while frontier and depth < max_depth and len(tree_tokens) < max_nodes:
            nxt = []
            for node in frontier:
                for tok in self._candidates(index, tail + paths[node], topk, pending):
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

    def predraft(self, rid: str, context: list[int], tree: DraftTree, max_depth: int, max_nodes: int,
                 topk: int) -> dict[tuple[int, ...], DraftTree | None]:
        """The next proposals for every way the verify of ``tree`` (rooted at ``context[-1]``) can
        end, keyed by the tokens the request then gains. Ending at node n accepts the path to n and
        adds a bonus token, which is not one of n's children's tokens (those were rejected): its
        guess is the drafter's best other follower of the path (no guess, no entry). Every proposal
        is what ``propose`` gives once the request's tokens are ``context`` plus the key, as long as
        the global cache takes no insert meanwhile."""
        index = self.index(rid, context)
        tail = context[-self.max_window :]
        out: dict[tuple[int, ...], DraftTree | None] = {}
        paths: list[list[int]] = [[]]
        for node in range(1, tree.width):
            paths.append(paths[tree.parents[node]] + [tree.tokens[node]])
        for node, path in enumerate(paths):
            rejected = [tree.tokens[c] for c in tree.children(node)]
            seq = (tail + path)[-self.max_window :]
            bonus = next((t for t in self._candidates(index, seq, len(rejected) + 1, path) if t not in rejected), None)
            if bonus is None:
                continue
            gained = path + [bonus]
            out[tuple(gained)] = self._grow(index, (seq + [bonus])[-self.max_window :], gained, max_depth,
                                            max_nodes, topk)
        return out


@dataclass
class PreparedDrafts:
    """Proposals drafted while a verify ran (``NgramDrafter.predraft``): valid while the request has
    ``base_len`` tokens plus one of the keys and the global cache is at ``cache_version``."""

    base_len: int
    cache_version: int
    proposals: dict[tuple[int, ...], DraftTree | None]


class NgramWorker(BaseSpecWorker):
    joins_admissions = True
    chains_verify = True

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        super().__init__(config, runner)
        self.drafter = self._new_drafter()
        self._cold_waits: dict[str, int] = {}  # rid -> drafting opportunities skipped while cold
        # Finished requests' tokens, fed to the global cache as deferred work (an insert walks every
        # n-gram of the request: on a step's critical path it delays the next verify launch).
        self._finished: list[list[int]] = []
        # rid -> the next proposals drafted while its last verify ran (see predraft), and how the
        # proposals asked for since were served: "hit" (prepared), "miss" (prepared for other
        # outcomes, drafted anew), "unprepared" (drafted anew).
        self.prepared: dict[str, PreparedDrafts] = {}
        self.predraft_stats: Counter[str] = Counter()

    def _new_drafter(self) -> NgramDrafter:
        return NgramDrafter(self.config.speculative_ngram_min_match_window_size,
                            self.config.speculative_ngram_max_match_window_size,
                            self.config.speculative_ngram_capacity)

    def propose(self, sched: SchedulerAPI, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        return [self._proposal(req, depth, ()) for req, depth in zip(reqs, max_depths, strict=True)]

    def propose_after(self, sched: SchedulerAPI, reqs: list[Req], max_depths: list[int],
                      gained: list[list[int]]) -> list[DraftTree | None]:
        """The proposals once each request has gained ``gained`` (a verify's outcome, not committed):
        the prepared ones keyed by the outcome, else drafted over the gained tokens as pending."""
        return [self._proposal(req, depth, g) for req, depth, g in zip(reqs, max_depths, gained, strict=True)]

    def _proposal(self, req: Req, depth: int, gained: Sequence[int]) -> DraftTree | None:
        """``req``'s proposal once its tokens are ``fill_ids + gained``, at most ``depth`` deep. A
        prepared entry stays until the next pre-draft replaces it: it is valid for as long as its
        base and key describe the request's tokens (they only grow) and the cache is unchanged."""
        if self._cooling(req):
            return None
        prepared = self.prepared.get(req.rid)
        if prepared is not None and prepared.cache_version == self.drafter.cache.version:
            n = req.fill_len + len(gained) - prepared.base_len  # tokens gained since the pre-draft
            if 0 < n <= len(gained):
                key = tuple(gained[len(gained) - n:])
            elif n > len(gained):
                key = tuple(req.output_ids[len(gained) - n:]) + tuple(gained)
            else:
                key = ()
            if key in prepared.proposals:
                self.predraft_stats["hit"] += 1
                tree = prepared.proposals[key]
                return tree if tree is None else tree.truncated(depth)
        self.predraft_stats["miss" if prepared is not None else "unprepared"] += 1
        return self.drafter.propose(req.rid, req.fill_ids, depth, self.num_draft_tokens, self.topk, pending=gained)

    def predraft(self, reqs: Sequence[Req], trees: list[DraftTree]) -> None:
        """Draft every request's next proposal for each way its verify can end, while the verify
        forward is queued: the next step's ``propose`` then only checks which outcome arrived. Drafted
        at full depth; ``propose`` truncates to the depth the request is allowed then (a tree grows
        breadth first, so the shallower tree is a prefix of the deeper one)."""
        version = self.drafter.cache.version
        for req, tree in zip(reqs, trees, strict=True):
            if tree.width == 1 and self.accept_ema.get(req.rid, float(self.num_steps)) < COLD_ACCEPT:
                continue  # cooling, and a root-only row leaves its average as it is: no draft next step
            proposals = self.drafter.predraft(req.rid, req.fill_ids, tree, self.num_steps, self.num_draft_tokens,
                                              self.topk)
            self.prepared[req.rid] = PreparedDrafts(req.fill_len, version, proposals)

    def undo_point(self) -> Callable[[], None]:
        cold, stats = dict(self._cold_waits), Counter(self.predraft_stats)

        def undo() -> None:  # in place: callers may hold the tables
            self._cold_waits.clear()
            self._cold_waits.update(cold)
            self.predraft_stats.clear()
            self.predraft_stats.update(stats)
        return undo

    def _prepared_now(self, req: Req) -> PreparedDrafts | None:
        """``req``'s proposals pre-drafted for its current tokens and cache, or None."""
        prepared = self.prepared.get(req.rid)
        current = (req.fill_len, self.drafter.cache.version)
        return prepared if prepared is not None and (prepared.base_len, prepared.cache_version) == current else None

    def guessed_bonus(self, req: Req, tree: DraftTree) -> int | None:
        """The bonus pre-drafted for ``req`` accepting every node of ``tree`` (the key of that outcome is
        its drafts then the guessed bonus), or None."""
        prepared = self._prepared_now(req)
        if prepared is None:
            return None
        drafts = tuple(tree.tokens[1:])
        for key in prepared.proposals:
            if len(key) == tree.width and key[:-1] == drafts:
                return key[-1]
        return None

    def ahead_drafts(self, reqs: list[Req], trees: list[DraftTree], width: int) -> list[list[list[int]]] | None:
        """Per request, the pre-drafted proposal of each outcome of the verify of ``trees`` (chains at
        most ``width`` wide, just pre-drafted, at full depth), cut to ``width - 1`` drafts: a verify
        launched ahead checks these whatever bonus arrives (one other than the guessed verifies drafts
        made for another continuation: they are rejected, which costs acceptance, not correctness).
        An outcome without a proposal, or past the request's chain, gets filler guesses, and a shorter
        proposal is topped up with them. None when a request has no proposals prepared for its current
        tokens."""
        out: list[list[list[int]]] = []
        for req, tree in zip(reqs, trees, strict=True):
            prepared = self._prepared_now(req)
            if prepared is None:
                return None
            filler = [tree.tokens[-1]] * (width - 1)
            per_outcome = [filler] * width
            for key, proposal in prepared.proposals.items():
                # The key is the accepted drafts then the guessed bonus: len(key) - 1 drafts accepted. A
                # chain shorter than ``width`` is topped up with filler guesses.
                if proposal is not None and proposal.is_chain and len(key) <= tree.width:
                    per_outcome[len(key) - 1] = (proposal.tokens[1:width] + filler)[: width - 1]
            out.append(per_outcome)
        return out

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
        self.drafter = self._new_drafter()
        self._cold_waits.clear()
        self._finished.clear()
        self.prepared.clear()
        self.predraft_stats.clear()

    def on_finish(self, req: Req) -> None:
        super().on_finish(req)
        self._cold_waits.pop(req.rid, None)
        self.prepared.pop(req.rid, None)
        self.drafter.forget(req.rid)
        self._finished.append(req.fill_ids)

    def deferred_work(self, sched: SchedulerAPI) -> None:
        """Feed finished requests to the global cache, and index the prompts of the requests the
        scheduler admits next and draft from them (a request whose cached prompt joins a verify
        step then finds its first proposal ready)."""
        finished, self._finished = self._finished, []
        for tokens in finished:
            self.drafter.cache.insert(tokens)
        # The scheduler admits waiting requests as running ones finish, often right after this
        # verify: prepare at least one (beyond the free places).
        budget = max(1, self.config.max_running_requests - sched.num_running())
        version = self.drafter.cache.version
        for req in itertools.islice(sched.waiting, budget):  # the next admissions only
            if req.rid not in self.drafter.indices:
                tree = self.drafter.propose(req.rid, req.fill_ids, self.num_steps, self.num_draft_tokens, self.topk)
                self.prepared[req.rid] = PreparedDrafts(req.fill_len, version, {(): tree})
