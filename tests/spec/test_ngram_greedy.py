"""NGRAM speculative decoding is lossless: greedy output equals plait's non-speculative greedy
output token for token (which tests/test_scheduler.py pins to transformers), for chains and trees, in
batches of mixed lengths, with chunked prefill, prefix-cache hits and retraction; no KV slot is held
after the requests finish."""

from __future__ import annotations

import pytest

from plait.speculative.tree import DraftTree
from plait.speculative.worker import MISS_BACKOFF_MAX
from tests.helpers import GREEDY, assert_no_leaks, count_calls, make_engine, prompt_ids

PROMPTS = prompt_ids(8)
CHAIN = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1}
TREE = {**CHAIN, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model_path):
    engine = make_engine(model_path)
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _corrupt(tokens: list[int], every: int) -> list[int]:
    """A near copy of ``tokens`` with every ``every``-th token changed: a misleading n-gram source."""
    return [t if i % every else (t + 1) % 400 + 4 for i, t in enumerate(tokens)]


@pytest.mark.parametrize("flags", [CHAIN, TREE], ids=["chain", "tree"])
def test_repeated_prompts_are_drafted_from_the_ngram_cache_and_outputs_are_unchanged(model_path, reference, flags):
    engine = make_engine(model_path, **flags)
    first = engine.generate(PROMPTS, GREEDY)
    again = engine.generate(PROMPTS, GREEDY)  # radix-cache hits, n-gram cache full of the answers
    assert [o.token_ids for o in first] == reference
    assert [o.token_ids for o in again] == reference
    assert all(o.meta_info["cached_tokens"] > 0 for o in again)
    # The second pass guesses its own earlier outputs: most steps accept the whole draft.
    assert all(o.meta_info["spec_accept_length"] > 2.5 for o in again)
    stats = engine.scheduler.spec_worker.stats
    assert stats.verify_steps > 0 and max(stats.accept_histogram) == 3
    assert_no_leaks(engine)


def test_tree_whose_first_branch_is_wrong_still_accepts_the_right_one(model_path, reference):
    engine = make_engine(model_path, **TREE)
    drafter = engine.scheduler.spec_worker.drafter
    for p, ref in zip(PROMPTS, reference, strict=True):
        drafter.cache.insert(p + ref)
        for _ in range(2):  # corrupted copies outnumber the truth: they become the first children
            drafter.cache.insert(_corrupt(p + ref, 3))
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = engine.scheduler.spec_worker.stats
    assert sum(c for k, c in stats.accept_histogram.items() if k >= 2) > 0
    assert_no_leaks(engine)


def test_misleading_drafts_are_rejected_and_their_kv_freed(model_path, reference):
    engine = make_engine(model_path, **CHAIN)
    for p, ref in zip(PROMPTS, reference, strict=True):
        engine.scheduler.spec_worker.drafter.cache.insert(_corrupt(p + ref, 2))
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.spec_worker.stats.accept_histogram[0] > 0
    assert_no_leaks(engine)


def test_chunked_prefill_and_prefix_hits(model_path, reference):
    engine = make_engine(model_path, chunked_prefill_size=4, **TREE)
    engine.generate(PROMPTS[:4], GREEDY)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.spec_worker.stats.verify_steps > 0
    assert_no_leaks(engine)


def test_small_kv_pool_retracts_and_outputs_are_unchanged(model_path, reference):
    engine = make_engine(model_path, max_total_tokens=200, disable_radix_cache=True, **CHAIN)
    for p, ref in zip(PROMPTS, reference, strict=True):
        engine.scheduler.spec_worker.drafter.cache.insert(p + ref)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.stats.num_retractions > 0
    assert engine.scheduler.spec_worker.stats.verify_steps > 0
    assert_no_leaks(engine)


def test_stop_tokens_and_max_new_tokens_inside_an_accepted_draft(model_path, reference):
    engine = make_engine(model_path, **CHAIN)
    for p, ref in zip(PROMPTS, reference, strict=True):
        engine.scheduler.spec_worker.drafter.cache.insert(p + ref)
    stop = reference[0][10]
    outs = engine.generate(PROMPTS[:2], [{**GREEDY, "stop_token_ids": [stop]}, {**GREEDY, "max_new_tokens": 9}])
    assert outs[0].token_ids == reference[0][: reference[0].index(stop) + 1]
    assert outs[1].token_ids == reference[1][:9]
    assert_no_leaks(engine)


