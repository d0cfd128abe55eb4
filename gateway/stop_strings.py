"""Stop strings over streamed text: text that might begin a stop string is held back."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # safe to emit now
    is_stopped: bool  # a stop string was found; `text` ends right before it


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, delta: str) -> StopCheck:
        """Adds newly decoded text; returns what can be emitted."""
        self._held += delta
        found = [i for i in (self._held.find(s) for s in self._stops) if i >= 0]
        if found:
            text, self._held = self._held[: min(found)], ""
            return StopCheck(text, is_stopped=True)
        keep = self._longest_partial_match()
        text = self._held[: len(self._held) - keep]
        self._held = self._held[len(text):]
        return StopCheck(text, is_stopped=False)

    def flush(self) -> str:
        """At the end of generation, what was held back is text after all."""
        text, self._held = self._held, ""
        return text

    def _longest_partial_match(self) -> int:
        # length of the longest suffix of the held text that is a proper prefix of a stop string
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._held)), best, -1):
                if self._held.endswith(stop[:n]):
                    best = n
                    break
        return best
