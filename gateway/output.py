"""Turns committed tokens into the streamed completion: EOS, max tokens, stop strings, text."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStrings


class Finish(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    text: str
    finish: Finish | None


class CompletionOutput:
    """Consumes committed tokens one at a time, exactly as target-only decoding would stop."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], max_new_tokens: int,
        stop: list[str], eos_token_ids: list[int],
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop = StopStrings(stop)
        self._max_new_tokens = max_new_tokens
        self._eos = set(eos_token_ids)
        self.num_tokens = 0
        self.finish: Finish | None = None

    def add(self, committed_ids: list[int]) -> Chunk:
        """Takes tokens until the completion ends; the rest of `committed_ids` is ignored."""
        assert self.finish is None, "completion already finished"
        token_ids, text = [], ""
        for token_id in committed_ids:
            if token_id in self._eos:
                self.finish = Finish.EOS
                break
            self.num_tokens += 1
            token_ids.append(token_id)
            check = self._stop.feed(self._detokenizer.add(token_id))
            text += check.text
            if check.is_stopped:
                self.finish = Finish.STOP
                break
            if self.num_tokens == self._max_new_tokens:
                self.finish = Finish.LENGTH
                break
        if self.finish in (Finish.EOS, Finish.LENGTH):
            # the detokenizer's held-back bytes (a character cut short) may complete a stop string only now
            check = self._stop.feed(self._detokenizer.flush())
            text += check.text + self._stop.flush()
            if check.is_stopped:
                self.finish = Finish.STOP
        return Chunk(token_ids, text, self.finish)