def test_sampled_requests_are_reproducible_per_seed(model_path):
    """Acceptance draws come from the counter RNG keyed by (seed, step): two engines in the same
    state produce the same tokens. (Which tokens depends on the drafts, as with any rejection
    sampler; the distribution does not: tests/spec/test_accept_distribution.py.)"""
    params = {"temperature": 0.8, "top_k": 20, "max_new_tokens": 24, "seed": 7}
    outs = []
    for _ in range(2):
        engine = make_engine(model_path, **CHAIN)
        engine.generate(PROMPTS[:4], params)
        outs.append([o.token_ids for o in engine.generate(PROMPTS[:4], params)])  # with n-gram hits
        assert engine.scheduler.spec_worker.stats.verify_steps > 0
        assert_no_leaks(engine)
    assert outs[0] == outs[1]


def test_requests_with_penalties_or_logprobs_decode_normally_beside_speculating_ones(model_path, reference):
    engine = make_engine(model_path, **CHAIN)
    for p, ref in zip(PROMPTS, reference, strict=True):
        engine.scheduler.spec_worker.drafter.cache.insert(p + ref)
    params = [{**GREEDY, "logprobs": True}, {**GREEDY, "repetition_penalty": 1.0}, GREEDY, GREEDY]
    outs = engine.generate(PROMPTS[:4], params)
    assert [o.token_ids for o in outs] == reference[:4]
    assert outs[0].meta_info["spec_verify_ct"] == 0 and len(outs[0].meta_info["output_token_logprobs"]) == 32
    assert outs[2].meta_info["spec_verify_ct"] > 0
    assert_no_leaks(engine)


def test_requests_with_logit_bias_decode_with_the_full_sampler_beside_speculating_ones(model_path, reference):
    engine = make_engine(model_path, **CHAIN)
    for p, ref in zip(PROMPTS, reference, strict=True):
        engine.scheduler.spec_worker.drafter.cache.insert(p + ref)
    biased = {**GREEDY, "logit_bias": {str(reference[0][0]): -100}}  # bans the draft's first token
    outs = engine.generate(PROMPTS[:2], [biased, GREEDY])
    assert outs[0].meta_info["spec_verify_ct"] == 0 and outs[0].token_ids[0] != reference[0][0]
    assert outs[1].token_ids == reference[1] and outs[1].meta_info["spec_verify_ct"] > 0
    assert_no_leaks(engine)


def test_the_engine_logs_its_acceptance_distribution(model_path, reference, caplog):
    engine = make_engine(model_path, **CHAIN)
    for p, ref in zip(PROMPTS, reference, strict=True):
        engine.scheduler.spec_worker.drafter.cache.insert(p + ref)
    outs = engine.generate(PROMPTS[:2], GREEDY)
    with caplog.at_level("INFO", logger="plait.speculative.worker"):
        engine.shutdown()
    assert "accepted-draft histogram {" in caplog.text
    stats = engine.scheduler.spec_worker.stats
    assert sum(stats.accept_histogram.values()) == sum(o.meta_info["spec_verify_ct"] for o in outs)


def test_drafts_shorten_for_requests_whose_guesses_keep_failing(model_path, reference):
    """Adaptive width: widths come from spec_info per request and step, never a global constant."""
    engine = make_engine(model_path, **CHAIN)
    worker = engine.scheduler.spec_worker
    for p, ref in zip(PROMPTS, reference, strict=True):
        worker.drafter.cache.insert(_corrupt(p + ref, 1))  # every guess wrong
    widths: list[list[int]] = []
    build = worker.build_verify_batch

    def recording(reqs, trees, slots, **kw):
        fb = build(reqs, trees, slots, **kw)
        widths.append(list(fb.spec_info.num_tokens_per_req))
        return fb

    worker.build_verify_batch = recording
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert max(widths[0]) == 4 and max(widths[-1]) <= 3  # full depth first, shorter drafts later
    assert_no_leaks(engine)


@pytest.fixture
def missing_run(model_path, reference):
    """Fresh prompts, windows of 4 and an empty n-gram cache: nothing to propose. The engine's forwards
    and how often the worker asked its drafter (decode_step calls) over one greedy run."""
    engine = make_engine(model_path, speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=4,
                         speculative_ngram_max_match_window_size=4)
    worker = engine.scheduler.spec_worker
    asked = []
    inner = worker.decode_step
    worker.decode_step = lambda sched: asked.append(1) or inner(sched)
    steps_before = engine.scheduler.stats.forward_steps
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    return engine, len(asked), engine.scheduler.stats.forward_steps - steps_before


