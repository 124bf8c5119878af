"""Incremental detokenisation and stop strings, for one completion.

Decoding a whole output after every token is quadratic, and decoding single
tokens breaks multi-byte characters and leading spaces. We keep two offsets
into the token list: text is decoded from `prefix_offset` (a few tokens of
context) and only the part after `read_offset` is new. A decode that ends in
U+FFFD is an unfinished UTF-8 sequence: wait for the next token.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], *,
                 skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False) -> None:
        self._decode_fn = _decoder(tokenizer, skip_special_tokens)
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        # Streaming holds back this many chars: they may start a stop string.
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""
        self._sent = 0  # chars of output_text already returned by delta_text
        self.num_stop_tokens = 0  # tokens of the last update up to a stop string

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string that ended the text, if any (then
        `num_stop_tokens` of them made it: a speculative engine may send several)."""
        start = len(self.output_text)
        for i, token_id in enumerate(new_token_ids):
            self._ids.append(token_id)
            self.output_text += self._next_text()
            stopped = self._check_stop(start)
            if stopped is not None:
                self.num_stop_tokens = i + 1
                return stopped
        return None

    def _next_text(self) -> str:
        prefix = self._decode_fn(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode_fn(self._ids[self._prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if len(self._ids) > 4 * _CONTEXT_TOKENS:  # keep the window small
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset, self._read_offset = 0, self._read_offset - drop
        return full[len(prefix):]

    def _check_stop(self, start: int) -> str | None:
        if not self.stop:
            return None
        for s in self.stop:
            idx = self.output_text.find(s, max(0, start - len(s) + 1))
            if idx >= 0:
                end = idx + len(s) if self.include_stop_str_in_output else idx
                self.output_text = self.output_text[:end]
                return s
        return None

    def delta_text(self, finished: bool) -> str:
        """Text not yet returned; while running, keep back a possible stop-string start."""
        end = len(self.output_text) if finished or not self.stop else max(
            self._sent, len(self.output_text) - self.hold_back)
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta


def _decoder(tokenizer: Any, skip_special_tokens: bool):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: much less overhead per call
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
