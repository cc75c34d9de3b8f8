"""The detokenizer's fast paths (new ids folded by their bytes for byte-level BPE tokenizers, one new
id through a Rust DecodeStream) stream exactly the deltas of the general path: multi-byte characters
split across tokens, stop strings held back and trimmed, several tokens read at once
(stream_interval > 1), and the general path taking over mid-stream."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from plait.models.loader import load_tokenizer
from plait.scheduler.detokenizer import IncrementalDetokenizer

TEXT = "Café au lait, crème brûlée 🍰 and 日本語のテキスト, 🇫🇷 naïve\n\t  ok."


def stream(tokenizer, prompt, ids, stop=(), interval=1, fast=True):
    """Deltas as the scheduler reads them: every ``interval`` tokens, then the finishing delta."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop, fast_path=fast)
    deltas = []
    for i, token in enumerate(ids):
        detok.add_token(token)
        if stop and detok.find_stop():
            break
        if (i + 1) % interval == 0:
            deltas.append(detok.take_delta(finished=False))
    detok.finish()
    deltas.append(detok.take_delta(finished=True))
    return deltas, detok.final_text(), detok.matched_stop()


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request, tiny_model_dir, real_model_dir):
    return load_tokenizer(str(tiny_model_dir("llama") if request.param == "tiny" else real_model_dir))


def test_the_fast_path_is_taken_for_a_rust_backed_tokenizer(tokenizer):
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    assert IncrementalDetokenizer(tokenizer, prompt, ()).uses_fast_path
    assert not IncrementalDetokenizer(tokenizer, prompt, (), fast_path=False).uses_fast_path


def test_byte_level_tokenizers_fold_new_ids_by_their_bytes(tokenizer):
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    assert IncrementalDetokenizer(tokenizer, prompt, ()).uses_byte_path
    assert not IncrementalDetokenizer(tokenizer, prompt, (), fast_path=False).uses_byte_path


def test_plain_text_read_every_few_tokens_costs_no_tokenizer_call(tokenizer):
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(" The quick brown fox jumps over the lazy dog, twice.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, ())
    calls = []
    decode = detok._decode_fn
    detok._decode_fn = lambda window, **kw: calls.append(len(window)) or decode(window, **kw)
    deltas = []
    for n, i in enumerate(ids):
        detok.add_token(i)
        if n % 4 == 3:
            deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    assert "".join(deltas) == tokenizer.decode(ids) and calls == []


def test_a_tokenizer_whose_decoder_is_not_byte_level_folds_by_decoding():
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    detok = IncrementalDetokenizer(wordpiece, [1], ())
    assert not detok.uses_byte_path
    detok.add_tokens([2, 3, 1])
    assert detok.take_delta(finished=True) == wordpiece.decode([1, 2, 3, 1])[len("hello"):]


@pytest.mark.parametrize("interval", [1, 2, 3, 4])
def test_multibyte_text_streams_the_same_deltas_as_the_general_path(tokenizer, interval):
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    fast = stream(tokenizer, prompt, ids, interval=interval)
    assert fast == stream(tokenizer, prompt, ids, interval=interval, fast=False)
    assert "".join(fast[0]) == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]


@pytest.mark.parametrize("stop", [("🍰",), ("lait", "ex"), ("\n\t",)])
def test_stop_strings_stream_the_same_deltas_as_the_general_path(tokenizer, stop):
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    fast = stream(tokenizer, prompt, ids, stop=stop)
    assert fast == stream(tokenizer, prompt, ids, stop=stop, fast=False)
    assert fast[2] == stop[0] and stop[0] not in "".join(fast[0])


def test_random_token_streams_give_the_same_deltas_as_the_general_path(tokenizer):
    # Random ids: byte tokens that never complete a character, special tokens, empty decodes, a
    # prompt ending inside a character; with the read interval changing mid-stream.
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(60):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 7))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        stop = rng.choice([(), ("a",), ("e ", "th")])
        interval = rng.choice([1, 1, 2, 3])
        assert stream(tokenizer, prompt, ids, stop, interval) == stream(tokenizer, prompt, ids, stop, interval, False)
