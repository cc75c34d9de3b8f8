"""Logprobs in OpenAI's two shapes (chat: ``content`` entries with bytes; completions: parallel
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` lists), and the name each
token shows there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class PieceTokenizer(Protocol):
    """What naming a token needs of a (Hugging Face) tokenizer."""

    def decode(self, token_ids: list[int]) -> str: ...

    def convert_ids_to_tokens(self, ids: int) -> object: ...  # a str for a known id


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (bytes <-> printable characters in BPE pieces)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


def token_piece(tokenizer: PieceTokenizer, tid: int) -> tuple[str, bytes]:
    """One token as logprobs show it: (name, raw bytes). The name is its text, or, for a piece of a
    multi-byte character (which decodes to U+FFFD on its own), OpenAI's ``bytes:\\xNN`` form of its
    raw bytes, so that different partial tokens never share a name."""
    text = tokenizer.decode([tid])
    if "\ufffd" not in text:
        return text, text.encode()
    piece = tokenizer.convert_ids_to_tokens(tid)
    if not isinstance(piece, str):
        return text, text.encode()
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # sentencepiece byte fallback
        raw = bytes([int(piece[3:5], 16)])
    elif piece and all(ch in _BYTE_DECODER for ch in piece):  # byte-level BPE
        raw = bytes(_BYTE_DECODER[ch] for ch in piece)
    else:
        return text, text.encode()
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


TopPairs = Sequence[tuple[int, float]]  # one token's best (token id, logprob), best first
TopLogprobs = Sequence[TopPairs]  # per token


class LogprobsRenderer:
    """Renders the logprobs of generated tokens; each token's name is computed once per server."""

    def __init__(self, tokenizer: PieceTokenizer) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, tuple[str, bytes]] = {}

    def _piece(self, tid: int) -> tuple[str, bytes]:
        piece = self._pieces.get(tid)
        if piece is None:
            piece = self._pieces[tid] = token_piece(self.tokenizer, tid)
        return piece

    def _chat_entry(self, tid: int, lp: float) -> dict[str, Any]:
        name, raw = self._piece(tid)
        return {"token": name, "logprob": lp, "bytes": list(raw)}

    def chat(self, ids: Sequence[int], lps: Sequence[float], tops: TopLogprobs) -> dict[str, Any]:
        content = []
        for k, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
            top = [self._chat_entry(t, v) for t, v in (tops[k] if k < len(tops) else [])]
            content.append({**self._chat_entry(tid, lp), "top_logprobs": top})
        return {"content": content}

    def completion(self, ids: Sequence[int], lps: Sequence[float | None], tops: Sequence[TopPairs | None],
                   with_top: bool, text_offset: int) -> tuple[dict[str, Any], int]:
        """The completions shape, whose ``text_offset`` runs on from ``text_offset`` (the characters
        of the choice's earlier token names); returns it with the offset after these tokens. An echoed
        prompt's first token has no logprob: None there, and None as its top_logprobs."""
        tokens, offsets = [], []
        top_dicts: list[dict[str, float] | None] = []
        for k, tid in enumerate(ids):
            s = self._piece(tid)[0]
            tokens.append(s)
            offsets.append(text_offset)
            text_offset += len(s)
            if with_top:
                top = tops[k] if k < len(tops) else []
                top_dicts.append(None if top is None else {self._piece(t)[0]: v for t, v in top})
        body = {"tokens": tokens, "token_logprobs": list(lps[: len(ids)]),
                "top_logprobs": top_dicts if with_top else None, "text_offset": offsets}
        return body, text_offset
