"""The bench shapes' directories: a config of the named shape and a tokenizer covering its vocabulary."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from plait.bench.shapes import SHAPES, write_shape_dir


def test_every_id_a_shape_can_sample_decodes_to_text(tmp_path):
    shape = "qwen3-0.6b"
    tok = AutoTokenizer.from_pretrained(write_shape_dir(tmp_path, shape))
    vocab = SHAPES[shape]["vocab_size"]
    assert len(tok) == vocab
    rng = random.Random(0)
    for i in [500, vocab - 1, *(rng.randrange(500, vocab) for _ in range(200))]:
        text = tok.decode([i])
        assert text.startswith(" ") and text[1:].isalpha(), (i, text)


def test_the_covering_vocabulary_keeps_the_tiny_tokenizers_encoding(tmp_path, tiny_model_dir):
    covering = AutoTokenizer.from_pretrained(write_shape_dir(tmp_path, "llama-3.2-1b"))
    tiny = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    text = "Hello world, héllo 你好 🙂 and more words."
    assert covering.encode(text, add_special_tokens=False) == tiny.encode(text, add_special_tokens=False)
    assert covering.decode(covering.encode(text, add_special_tokens=False)) == text