def test_misses_back_off_to_plain_overlapped_decode_steps(missing_run):
    """After each miss the worker sits out a doubling run of steps (plain decoding, overlap kept)
    instead of draining every step."""
    engine, asked, steps = missing_run
    assert 0 < asked < steps / 2
    assert_no_leaks(engine)


def test_the_worker_counts_the_steps_it_did_not_verify_by_cause(missing_run):
    """Every step the drafter is asked misses; the steps between are the back-off's."""
    engine, asked, _ = missing_run
    stats = engine.scheduler.spec_worker.stats
    plain = stats.plain_steps
    assert stats.verify_steps == 0
    assert plain["miss"] == asked - 1 > 0  # the first ask came while every request still prefilled
    # After the i-th miss the pause is min(2^i, MISS_BACKOFF_MAX) steps; the last may be cut short.
    assert plain["miss"] < plain["back-off"] <= sum(min(2**i, MISS_BACKOFF_MAX) for i in range(plain["miss"]))
    assert set(plain) == {"miss", "back-off"}


class _OnlySome:
    """An n-gram drafter that proposes only for requests whose prompt is one of ``prompts``."""

    def __init__(self, inner, prompts: list[list[int]]) -> None:
        self.inner, self.prompts = inner, prompts

    def propose(self, rid, context, max_depth, max_nodes, topk, pending=()):
        if not any(context[: len(p)] == p for p in self.prompts):
            return None
        return self.inner.propose(rid, context, max_depth, max_nodes, topk, pending)

    def __getattr__(self, name):  # everything else (cache, indices, forget, index) is the inner drafter's
        return getattr(self.inner, name)


def test_requests_without_a_proposal_ride_in_the_verify_forward(model_path, reference):
    """One forward per speculative step: a request with nothing to propose is a root-only row of the
    verify batch (its decode row), not a second, separate decode forward."""
    engine = make_engine(model_path, **CHAIN)
    worker = engine.scheduler.spec_worker
    for p, ref in zip(PROMPTS[:2], reference[:2], strict=True):
        worker.drafter.cache.insert(p + ref)
    worker.drafter = _OnlySome(worker.drafter, PROMPTS[:2])
    modes: list[str] = []
    forward = engine.runner.forward
    engine.runner.forward = lambda fb, *a, **kw: modes.append(fb.forward_mode.name) or forward(fb, *a, **kw)
    outs = engine.generate(PROMPTS[:4], GREEDY)
    assert [o.token_ids for o in outs] == reference[:4]
    first, last = modes.index("TARGET_VERIFY"), len(modes) - 1 - modes[::-1].index("TARGET_VERIFY")
    assert last - first >= 3 and set(modes[first : last + 1]) == {"TARGET_VERIFY"}
    assert outs[0].meta_info["spec_accept_length"] > 2.5
    assert [o.meta_info["spec_verify_ct"] for o in outs[2:]] == [0, 0]  # riders are not speculation
    assert_no_leaks(engine)


def test_a_request_with_one_token_left_rides_in_the_verify_forward(model_path, reference):
    """No room for a guess (one token left) is not a reason for a second forward: while another
    request drafts, the short request's last token comes from its root-only verify row."""
    engine = make_engine(model_path, **CHAIN)
    worker = engine.scheduler.spec_worker
    for p, ref in zip(PROMPTS[:2], reference[:2], strict=True):
        worker.drafter.cache.insert(p + ref)
    modes: list[str] = []
    forward = engine.runner.forward
    engine.runner.forward = lambda fb, *a, **kw: modes.append(fb.forward_mode.name) or forward(fb, *a, **kw)
    params = [dict(GREEDY), {**GREEDY, "max_new_tokens": 6}]
    outs = engine.generate(PROMPTS[:2], params)
    assert outs[0].token_ids == reference[0] and outs[1].token_ids == reference[1][:6]
    first = modes.index("TARGET_VERIFY")
    assert "DECODE" not in modes[first:], modes
    assert_no_leaks(engine)


