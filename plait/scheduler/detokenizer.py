"""Incremental detokenization and stop-string detection.

Text is produced by decoding a sliding window of tokens and emitting only what grew, so a
multi-byte character split across tokens is emitted once it is complete (a trailing U+FFFD means
"wait for more bytes"). Text that could be the start of a stop string is held back from streaming,
so a client never receives characters that the final, trimmed text does not contain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from plait.sampling.params import SamplingParams

# Prompt tokens kept as left context so the first output token decodes with correct spacing.
_CONTEXT_TOKENS = 5


def decode_function(tokenizer: Any) -> Callable[..., str]:
    """``tokenizer.decode``'s text at the least cost per call (two calls per streamed token).
    Fast tokenizers: ``_decode`` is ``decode`` without its input normalisation (``to_py_obj`` walks
    every id with isinstance checks); where it adds no clean-up either (``clean_up_tokenization_spaces``
    off), it is exactly the Rust backend's ``decode``, called here directly, which also skips the
    wrapper's own argument handling. Otherwise ``_decode``, or ``decode`` for other tokenizers."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if getattr(tokenizer, "clean_up_tokenization_spaces", None) is False and callable(getattr(backend, "decode", None)):
        return backend.decode
    return getattr(tokenizer, "_decode", None) or tokenizer.decode


def _decode_stream(tokenizer: Any, decode_fn: Callable[..., str], context: list[int],
                   skip_special_tokens: bool) -> Any:
    """A Rust ``DecodeStream`` in the state ``IncrementalDetokenizer`` starts in (window from the first
    context id, prefix text the context's text, read offset after it), or None where it cannot be:
    the text is not the Rust backend's ``decode`` (``decode_function``), tokenizers has no
    ``DecodeStream``, or the context ends inside a character (the stream would not take it as its
    prefix). Its ``step`` is ``_advance`` for one token in one call (the same two decodes, the same
    rule: fold what grew unless it ends in U+FFFD)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or decode_fn != getattr(backend, "decode", None):
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    if context and stream.step(backend, context) is None:
        return None
    return stream


# What is read once per Rust tokenizer from its whole vocabulary (tens of milliseconds at 150k tokens),
# not per request: by id(backend), the backend held beside its value so that the id stays its own.
_PER_TOKENIZER: dict[tuple[str, int], tuple[Any, Any]] = {}


def _per_tokenizer(what: str, backend: Any, read: Callable[[], Any]) -> Any:
    """``read()``'s value for ``backend``, read once."""
    hit = _PER_TOKENIZER.get((what, id(backend)))
    if hit is None or hit[0] is not backend:
        if len(_PER_TOKENIZER) >= 32:  # a process keeps one or two tokenizers; tests make many
            _PER_TOKENIZER.clear()
        hit = (backend, read())
        _PER_TOKENIZER[(what, id(backend))] = hit
    return hit[1]


def _token_id_bound(backend: Any) -> int:
    """One past the highest id that ``backend`` (a Rust ``tokenizers.Tokenizer``) has a token for."""
    return _per_tokenizer("id bound", backend,
                          lambda: 1 + max(backend.get_vocab(with_added_tokens=True).values(), default=-1))


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's ``bytes_to_unicode``) inverted: character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _byte_table(backend: Any, decode_fn: Callable[..., str]) -> list[bytes | None] | None:
    """id -> the bytes its token stands for, for a Rust tokenizer whose decoder is byte-level alone and
    whose text is ``decode_fn``: there the text of any window of ids is the lossy UTF-8 decoding of
    their bytes joined, so a detokenizer can fold new ids by joining bytes instead of decoding windows
    (two tokenizer calls per read). Added tokens (special or not) get None: their text takes the
    tokenizer. Built once per tokenizer (a walk of its vocabulary), checked against ``decode_fn`` on
    a sample of ids; None where the decoder is another or the check fails."""
    if decode_fn != getattr(backend, "decode", None):  # a wrapper's clean-up: its text is not the bytes'
        return None
    return _per_tokenizer("bytes", backend, lambda: _read_byte_table(backend, decode_fn))


