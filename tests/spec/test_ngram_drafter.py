"""The NGRAM drafter's parts: the per-request prompt-lookup index, the bounded global n-gram cache and
the tree it proposes."""

from __future__ import annotations

from plait.speculative.ngram import NgramCache, NgramDrafter, RequestIndex


def test_cache_counts_followers_and_ranks_them_by_frequency():
    cache = NgramCache(min_window=2, max_window=3, capacity=100)
    cache.insert([1, 2, 7, 1, 2, 8, 1, 2, 8])
    assert cache.followers((1, 2), limit=2) == [8, 7]
    assert cache.followers((1, 2), limit=1) == [8]
    assert cache.followers((2, 8, 1), limit=1) == [2]
    assert cache.followers((5, 6), limit=1) == []


def test_cache_ties_go_to_the_follower_seen_last():
    cache = NgramCache(min_window=2, max_window=2, capacity=100)
    cache.insert([1, 2, 9, 1, 2, 4])
    assert cache.followers((1, 2), limit=1) == [4]
    assert cache.followers((1, 2), limit=2) == [4, 9]


def test_a_repeated_request_drafts_its_latest_continuation():
    cache = NgramCache(min_window=2, max_window=2, capacity=100)
    cache.insert([5, 6, 7, 8])  # the first run of a prompt [5, 6]
    cache.insert([5, 6, 3, 8])  # a later run went another way after it
    assert cache.followers((5, 6), limit=1) == [3]
    cache.insert([5, 6, 7, 1])  # and back: 7 now seen twice
    assert cache.followers((5, 6), limit=2) == [7, 3]


def test_cache_is_bounded_and_forgets_its_oldest_keys():
    cache = NgramCache(min_window=2, max_window=2, capacity=3)
    cache.insert([1, 2, 3, 4])  # keys (1, 2), (2, 3)
    cache.insert([5, 6, 7, 8])  # keys (5, 6), (6, 7): one over capacity
    assert len(cache) == 3
    assert cache.followers((1, 2), limit=1) == []  # the oldest key went
    assert cache.followers((6, 7), limit=1) == [8]


def test_request_index_grows_with_the_request_and_finds_earlier_occurrences():
    index = RequestIndex(max_window=3)
    index.extend([4, 5, 6, 4, 5])
    assert index.followers((4, 5), limit=1) == [6]
    index.extend([4, 5, 6, 4, 5, 9])  # only the new tail is indexed
    assert index.tokens == [4, 5, 6, 4, 5, 9]
    assert index.followers((4, 5), limit=2) == [9, 6]  # most recent occurrence first


def test_request_index_holds_only_the_looked_up_lengths():
    index = RequestIndex(max_window=3, min_window=2)
    index.extend([4, 5, 6, 4, 5])
    assert {len(k) for k in index.ends} == {2, 3}
    assert index.followers((4,), limit=1) == []


def test_drafter_proposes_a_chain_from_the_prompt_and_nothing_without_a_match():
    drafter = NgramDrafter(min_window=2, max_window=3, capacity=100)
    context = [10, 11, 12, 13, 14, 10, 11]
    tree = drafter.propose("r", context, max_depth=3, max_nodes=4, topk=1)
    assert tree is not None and tree.tokens == [11, 12, 13, 14] and tree.parents == [-1, 0, 1, 2]
    assert drafter.propose("s", [20, 21, 22, 23], max_depth=3, max_nodes=4, topk=1) is None


def test_drafter_falls_back_to_the_global_cache_and_branches_up_to_topk():
    drafter = NgramDrafter(min_window=2, max_window=2, capacity=100)
    drafter.cache.insert([30, 31, 32, 30, 31, 33, 30, 31, 32])  # a finished request's tokens
    tree = drafter.propose("r", [7, 30, 31], max_depth=1, max_nodes=3, topk=2)
    assert tree is not None and tree.tokens == [31, 32, 33] and tree.parents == [-1, 0, 0]