def test_finished_requests_reach_the_cache_and_no_request_index_outlives_its_request(model_path, reference):
    """Cache inserts and the prompt indices of admitted-next requests are deferred work (hidden
    behind verify forwards); by the end every finished request is in the cache and no index is left."""
    engine = make_engine(model_path, max_running_requests=2, **CHAIN)
    worker = engine.scheduler.spec_worker
    for p, ref in zip(PROMPTS[:2], reference[:2], strict=True):
        worker.drafter.cache.insert(p + ref)
    indexed_while_waiting: list[str] = []
    index = worker.drafter.index

    def spy(rid, context):
        if any(r.rid == rid for r in engine.scheduler.waiting):
            indexed_while_waiting.append(rid)
        return index(rid, context)

    worker.drafter.index = spy
    outs = engine.generate(PROMPTS[:6], GREEDY)
    assert [o.token_ids for o in outs] == reference[:6]
    assert indexed_while_waiting
    assert worker.drafter.indices == {} and worker._finished == []
    key = tuple((PROMPTS[5] + reference[5])[-3:-1])
    assert worker.drafter.cache.followers(key, limit=1)  # the last request's n-grams are cached
    assert_no_leaks(engine)


def test_admitted_requests_with_a_cached_prompt_join_the_verify_forward(model_path, reference):
    """A repeated prompt is cached but for its last token: its first forward row is a decode row,
    so it joins the running requests' verify forward (drafting from its prompt) instead of costing
    the step a separate prefill forward."""
    engine = make_engine(model_path, max_running_requests=2, **CHAIN)
    assert [o.token_ids for o in engine.generate(PROMPTS[:4], GREEDY)] == reference[:4]  # fills both caches
    modes: list[tuple[str, int]] = []
    forward = engine.runner.forward
    engine.runner.forward = lambda fb, *a, **kw: modes.append((fb.forward_mode.name, fb.batch_size)) or forward(
        fb, *a, **kw)
    outs = engine.generate(PROMPTS[:4], GREEDY)
    assert [o.token_ids for o in outs] == reference[:4]
    # Both first requests joined the first verify; later admissions follow finishes (after a
    # verify) and wait for the next step's verify rather than prefill in a forward of their own.
    assert modes[0] == ("TARGET_VERIFY", 2) and all(mode == "TARGET_VERIFY" for mode, _ in modes), modes
    assert all(o.meta_info["cached_tokens"] == len(p) - 1 for o, p in zip(outs, PROMPTS, strict=False))
    assert_no_leaks(engine)


def test_requests_whose_guesses_keep_failing_stop_drafting_and_probe_rarely(model_path, reference):
    engine = make_engine(model_path, **CHAIN)
    for p, ref in zip(PROMPTS, reference, strict=True):
        engine.scheduler.spec_worker.drafter.cache.insert(_corrupt(p + ref, 1))  # every guess wrong
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    # The acceptance average falls below COLD_ACCEPT after four misses; then one probe per
    # COLD_STEPS drafting opportunities (32 tokens would be 32 verify steps without cooling).
    assert all(1 <= o.meta_info["spec_verify_ct"] <= 8 for o in outs)
    assert_no_leaks(engine)


def test_a_step_where_few_requests_have_guesses_decodes_plainly(model_path, reference):
    """Sporadic matches among misses: with fewer than MIN_DRAFTING_FRACTION of the requests drafting,
    the step is a miss (no verify forward for the riders); outputs are unchanged."""
    engine = make_engine(model_path, **CHAIN)
    worker = engine.scheduler.spec_worker
    worker.drafter.cache.insert(PROMPTS[0] + reference[0])
    worker.drafter = _OnlySome(worker.drafter, PROMPTS[:1])  # 1 of 8 requests can guess
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert worker.stats.verify_steps == 0
    assert_no_leaks(engine)


class _FixedGuess:
    """A drafter that always guesses the same chain for the requests whose prompt is ``prompt``."""

    def __init__(self, inner, prompt: list[int]) -> None:
        self.inner, self.prompt = inner, prompt

    def propose(self, rid, context, max_depth, max_nodes, topk, pending=()):
        if context[: len(self.prompt)] != self.prompt:
            return None
        return DraftTree.chain([*context, *pending][-1], [5, 6, 7][:max_depth])

    def __getattr__(self, name):  # everything else (cache, indices, forget, index) is the inner drafter's
        return getattr(self.inner, name)


