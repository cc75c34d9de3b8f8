"""The detokenizer's decode call: the Rust backend's own where the tokenizer adds no clean-up,
with the same streamed text as ``tokenizer.decode``."""

from __future__ import annotations

import pytest

from plait.models.loader import load_tokenizer
from plait.scheduler import detokenizer
from plait.scheduler.detokenizer import IncrementalDetokenizer, decode_function, prepare_tokenizer

TEXT = "Café au lait, crème brûlée 🍰 and 日本語のテキスト, \t tabs\nand  spaces."


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_streamed_text_equals_the_tokenizers_decode_of_the_whole_output(which, tiny_model_dir, real_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir("llama") if which == "tiny" else real_model_dir))
    assert decode_function(tokenizer) == tokenizer._tokenizer.decode  # clean-up is off for both
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, ())
    deltas = []
    for i in ids:
        detok.add_token(i)
        deltas.append(detok.take_delta(finished=False))
    detok.finish()
    deltas.append(detok.take_delta(finished=True))
    assert "".join(deltas) == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]
    assert "\U0001f370" in "".join(deltas)  # the multi-byte character came out whole


def test_a_tokenizer_that_cleans_up_spaces_keeps_the_wrapper_that_does(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir("llama")))
    tokenizer.clean_up_tokenization_spaces = True
    assert decode_function(tokenizer) == tokenizer._decode


def test_prepare_tokenizer_reads_the_id_bound_before_any_request(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir("llama")))
    detokenizer._PER_TOKENIZER.clear()
    prepare_tokenizer(tokenizer)
    backend = tokenizer._tokenizer
    key = ("id bound", id(backend))
    assert detokenizer._PER_TOKENIZER[key] == (backend, len(tokenizer))
    # A request's detokenizer then reuses the bound (the same cached entry, not a second walk).
    entry = detokenizer._PER_TOKENIZER[key]
    IncrementalDetokenizer(tokenizer, [1, 2], ())
    assert detokenizer._PER_TOKENIZER[key] is entry


def test_an_engine_core_prepares_the_tokenizer_it_loads(tiny_model_dir):
    from plait.config import EngineConfig
    from plait.engine.core import build_engine_core

    detokenizer._PER_TOKENIZER.clear()
    core = build_engine_core(EngineConfig(model=str(tiny_model_dir("llama")), device="cpu", max_total_tokens=256))
    try:
        assert ("id bound", id(core.tokenizer._tokenizer)) in detokenizer._PER_TOKENIZER
    finally:
        core.close()


def test_prepare_tokenizer_without_a_tokenizer_does_nothing():
    before = dict(detokenizer._PER_TOKENIZER)
    prepare_tokenizer(None)
    assert detokenizer._PER_TOKENIZER == before
