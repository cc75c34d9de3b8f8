"""A tiny gpt-oss checkpoint whose tokenizer has the harmony format's special tokens, as
gpt-oss's own (o200k_harmony) has them, and whose generation config stops where gpt-oss's does:
at ``<|return|>`` (the final answer), ``<|call|>`` (a tool call) and ``<|endoftext|>``.

The tiny tokenizer's vocabulary leaves padding ids below the model's ``vocab_size``; the markers
take the first of them (their lm_head rows are the quiet padding rows, so a random model writes
them only when pushed, e.g. with ``logit_bias`` under a grammar that spells them out)."""

from __future__ import annotations

import json
import os
import pathlib

from plait.models.tiny import EOS_TOKEN, make_tiny_model

# The harmony markers of gpt-oss's tokenizer (<|endoftext|> is the tiny tokenizer's EOS already).
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
HARMONY_STOP_TOKENS = ("<|return|>", EOS_TOKEN, "<|call|>")


def make_tiny_harmony_model(path: str | os.PathLike[str], seed: int = 0) -> pathlib.Path:
    """Write the tiny gpt-oss checkpoint to ``path`` with the harmony tokens added; return the path."""
    from transformers import AutoTokenizer

    out = make_tiny_model(path, "gpt-oss", seed)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(list(HARMONY_TOKENS), special_tokens=True)
    vocab_size = json.loads((out / "config.json").read_text())["vocab_size"]
    if len(tok) > vocab_size:
        raise ValueError(f"the harmony tokens do not fit below vocab_size {vocab_size}")
    tok.save_pretrained(out, save_jinja_files=False)
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [tok.convert_tokens_to_ids(t) for t in HARMONY_STOP_TOKENS]
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")
    return out