def test_sampled_riders_draw_the_token_plain_decoding_draws(model_path):
    """A sampled request without a draft is sampled on the device like a plain decode step (same seed,
    step and stream), so its output equals the non-speculative engine's."""
    params = [{"temperature": 0.8, "top_k": 50, "max_new_tokens": 16, "seed": 100 + i} for i in range(4)]
    plain = [o.token_ids for o in make_engine(model_path).generate(PROMPTS[:4], params)]
    engine = make_engine(model_path, **CHAIN)
    worker = engine.scheduler.spec_worker
    worker.drafter = _FixedGuess(worker.drafter, PROMPTS[0])
    outs = engine.generate(PROMPTS[:4], params)
    assert worker.stats.verify_steps >= 3  # until the always-wrong guesser cools
    assert [o.token_ids for o in outs[1:]] == plain[1:]
    assert [o.meta_info["spec_verify_ct"] for o in outs[1:]] == [0, 0, 0]
    assert_no_leaks(engine)


@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("flags", [CHAIN, TREE], ids=["chain", "tree"])
def test_steps_drafted_during_the_verify_keep_greedy_output_unchanged(model_path, reference, flags, bs):
    engine = make_engine(model_path, max_running_requests=bs, chunked_prefill_size=8, **flags)
    engine.generate(PROMPTS[:3], GREEDY)  # fills the n-gram cache with the answers
    worker = engine.scheduler.spec_worker
    worker.predraft_stats.clear()
    outs = engine.generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == reference[:3]
    stats = worker.predraft_stats
    # Repeats land on the guessed outcome: most proposals were ready when the verify came back.
    assert stats["hit"] > 2 * (stats["miss"] + stats["unprepared"]), stats
    assert not worker.prepared and not worker.drafter.indices  # nothing outlives its request
    assert_no_leaks(engine)



# --- chained verifies (BaseSpecWorker.verify): the next verify launches before the tokens' commit ---


@pytest.fixture
def chained(monkeypatch):
    """Chained verifies on (PLAIT_SPEC_CHAIN_VERIFIES, the default) for the engines a test builds, whatever
    the environment says."""
    monkeypatch.setenv("PLAIT_SPEC_CHAIN_VERIFIES", "1")


def test_an_ngram_worker_on_one_rank_chains_verifies_by_default(model_path, monkeypatch):
    monkeypatch.delenv("PLAIT_SPEC_CHAIN_VERIFIES", raising=False)
    engine = make_engine(model_path, **CHAIN)
    assert engine.scheduler.spec_worker.chains_verify


def test_with_the_switch_off_every_verify_commits_before_the_next_is_built(model_path, reference, monkeypatch):
    monkeypatch.setenv("PLAIT_SPEC_CHAIN_VERIFIES", "0")
    engine = make_engine(model_path, max_running_requests=3, **CHAIN)
    engine.generate(PROMPTS[:3], GREEDY)
    worker = engine.scheduler.spec_worker
    assert not worker.chains_verify
    steps = count_calls(worker, "decode_step")
    v0 = worker.stats.verify_steps
    assert [o.token_ids for o in engine.generate(PROMPTS[:3], GREEDY)] == reference[:3]
    assert worker.stats.verify_steps - v0 <= steps[0]  # at most one verify per scheduler step

@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("flags", [CHAIN, TREE], ids=["chain", "tree"])
def test_chained_verifies_keep_greedy_output_unchanged(model_path, reference, flags, bs, chained):
    engine = make_engine(model_path, max_running_requests=bs, **flags)
    engine.generate(PROMPTS[:3], GREEDY)  # fills the n-gram cache with the answers
    worker = engine.scheduler.spec_worker
    steps = count_calls(worker, "decode_step")  # one call per speculative scheduler step
    v0 = worker.stats.verify_steps
    outs = engine.generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == reference[:3]
    # Most verifies launched from the previous one's outcome, inside one scheduler step.
    assert worker.stats.verify_steps - v0 > 2 * steps[0], (worker.stats.verify_steps - v0, steps[0])
    assert_no_leaks(engine)


def test_chains_with_requests_finishing_at_different_steps_and_admissions_mid_run(model_path, reference, chained):
    lengths = [32, 9, 20, 32, 13, 27, 5, 32]  # finishes at different steps, inside accepted drafts too
    params = [{**GREEDY, "max_new_tokens": n} for n in lengths]
    engine = make_engine(model_path, max_running_requests=3, **CHAIN)  # 8 requests, 3 at a time
    worker = engine.scheduler.spec_worker
    for p, ref in zip(PROMPTS, reference, strict=True):
        worker.drafter.cache.insert(p + ref)
    steps = count_calls(worker, "decode_step")
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [ref[:n] for ref, n in zip(reference, lengths, strict=True)]
    assert worker.stats.verify_steps > steps[0]  # chains ran between the admissions
    assert not worker.prepared and not worker.drafter.indices
    assert_no_leaks(engine)


