"""Incremental detokenization: multi-byte characters, stop strings held back while streaming."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from plait.scheduler.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def _stream(tokenizer, text: str, stop: tuple[str, ...] = (), **options) -> tuple[list[str], IncrementalDetokenizer]:
    return _stream_ids(tokenizer, tokenizer.encode(text, add_special_tokens=False), stop, **options)


def _stream_ids(tokenizer, ids: list[int], stop: tuple[str, ...] = (), **options
                ) -> tuple[list[str], IncrementalDetokenizer]:
    """Each id streamed after "Say:" until a stop string, then the flush: (the deltas, the detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:", add_special_tokens=False), stop, **options)
    deltas = []
    for i in ids:
        detok.add_token(i)
        if detok.find_stop():
            break
        deltas.append(detok.take_delta(finished=False))
    detok.finish()
    deltas.append(detok.take_delta(finished=True))
    return deltas, detok


def test_multibyte_characters_split_across_tokens_stream_intact(tokenizer):
    text = " héllo 你好世界 🙂🚀 naïve café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters span several byte tokens
    deltas, detok = _stream(tokenizer, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.final_text() == text


def test_stop_string_is_trimmed_and_never_streamed(tokenizer):
    deltas, detok = _stream(tokenizer, " The quick brown fox jumps", stop=("fox",))
    assert detok.final_text() == " The quick brown "
    assert "".join(deltas) == " The quick brown "


def test_no_stop_trim_keeps_the_stop_string_in_the_text_and_the_stream(tokenizer):
    deltas, detok = _stream(tokenizer, " The quick brown fox jumps", stop=("fox",), no_stop_trim=True)
    assert detok.final_text() == " The quick brown fox"
    assert "".join(deltas) == " The quick brown fox"


def test_partial_stop_string_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], ("brown cow",))
    for i in tokenizer.encode(" The quick brown", add_special_tokens=False):
        detok.add_token(i)
    assert not detok.find_stop()
    assert detok.take_delta(finished=False) == " The quick "  # "brown" may start the stop string
    for i in tokenizer.encode(" fox", add_special_tokens=False):
        detok.add_token(i)
    assert not detok.find_stop()
    assert detok.take_delta(finished=False) == "brown fox"


def test_incomplete_trailing_bytes_are_flushed_at_finish(tokenizer):
    # A character the tokenizer splits into several byte tokens (rare CJK / emoji).
    char = next(c for c in "龘🦙鑫🧬" if len(tokenizer.encode(c, add_special_tokens=False)) > 1)
    ids = tokenizer.encode(char, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], ())
    detok.add_token(ids[0])
    assert detok.text == ""  # incomplete: held back
    detok.finish()
    assert detok.final_text().endswith("\ufffd")


@pytest.mark.parametrize("cut", [None, -1])  # the whole text; the text ending inside an emoji's bytes
def test_deferred_tokens_read_at_once_give_the_same_text_as_reading_each(tokenizer, cut):
    text = " héllo 你好世界 🙂🚀 naïve café and more words"
    ids = tokenizer.encode(text, add_special_tokens=False)
    if cut is not None:
        ids = tokenizer.encode(" a 🙂🚀", add_special_tokens=False)[:cut]
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    each, once = IncrementalDetokenizer(tokenizer, prompt, ()), IncrementalDetokenizer(tokenizer, prompt, ())
    for i in ids:
        each.add_token(i)
        _ = each.text
        once.add_token(i)
    assert once.text == each.text
    each.finish()
    once.finish()
    assert once.final_text() == each.final_text()
    if cut is None:
        assert once.final_text() == text


def test_finishing_a_text_that_keeps_ending_inside_a_character_decodes_one_window(tokenizer):
    # A lone lead byte, then special tokens (skipped, so they decode to nothing): a text that ends
    # inside a character for hundreds of tokens. The flush decodes the unfolded ids once, not once per
    # token.
    lead = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
    special = tokenizer.eos_token_id
    assert tokenizer.decode([special], skip_special_tokens=True) == ""
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(" ok", add_special_tokens=False) + [lead] + [special] * 500
    detok = IncrementalDetokenizer(tokenizer, prompt, ())
    detok.add_tokens(ids)
    calls = []
    decode = detok._decode_fn
    detok._decode_fn = lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw)
    detok.finish()
    assert len(calls) <= 2
    assert detok.final_text() == " ok\ufffd"


def _out_of_vocabulary(tokenizer, n: int) -> list[int]:
    return [len(tokenizer) + 1000 + 7 * k for k in range(n)]


def test_ids_without_a_token_leave_the_streamed_text_unchanged(tokenizer):
    # A model's vocabulary may be padded past its tokenizer's; such ids decode to nothing.
    text = " héllo 你好世界 🙂🚀 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    unknown = iter(_out_of_vocabulary(tokenizer, 4 * len(ids)))
    mixed = [t for i in ids for t in (i, next(unknown), next(unknown))]
    (plain, plain_detok), (with_unknown, detok) = _stream_ids(tokenizer, ids), _stream_ids(tokenizer, mixed)
    # The same pieces of text, each as the same id brings it; the unknown ids bring nothing.
    assert [d for d in with_unknown if d] == [d for d in plain if d] and "".join(plain) == text
    assert detok.final_text() == plain_detok.final_text() == text


def test_the_highest_id_with_a_token_is_kept_and_the_one_past_it_dropped(tokenizer):
    top = max(tokenizer.get_vocab().values())
    detok = IncrementalDetokenizer(tokenizer, [], (), skip_special_tokens=False)
    detok.add_tokens([top, top + 1])
    detok.add_token(top + 1)
    assert detok._ids == [top]
    assert detok.final_text() == tokenizer.decode([top], skip_special_tokens=False) != ""


def test_ids_without_a_token_cost_no_decode(tokenizer):
    lead = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
    detok = IncrementalDetokenizer(tokenizer, [], (), fast_path=False)
    detok.add_token(lead)
    assert detok.text == ""  # incomplete: held back, the window stays open
    calls = []
    decode = detok._decode_fn
    detok._decode_fn = lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw)
    for i in _out_of_vocabulary(tokenizer, 200):
        detok.add_token(i)
        assert detok.text == ""
    detok.add_tokens(_out_of_vocabulary(tokenizer, 50))
    assert detok.text == "" and calls == []


@pytest.mark.parametrize("cut", [None, -1])
def test_finishing_after_some_tokens_were_read_gives_the_text_of_reading_each(tokenizer, cut):
    text = " héllo 你好世界 🙂🚀 naïve café"
    ids = tokenizer.encode(text, add_special_tokens=False)[:cut]
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    each, partly = IncrementalDetokenizer(tokenizer, prompt, ()), IncrementalDetokenizer(tokenizer, prompt, ())
    for n, i in enumerate(ids):
        each.add_token(i)
        _ = each.text
        partly.add_token(i)
        if n % 7 == 0:
            _ = partly.text
    each.finish()
    partly.finish()
    assert partly.final_text() == each.final_text()
