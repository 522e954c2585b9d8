"""Streaming token ids to text without re-decoding the whole sequence or splitting a character."""

from __future__ import annotations

from edgeserve.text.tokenizer import Tokenizer

# Tokens of context decoded before the new ones, so that word-initial spaces and merged
# bytes come out as they do in a full decode.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas, one `add` per token.

    Each step decodes only a short window: the ids since the last emitted text plus a few
    tokens before them for context (the approach of vLLM and TGI). While the window's text ends
    in U+FFFD, a multi-byte character is still incomplete and nothing is emitted.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Window of ids still needed: [0, _read) is decoded context, [_read, end) is pending.
        self._window: list[int] = []
        self._read = 0

    def add(self, token_id: int) -> str:
        """Take one generated id; return the text it completes ("" while a character is split)."""
        self._window.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (at the end of a request), even if incomplete."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        context_text = self._decode(self._window[: self._read])
        full_text = self._decode(self._window)
        if len(full_text) <= len(context_text):
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        # Keep the last few emitted ids as context for the next step, drop everything older.
        keep_from = max(len(self._window) - _CONTEXT_TOKENS, 0)
        self._window = self._window[keep_from:]
        self._read = len(self._window)
        return full_text[len(context_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