def test_a_stop_string_found_while_the_next_verify_runs_drops_its_rows(model_path, chained):
    plain = make_engine(model_path)
    full = plain.generate(PROMPTS[1], GREEDY)
    engine = make_engine(model_path, **CHAIN)
    engine.generate(PROMPTS[1], GREEDY)  # the n-gram cache knows the answer: every step chains
    worker = engine.scheduler.spec_worker
    dropped = [0]
    inner = worker.commit_kv

    def commit_kv(sched, step, results):
        dropped[0] += sum(r is None for r in results)  # finished after this verify launched
        return inner(sched, step, results)

    worker.commit_kv = commit_kv
    text = full.text
    for k in range(1, 5):
        stop = text[k * len(text) // 5 :][:2]
        assert stop.strip(), "need a visible stop string"
        expected = plain.generate(PROMPTS[1], {**GREEDY, "stop": [stop]})
        out = engine.generate(PROMPTS[1], {**GREEDY, "stop": [stop]})
        assert (out.token_ids, out.text, out.finish_reason) == (expected.token_ids, expected.text, "stop")
        assert_no_leaks(engine)
    assert dropped[0] > 0  # some stops were found by a commit behind the next verify


def test_the_proposal_chosen_from_an_outcome_equals_the_one_drafted_after_its_commit(model_path, reference, chained):
    import copy

    from plait.speculative.ngram import COLD_ACCEPT

    engine = make_engine(model_path, max_running_requests=3, **TREE)
    engine.generate(PROMPTS[:3], GREEDY)
    worker = engine.scheduler.spec_worker
    inner = worker.propose_after
    compared = [0]

    def propose_after(sched, reqs, depths, gained):
        # The drafter as the next step's propose finds it (the request indices it extends copied).
        after = copy.copy(worker.drafter)
        after.indices = {r.rid: copy.deepcopy(worker.drafter.indices[r.rid]) for r in reqs}
        cold = [worker.accept_ema.get(r.rid, 4.0) < COLD_ACCEPT for r in reqs]
        got = inner(sched, reqs, depths, gained)
        for req, depth, g, tree, skip in zip(reqs, depths, gained, got, cold, strict=True):
            if skip:
                continue
            want = after.propose(req.rid, req.fill_ids + g, depth, worker.num_draft_tokens, worker.topk)
            assert (tree and (tree.tokens, tree.parents)) == (want and (want.tokens, want.parents))
            compared[0] += 1
        return got

    worker.propose_after = propose_after
    worker.predraft_stats.clear()
    assert [o.token_ids for o in engine.generate(PROMPTS[:3], GREEDY)] == reference[:3]
    assert compared[0] > 10 and worker.predraft_stats["hit"] > 10, (compared, worker.predraft_stats)


def test_chains_mapped_at_their_launch_keep_greedy_output_and_free_the_rejected_slots(model_path, reference, chained):
    # Misleading cache entries make verifies reject part of their chains; requests of different
    # lengths and riders give padded batches too.
    engine = make_engine(model_path, max_running_requests=4, **CHAIN)
    worker = engine.scheduler.spec_worker
    # Every 5th token changed: chains long enough to be premapped at the padded width, and wrong often
    # enough to be rejected (both asserted below; which pattern gives both depends on the drafts).
    for p, ref in zip(PROMPTS, reference, strict=True):
        worker.drafter.cache.insert(_corrupt(p + ref, 5))
    premapped = [0]
    inner = worker.premap_chains

    def premap_chains(sched, fb, trees, pad_width):
        done = inner(sched, fb, trees, pad_width)
        premapped[0] += done
        return done

    worker.premap_chains = premap_chains
    lengths = [32, 7, 19, 32, 11, 25, 3, 32]
    outs = engine.generate(PROMPTS, [{**GREEDY, "max_new_tokens": n} for n in lengths])
    assert [o.token_ids for o in outs] == [ref[:n] for ref, n in zip(reference, lengths, strict=True)]
    assert premapped[0] > 0 and worker.stats.accept_histogram[0] > 0  # premapped, and rejections
    assert_no_leaks(engine)
