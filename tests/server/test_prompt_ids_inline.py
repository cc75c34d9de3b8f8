"""Which completions prompts the HTTP process checks on its event loop (token ids, bounded) rather
than on the tokenizer thread."""

from __future__ import annotations

from plait.server.prompt_work import INLINE_PROMPT_IDS, ids_only


def test_token_id_prompts_within_the_bound_stay_on_the_loop():
    assert ids_only([5, 6, 7])
    assert ids_only([[5, 6], [7]])
    assert ids_only([1] * INLINE_PROMPT_IDS)


def test_text_mixed_empty_or_oversized_prompts_go_to_the_tokenizer_thread():
    assert not ids_only("hello")
    assert not ids_only(["hello", "world"])
    assert not ids_only([[5, 6], "world"])
    assert not ids_only([])
    assert not ids_only([1] * (INLINE_PROMPT_IDS + 1))
    assert not ids_only([[1] * INLINE_PROMPT_IDS, [2]])