def _read_byte_table(backend: Any, decode_fn: Callable[..., str]) -> list[bytes | None] | None:
    table: list[bytes | None] | None = None
    if type(backend.decoder).__name__ == "ByteLevel":
        chars = _byte_decoder()
        vocab = backend.get_vocab(with_added_tokens=False)
        table = [None] * (1 + max(vocab.values(), default=-1))
        for token, i in vocab.items():
            # The byte-level decoder's rule: a token of alphabet characters is their bytes, any other
            # its own UTF-8.
            try:
                table[i] = bytes(chars[c] for c in token)
            except KeyError:
                table[i] = token.encode()
        for i in backend.get_added_tokens_decoder():
            if i < len(table):
                table[i] = None
        known = [i for i in range(0, len(table), max(1, len(table) // 256)) if table[i] is not None]
        for a, b in zip(known, known[1:] + known[:1], strict=True):
            bytes_ab = table[a] + table[b]  # type: ignore[operator]
            if decode_fn([a, b], skip_special_tokens=True) != bytes_ab.decode("utf-8", "replace"):
                table = None
                break
    return table


def prepare_tokenizer(tokenizer: Any) -> None:
    """Read once what every request's detokenizer takes from ``tokenizer`` (a Rust tokenizer's id bound
    and its ids' bytes: its whole vocabulary walked), where the tokenizer is loaded, so that the first
    request after start does not wait for it. A server's HTTP process builds a detokenizer before it
    sends each request on, so unprepared, the first request of a burst reaches the scheduler that much
    later. ``None`` (no tokenizer loaded) and slow tokenizers: nothing to read."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and getattr(tokenizer, "is_fast", False):
        _token_id_bound(backend)
        _byte_table(backend, decode_function(tokenizer))  # None, unread, where the text is not the bytes'


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...],
                 skip_special_tokens: bool = True, fast_path: bool = True, no_stop_trim: bool = False) -> None:
        """``fast_path`` False: every token through the general path (``_advance``), whose deltas the
        fast path reproduces exactly. ``no_stop_trim``: the text ends after the stop string that ended
        it, not before."""
        self.tokenizer = tokenizer
        self.no_stop_trim = no_stop_trim
        self._decode_fn = decode_function(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._decoded = len(self._ids)  # ids up to here have been folded into ``_text``
        self._text = ""  # decoded output text so far (complete characters only)
        self.sent = 0  # characters of ``text`` already streamed
        self.stopped_at: int | None = None  # index in ``text`` where a stop string begins
        # The one-token fast path (``_step``): a DecodeStream mirroring the offsets above, or None.
        # ``_stream_at``: how many ids it has seen; it follows the general path lazily when that
        # path ran (several tokens at once), being rebuilt from the offsets.
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = (_decode_stream(tokenizer, self._decode_fn, self._ids, skip_special_tokens)
                        if fast_path else None)
        self._stream_ok = self._stream is not None
        self._stream_at = len(self._ids)
        # Ids past the tokenizer's last token (a model's vocabulary padded past its tokenizer's) are
        # dropped by the Rust backend's decode before anything else, so they are never stored: a
        # window of them would add nothing to the text, yet every decode of the window (and the
        # DecodeStream's, which grows while the text does not) would read them again. The test is one
        # integer comparison per token: this runs for every request every step. An id below the bound
        # without a token (a hole in the vocabulary) is kept, which leaves the text the same.
        rust_decode = self._backend is not None and getattr(tokenizer, "is_fast", False) and self._decode_fn in (
            getattr(self._backend, "decode", None), getattr(tokenizer, "_decode", None))
        self._known_below: int | None = _token_id_bound(self._backend) if rust_decode else None
        # The byte path (``_fold_bytes``): each id's bytes where the tokenizer's text is their lossy
        # UTF-8 (byte-level BPE), else None. ``_prefix_valid``: whether the ids of the window's prefix
        # (``_prefix_offset`` to ``_read_offset``) are whole UTF-8 by themselves, None when not known.
        self._bytes = _byte_table(self._backend, self._decode_fn) if fast_path and self._backend is not None else None
        self._prefix_valid: bool | None = None

    @classmethod
    def for_request(cls, tokenizer: Any, prompt_ids: list[int], sp: SamplingParams) -> IncrementalDetokenizer:
        """The detokenizer of a request with sampling parameters ``sp`` (its stop strings and text options)."""
        return cls(tokenizer, prompt_ids, sp.stop, sp.skip_special_tokens, no_stop_trim=sp.no_stop_trim)

    @property
    def uses_byte_path(self) -> bool:
        """Whether new ids fold by their bytes (a byte-level BPE tokenizer: ``_fold_bytes``)."""
        return self._bytes is not None

    @property
    def uses_fast_path(self) -> bool:
        """Whether single new tokens fold through the DecodeStream (False: the general path only)."""
        return self._stream_ok

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> None:
        """O(1): decoding is deferred until text is asked for (stop strings, streaming, the end), so a
        batch of requests nobody reads mid-flight costs no tokenizer calls per step. An id past the
        tokenizer's last token adds nothing to the text and is not kept."""
        if self._known_below is None or token_id < self._known_below:
            self._ids.append(token_id)

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """``add_token`` for each of ``token_ids``."""
        bound = self._known_below
        if bound is not None:
            for t in token_ids:  # almost always one or a few known ids: no list built
                if t >= bound:
                    token_ids = [t for t in token_ids if t < bound]
                    break
        self._ids.extend(token_ids)

    @property
    def text(self) -> str:
        if self._decoded < len(self._ids) and self._bytes is not None and self._fold_bytes():
            return self._text
        if len(self._ids) - self._decoded == 1 and self._stream_ok and self._step():
            return self._text
        if len(self._ids) - self._decoded > 1 and self._advance(len(self._ids)):
            # Deferred tokens caught up in one window (two tokenizer calls, not two per token),
            # unless the window ends inside a character: then token by token, below.
            self._decoded = len(self._ids)
        while self._decoded < len(self._ids):
            self._decoded += 1
            self._advance(self._decoded)
        return self._text

    def _window_bytes(self, start: int, end: int) -> bytes | None:
        """The bytes of ids ``start`` to ``end``; None when one has none in the table (an added token)."""
        table = self._bytes
        assert table is not None
        try:
            return b"".join([table[i] for i in self._ids[start:end]])  # type: ignore[misc]
        except (TypeError, IndexError):  # a None entry, or an id past the table
            return None

    def _fold_bytes(self) -> bool:
        """``_advance`` over every unfolded id at once, by bytes: where the prefix window's bytes are
        whole UTF-8, the window's text is the prefix's text followed by the new ids' bytes decoded, so
        what grew is those bytes' text, and the general path folds exactly that when it decodes
        cleanly and does not end in U+FFFD. False (nothing folded) elsewhere (an added token, a
        character split across reads, invalid bytes): the general path decides."""
        if self._prefix_valid is None:
            prefix = self._window_bytes(self._prefix_offset, self._read_offset)
            self._prefix_valid = prefix is not None and _is_utf8(prefix)
        if not self._prefix_valid:
            return False
        end = len(self._ids)
        new = self._window_bytes(self._read_offset, end)
        if new is None:
            return False
        try:
            grew = new.decode("utf-8")
        except UnicodeDecodeError:
            return False
        if grew.endswith("\ufffd"):
            return False
        if grew:
            self._text += grew
            self._prefix_offset, self._read_offset = self._read_offset, end
            self._prefix_valid = True  # the new prefix window is ``new``, which decoded whole
        self._decoded = end
        return True

    def _step(self) -> bool:
        """Fold the one new id through the DecodeStream (one Rust call, not two decodes and the
        Python around them); False (nothing folded) where the stream cannot take it, and the general
        path does."""
        end = len(self._ids)
        if self._stream_at != end - 1:
            # The general path moved the offsets: the stream restarts from them, as its window
            # start, prefix, read offset, and the ids after the read offset (which did not fold).
            stream = _decode_stream(self.tokenizer, self._decode_fn,
                                    self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
            # The pending ids did not fold on the general path, so they fold on the stream neither.
            if stream is None or any(stream.step(self._backend, tid) is not None
                                     for tid in self._ids[self._read_offset : end - 1]):
                self._stream_ok = False
                return False
            self._stream = stream
        try:
            chunk = self._stream.step(self._backend, self._ids[-1])
        except Exception:  # the new text does not extend the prefix: the general path decides
            self._stream_ok = False
            return False
        self._stream_at = end
        self._decoded = end
        if chunk is not None:
            self._text += chunk
            self._prefix_offset = self._read_offset
            self._read_offset = end
            self._prefix_valid = None
        return True

    def _advance(self, end: int) -> bool:
        """Fold ids up to ``end`` into the text if they end on a complete character; the window
        starts at ``_prefix_offset`` so the first new token decodes with its left context."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset : end])
        if new_text.endswith("\ufffd"):
            return False
        if len(new_text) > len(prefix_text):
            self._text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = end
            self._prefix_valid = None
        return True

    def find_stop(self) -> bool:
        """True (and ``stopped_at`` set) when the text contains a stop string."""
        if not self.stop or self.stopped_at is not None:
            return self.stopped_at is not None
        window_start = max(0, self.sent - max(len(s) for s in self.stop))
        text = self.text
        hits = [i for s in self.stop if (i := text.find(s, window_start)) >= 0]
        if hits:
            self.stopped_at = min(hits)
        return self.stopped_at is not None

    def matched_stop(self) -> str | None:
        """The stop string that ended the text (the first in ``stop`` order at ``stopped_at``)."""
        if self.stopped_at is None:
            return None
        return next((s for s in self.stop if self.text.startswith(s, self.stopped_at)), None)

    def finish(self) -> None:
        """Flush: decode every id not yet folded, incomplete trailing bytes too (with replacement
        characters), in one window. Catching them up through ``text`` first would go token by token
        wherever the window ends inside a character, each step decoding the whole unfolded run: quadratic
        in an output whose text keeps ending inside a character (a lone byte followed by ids that decode
        to nothing), tens of milliseconds at a thousand tokens, on the scheduler's path."""
        if self.stopped_at is not None:
            return  # the text ends at the stop string, which find_stop decoded up to
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            tail = self._decode(self._ids[self._prefix_offset :])
            self._text += tail[len(prefix_text) :]
            self._read_offset = self._decoded = len(self._ids)
            self._prefix_valid = None

    def _end(self) -> int | None:
        """Where the output text ends: None (not stopped: all of it), at the stop string, or after it."""
        if self.stopped_at is None or not self.no_stop_trim:
            return self.stopped_at
        matched = self.matched_stop()
        return self.stopped_at + (len(matched) if matched is not None else 0)

    def final_text(self) -> str:
        end = self._end()
        return self.text if end is None else self.text[:end]

    def take_delta(self, finished: bool) -> str:
        """New text for a streaming client. While running, hold back a suffix that could begin a
        stop string; when finished, everything up to the (trimmed) end."""
        text = self.text  # decodes what waits, once
        stop_end = self._end()
        end = len(text) if stop_end is None else min(len(text), stop_end)
        if not finished and self.stop:
            end = min(end, len(text) - self._stop_prefix_overlap())
        if end <= self.sent:
            return ""
        delta = text[self.sent : end]
        self.sent = end
        return delta

    def _stop_prefix_overlap(self) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
