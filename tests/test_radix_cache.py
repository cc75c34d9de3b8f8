"""Tests for plait.mem.radix_cache.RadixCache (page size 1)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from plait.mem.radix_cache import MatchResult, RadixCache, TreeNode


class RecordingAllocator:
    """Minimal slot allocator: hands out fresh slot ids and records what comes back.

    It rejects double frees and frees of never-allocated slots, so any ownership bug in the cache
    fails loudly.
    """

    def __init__(self) -> None:
        self.next_slot = 0
        self.allocated: set[int] = set()
        self.freed: set[int] = set()
        self.free_calls = 0

    def alloc(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        self.allocated.update(out.tolist())
        return out

    def free(self, indices: torch.Tensor) -> None:
        assert indices.dtype == torch.int64 and indices.dim() == 1
        self.free_calls += 1
        for s in indices.tolist():
            assert s in self.allocated, f"freed slot {s} was never allocated"
            assert s not in self.freed, f"slot {s} freed twice"
            self.freed.add(s)

    def live(self) -> set[int]:
        return self.allocated - self.freed


def make() -> tuple[RadixCache, RecordingAllocator]:
    alloc = RecordingAllocator()
    return RadixCache(alloc), alloc


def put(cache: RadixCache, alloc: RecordingAllocator, tokens: list[int]) -> torch.Tensor:
    """Insert `tokens` with fresh slots, freeing the duplicates as a scheduler would."""
    kv = alloc.alloc(len(tokens))
    n = cache.insert(tokens, kv)
    if n:
        alloc.free(kv[:n])
    return kv


def check_invariants(cache: RadixCache) -> None:
    held = sum(len(n.key) for n in walk(cache.root) if n is not cache.root)
    assert cache.evictable_size() + cache.protected_size() == cache.total_size() == held
    for node in walk(cache.root):
        for first, child in node.children.items():
            assert child.parent is node
            assert child.key[0] == first and len(child.key) == len(child.value) > 0
        # A node's count includes every lock taken on its descendants.
        assert node is cache.root or node.lock_ref >= sum(c.lock_ref for c in node.children.values())


def walk(node: TreeNode) -> list[TreeNode]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


# ---------------------------------------------------------------------- matching


def test_match_on_empty_tree_returns_root_and_no_slots() -> None:
    cache, _ = make()
    res = cache.match_prefix([1, 2, 3])
    assert isinstance(res, MatchResult)
    assert res.last_node is cache.root
    assert res.kv_indices.dtype == torch.int64 and res.kv_indices.numel() == 0


def test_exact_match_returns_all_slots() -> None:
    cache, alloc = make()
    kv = put(cache, alloc, [5, 6, 7, 8])
    res = cache.match_prefix([5, 6, 7, 8])
    assert res.kv_indices.tolist() == kv.tolist()
    assert res.last_node.key == (5, 6, 7, 8)


def test_partial_match_returns_slots_of_matched_prefix() -> None:
    cache, alloc = make()
    kv = put(cache, alloc, [5, 6, 7, 8])
    # Query longer than what is stored: the whole stored sequence matches.
    assert cache.match_prefix([5, 6, 7, 8, 9, 10]).kv_indices.tolist() == kv.tolist()
    # Query shorter than the stored node: only its first tokens' slots.
    assert cache.match_prefix([5, 6]).kv_indices.tolist() == kv[:2].tolist()


def test_diverging_match_returns_common_prefix_slots() -> None:
    cache, alloc = make()
    kv_a = put(cache, alloc, [1, 2, 3, 4])
    kv_b = alloc.alloc(4)
    assert cache.insert([1, 2, 9, 9], kv_b) == 2
    res = cache.match_prefix([1, 2, 9, 9, 9])
    assert res.kv_indices.tolist() == kv_a[:2].tolist() + kv_b[2:].tolist()
    assert cache.match_prefix([1, 2, 3, 0]).kv_indices.tolist() == kv_a[:3].tolist()
    assert cache.match_prefix([7, 1, 2]).kv_indices.numel() == 0


def test_match_result_is_a_copy_not_a_view_of_tree_storage() -> None:
    cache, alloc = make()
    kv = put(cache, alloc, [1, 2, 3])
    cache.match_prefix([1, 2, 3]).kv_indices.fill_(-1)
    assert cache.match_prefix([1, 2, 3]).kv_indices.tolist() == kv.tolist()


def test_match_accepts_tensor_token_ids() -> None:
    cache, alloc = make()
    kv = put(cache, alloc, [1, 2, 3])
    assert cache.match_prefix(torch.tensor([1, 2, 3])).kv_indices.tolist() == kv.tolist()


# ---------------------------------------------------------------------- insert / split


def test_insert_returns_already_present_prefix_length() -> None:
    cache, alloc = make()
    assert cache.insert([1, 2, 3], alloc.alloc(3)) == 0
    assert cache.insert([1, 2, 3, 4, 5], alloc.alloc(5)) == 3
    assert cache.insert([1, 2, 7], alloc.alloc(3)) == 2
    assert cache.insert([1, 2, 3], alloc.alloc(3)) == 3
    assert cache.insert([8], alloc.alloc(1)) == 0


def test_insert_takes_ownership_only_of_the_new_suffix() -> None:
    cache, alloc = make()
    first = put(cache, alloc, [1, 2, 3])
    second = alloc.alloc(5)
    n = cache.insert([1, 2, 3, 4, 5], second)
    assert n == 3
    # The tree keeps its original slots for the shared part and adopts the caller's for the rest.
    assert cache.match_prefix([1, 2, 3, 4, 5]).kv_indices.tolist() == first.tolist() + second[3:].tolist()
    assert cache.total_size() == 5


def test_insert_copies_kv_indices_so_caller_buffer_reuse_is_harmless() -> None:
    cache, alloc = make()
    kv = alloc.alloc(3)
    expected = kv.tolist()
    cache.insert([1, 2, 3], kv)
    kv.fill_(-1)
    assert cache.match_prefix([1, 2, 3]).kv_indices.tolist() == expected


def test_insert_rejects_length_mismatch() -> None:
    cache, alloc = make()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], alloc.alloc(2))


def test_split_inside_node_keeps_both_halves_slots() -> None:
    cache, alloc = make()
    kv = put(cache, alloc, [1, 2, 3, 4, 5, 6])
    res = cache.match_prefix([1, 2, 3, 9])  # ends inside the node: splits it after 3 tokens
    assert res.kv_indices.tolist() == kv[:3].tolist()
    upper = res.last_node
    assert upper.key == (1, 2, 3) and upper.value.tolist() == kv[:3].tolist()
    (lower,) = upper.children.values()
    assert lower.key == (4, 5, 6) and lower.value.tolist() == kv[3:].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).kv_indices.tolist() == kv.tolist()
    assert cache.total_size() == cache.evictable_size() == 6
    check_invariants(cache)


# ---------------------------------------------------------------------- locking


def test_lock_moves_path_sizes_from_evictable_to_protected() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 3, 4, 5])
    put(cache, alloc, [9, 9])
    node = cache.match_prefix([1, 2, 3, 4, 5]).last_node
    cache.inc_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (5, 2)
    cache.inc_lock_ref(node)  # a second lock changes no sizes
    assert (cache.protected_size(), cache.evictable_size()) == (5, 2)
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (5, 2)
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 7)
    check_invariants(cache)


def test_lock_survives_split_of_locked_node() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    put(cache, alloc, [1, 2, 7])  # splits the locked node after 2 tokens
    assert node.key == (3, 4) and node.parent is not None and node.parent.lock_ref == 1
    assert (cache.protected_size(), cache.evictable_size()) == (4, 1)
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 5)
    check_invariants(cache)


def test_dec_lock_ref_on_unlocked_node_raises() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2])
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(cache.match_prefix([1, 2]).last_node)


def test_locked_nodes_are_never_evicted() -> None:
    cache, alloc = make()
    kv_locked = put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [4, 5])
    put(cache, alloc, [1, 2, 3, 6])  # child of the locked node, itself unlocked
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_node)
    freed = cache.evict(100)
    assert freed == 3  # [4, 5] and [6]; nothing else is evictable
    assert not (set(kv_locked.tolist()) & alloc.freed)
    assert cache.match_prefix([1, 2, 3]).kv_indices.tolist() == kv_locked.tolist()
    assert cache.evictable_size() == 0 and cache.protected_size() == 3
    assert cache.evict(1) == 0
    check_invariants(cache)


# ---------------------------------------------------------------------- eviction


def test_eviction_order_is_lru_accessed_node_survives() -> None:
    cache, alloc = make()
    kv_a = put(cache, alloc, [1, 1])
    kv_b = put(cache, alloc, [2, 2])
    kv_c = put(cache, alloc, [3, 3])
    cache.match_prefix([1, 1])  # touch the oldest: now b is least recently used, then c
    assert cache.evict(2) == 2
    assert alloc.freed == set(kv_b.tolist())
    assert cache.evict(2) == 2
    assert alloc.freed == set(kv_b.tolist()) | set(kv_c.tolist())
    assert cache.match_prefix([1, 1]).kv_indices.tolist() == kv_a.tolist()


def test_insert_refreshes_lru_of_its_path() -> None:
    cache, alloc = make()
    kv_a = put(cache, alloc, [1, 1])
    kv_b = put(cache, alloc, [2, 2])
    put(cache, alloc, [1, 1])  # re-inserting a cached sequence counts as an access
    duplicates = set(alloc.freed)  # put() freed the second copy's slots itself
    cache.evict(1)
    assert alloc.freed - duplicates == set(kv_b.tolist())
    assert cache.match_prefix([1, 1]).kv_indices.tolist() == kv_a.tolist()


def test_evicting_leaf_exposes_parent_for_eviction() -> None:
    cache, alloc = make()
    kv = put(cache, alloc, [1, 2, 3, 4])
    cache.match_prefix([1, 2])  # split: parent [1, 2], leaf [3, 4]
    kv_other = put(cache, alloc, [7, 7])  # newer than both halves
    # Needing 4 tokens: the leaf [3, 4] goes first (the parent is not a leaf yet), then the
    # parent, now a leaf and older than [7, 7], goes too.
    assert cache.evict(4) == 4
    assert alloc.freed == set(kv.tolist())
    assert cache.match_prefix([1, 2]).kv_indices.numel() == 0
    assert cache.match_prefix([7, 7]).kv_indices.tolist() == kv_other.tolist()
    check_invariants(cache)


def test_evict_frees_exactly_evicted_slots_and_reports_count() -> None:
    cache, alloc = make()
    kv_a = put(cache, alloc, [1, 2, 3])  # oldest, 3 tokens
    put(cache, alloc, [4, 5, 6, 7])
    before = cache.total_size()
    # Whole nodes are evicted: asking for 1 frees the entire LRU leaf.
    freed = cache.evict(1)
    assert freed == 3 == len(alloc.freed)
    assert alloc.freed == set(kv_a.tolist())
    assert cache.total_size() == before - freed == cache.evictable_size()
    assert alloc.free_calls == 1
    assert cache.evict(0) == 0 and alloc.free_calls == 1


def test_evict_everything_returns_less_than_requested_when_tree_runs_out() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 5])
    assert cache.evict(1000) == 4
    assert cache.total_size() == cache.evictable_size() == 0
    assert alloc.live() == set()


# ---------------------------------------------------------------------- property-style model check


def test_sizes_and_matches_agree_with_brute_force_model_over_random_operations() -> None:
    """Random inserts/matches/locks/evictions, checked against a token-level trie model.

    The model maps every cached prefix (a tuple) to the slot of its last token, and counts the
    locks covering each prefix. The tree's node grouping is invisible to it, so it checks the
    observable contract: matched slots, insert's return value, sizes, and which slots evict frees.
    """
    rng = random.Random(1234)
    cache, alloc = make()
    model: dict[tuple[int, ...], int] = {}
    locks: Counter[tuple[int, ...]] = Counter()
    held: list[tuple[TreeNode, tuple[int, ...]]] = []

    def rand_tokens() -> list[int]:
        # Small alphabet and short lengths so prefixes are shared and nodes split often.
        return [rng.randrange(3) for _ in range(rng.randint(1, 7))]

    def model_match(tokens: list[int]) -> list[int]:
        out = []
        for i in range(1, len(tokens) + 1):
            if tuple(tokens[:i]) not in model:
                break
            out.append(model[tuple(tokens[:i])])
        return out

    for step in range(3000):
        op = rng.random()
        if op < 0.35:
            tokens = rand_tokens()
            kv = alloc.alloc(len(tokens))
            expected = len(model_match(tokens))
            n = cache.insert(tokens, kv)
            assert n == expected, step
            alloc.free(kv[:n])
            for i in range(n, len(tokens)):
                model[tuple(tokens[: i + 1])] = int(kv[i])
        elif op < 0.6:
            tokens = rand_tokens()
            res = cache.match_prefix(tokens)
            want = model_match(tokens)
            assert res.kv_indices.tolist() == want, step
            if want and rng.random() < 0.5:
                cache.inc_lock_ref(res.last_node)
                prefix = tuple(tokens[: len(want)])
                held.append((res.last_node, prefix))
                for i in range(1, len(prefix) + 1):
                    locks[prefix[:i]] += 1
        elif op < 0.8:
            if held:
                node, prefix = held.pop(rng.randrange(len(held)))
                cache.dec_lock_ref(node)
                for i in range(1, len(prefix) + 1):
                    locks[prefix[:i]] -= 1
        else:
            want = rng.randint(1, 10)
            before = set(alloc.freed)
            got = cache.evict(want)
            newly = alloc.freed - before
            assert got == len(newly), step
            slot_to_prefix = {s: p for p, s in model.items()}
            for s in newly:
                p = slot_to_prefix[s]  # KeyError means the cache freed a slot it did not hold
                assert locks[p] == 0, f"step {step}: evicted locked prefix {p}"
                del model[p]
            # Only whole subtrees from the leaves go: what remains is still prefix-closed.
            assert all(p[:-1] in model for p in model if len(p) > 1), step
            assert got >= want or cache.evictable_size() == 0, step

        protected = sum(1 for p in model if locks[p] > 0)
        assert cache.protected_size() == protected, step
        assert cache.evictable_size() == len(model) - protected, step
        assert cache.total_size() == len(model), step
        # Every live slot the test allocated is held by the tree (duplicates were freed at once).
        assert alloc.live() == set(model.values()), step
        if step % 100 == 0:
            check_invariants(cache)

    for node, _ in held:
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    cache.reset()
    assert alloc.live() == set()


# ---------------------------------------------------------------------- disabled / reset / debug


def test_disabled_cache_never_matches_and_holds_nothing() -> None:
    alloc = RecordingAllocator()
    cache = RadixCache(alloc, disable=True)
    assert not cache.enabled
    kv = alloc.alloc(3)
    assert cache.insert([1, 2, 3], kv) == 0
    res = cache.match_prefix([1, 2, 3])
    assert res.last_node is cache.root and res.kv_indices.numel() == 0
    cache.inc_lock_ref(res.last_node)
    cache.dec_lock_ref(res.last_node)
    assert cache.evict(10) == 0
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    # Nothing was handed over: the caller still owns (and must free) every slot.
    assert alloc.freed == set()
    cache.reset()
    assert alloc.freed == set()


def test_enabled_property_is_true_by_default() -> None:
    cache, _ = make()
    assert cache.enabled


def test_reset_frees_everything() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5])
    put(cache, alloc, [6])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.live() == set()
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.match_prefix([1, 2, 3]).kv_indices.numel() == 0
    # The cache is usable again after a reset.
    kv = put(cache, alloc, [1, 2])
    assert cache.match_prefix([1, 2]).kv_indices.tolist() == kv.tolist()


def test_reset_raises_when_a_node_is_locked_and_frees_nothing() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_node)
    with pytest.raises(RuntimeError):
        cache.reset()
    assert alloc.freed == set() and cache.protected_size() == 3


def test_pretty_print_shows_every_node() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    lines = cache.pretty_print().splitlines()
    assert len(lines) == 1 + 3  # header + [1, 2] + [3] + [4]
    assert "tokens=[1, 2]" in lines[1] and "tokens=[3]" in lines[2] and "tokens=[4]" in lines[3]
