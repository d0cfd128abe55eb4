"""Incremental detokenization that never emits half of a multi-byte character."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

NUM_CONTEXT_TOKENS = 5  # prompt tokens decoded along, so leading-space rules see real context


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    Decodes a small window [prefix_offset, end) and emits what it adds over [prefix_offset,
    read_offset); a window ending in U+FFFD is an incomplete UTF-8 sequence and waits for more.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-NUM_CONTEXT_TOKENS:])
        # the context must start on a character boundary: byte-fallback tokenizers decode a
        # window that starts inside a character to U+FFFD, which would poison every later delta
        start = 0
        while start < len(self._ids) and "\ufffd" in self._decode(self._ids[start:]):
            start += 1
        del self._ids[:start]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Appends one token; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held back at the end of generation (e.g. a truncated character)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)
