"""What a benchmark adds up per configuration: wall time and the final stats of its Generate calls."""
from __future__ import annotations

import time
from collections import defaultdict

from specdec.client import Completion, stream
from specdec.v1 import gateway_pb2


class Totals:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.counts: dict[str, float] = defaultdict(float)

    def tok_s(self) -> float:
        return self.counts["tokens"] / self.seconds if self.seconds else 0.0

    def decode_tok_s(self) -> float:
        """Tokens after each request's first over the time after it (the gateway's time to first token
        taken off): the phase where k matters, without the prefill's spread."""
        seconds = self.seconds - self.counts["ttft_s"]
        return (self.counts["tokens"] - self.counts["requests"]) / seconds if seconds > 0 else 0.0

    def ratio(self, num: str, den: str) -> float:
        return self.counts[num] / self.counts[den] if self.counts[den] else 0.0

    def add(self, stats: gateway_pb2.GenerationStats) -> None:
        self.counts["requests"] += 1
        self.counts["tokens"] += stats.num_completion_tokens
        self.counts["ttft_s"] += stats.time_to_first_token_s
        self.counts["drafted"] += stats.num_draft_tokens
        self.counts["accepted"] += stats.num_accepted_tokens
        self.counts["steps"] += stats.num_verify_steps
        self.counts["verified"] += round(stats.mean_accepted_len * stats.num_verify_steps)
        self.counts["draft_s"] += stats.draft_forward_s
        self.counts["target_s"] += stats.target_forward_s


def timed_generate(address: str, request: gateway_pb2.GenerateRequest, totals: Totals) -> Completion:
    """One Generate through the gateway at `address`, its wall time and final stats added to `totals`."""
    start = time.perf_counter()
    completion = stream(address, request)
    totals.seconds += time.perf_counter() - start
    totals.add(completion.final.stats)
    return completion
