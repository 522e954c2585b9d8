"""Streaming token ids to text without re-decoding the whole sequence or splitting a character."""

from __future__ import annotations

from edgeserve.text.tokenizer import Tokenizer

# Tokens of context decoded before the new ones, so that word-initial spaces and merged
# bytes come out as they do in a full decode.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas, one `add` per token.

    Where the tokenizer streams (a byte-level vocabulary's table of token bytes, or Hugging Face
    tokenizers' DecodeStream, which keeps its own state in Rust), each id goes to it: a fraction of
    the time of the window decodes below, which a server pays for every token of every stream.
    Otherwise each step decodes only a short window: the ids since the last emitted text plus a few
    tokens before them for context (the approach of vLLM and TGI). While the window's text ends in
    U+FFFD, a multi-byte character is still incomplete and nothing is emitted. Either way the window
    of ids is kept, so that `flush` can release an incomplete tail at the end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = tokenizer.decode_stream(skip_special_tokens)
        # Window of ids still needed: [0, _read) is decoded context, [_read, end) is pending.
        self._window: list[int] = []
        self._read = 0

    def add(self, token_id: int) -> str:
        """Take one generated id; return the text it completes ("" while a character is split)."""
        self._window.append(token_id)
        if self._stream is None:
            return self._emit(final=False)
        text = self._stream(token_id)
        if text is None:
            return ""
        self._keep_context()
        return text

    def flush(self) -> str:
        """Return whatever is still held back (at the end of a request), even if incomplete."""
        return self._emit(final=True) if self._read < len(self._window) else ""

    def _emit(self, final: bool) -> str:
        context_text = self._decode(self._window[: self._read])
        full_text = self._decode(self._window)
        if len(full_text) <= len(context_text):
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        self._keep_context()
        return full_text[len(context_text) :]

    def _keep_context(self) -> None:
        """Everything so far is emitted: keep the last few ids as the next step's context, drop the older ones."""
        self._window = self._window[-_CONTEXT_TOKENS:]
        self._read = len(self._window)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
