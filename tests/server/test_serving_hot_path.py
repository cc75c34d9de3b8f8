"""The HTTP process's per-request and per-token work under load: which completions prompts are
checked on the event loop (token ids, bounded) rather than on the tokenizer thread, latency
histograms that count a merged event's tokens at once, and merging a long backlog in one pass."""

from __future__ import annotations

from plait.server.prompt_work import INLINE_PROMPT_IDS, ids_only


def test_token_id_prompts_within_the_bound_stay_on_the_loop():
    assert ids_only([5, 6, 7])
    assert ids_only([[5, 6], [7]])
    assert ids_only([1] * INLINE_PROMPT_IDS)


def test_text_empty_or_oversized_prompts_go_to_the_tokenizer_thread():
    assert not ids_only("hello")
    assert not ids_only(["hello", "world"])
    assert not ids_only([])
    assert not ids_only([1] * (INLINE_PROMPT_IDS + 1))
    assert not ids_only([[1] * INLINE_PROMPT_IDS, [2]])


def test_a_latency_histogram_counts_k_tokens_of_one_event_as_k_observations():
    from plait.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.itl.observe(0.02, 3)
    metrics.itl.observe(0.2)
    text = metrics.render().decode()
    assert 'plait:inter_token_latency_seconds_bucket{le="0.025",model_name="m"} 3.0' in text
    assert 'plait:inter_token_latency_seconds_bucket{le="0.2",model_name="m"} 4.0' in text
    assert 'plait:inter_token_latency_seconds_count{model_name="m"} 4.0' in text
    assert 'plait:inter_token_latency_seconds_sum{model_name="m"} 0.26' in text


def test_coalescing_a_long_backlog_keeps_every_token_text_and_logprob_in_order():
    from plait.engine.messages import RequestUpdate, coalesce_updates

    ups = [RequestUpdate("a", [i], f"<{i}>", logprobs=[-i / 10], completion_tokens=i + 1) for i in range(50)]
    ups[-1].finish_reason = "length"
    [merged] = coalesce_updates(ups)
    assert merged.token_ids == list(range(50)) and merged.text == "".join(f"<{i}>" for i in range(50))
    assert merged.logprobs == [-i / 10 for i in range(50)]
    assert merged.completion_tokens == 50 and merged.finish_reason == "length"
