"""Per-request speculation statistics, reported in the final Generate chunk."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdec.v1 import gateway_pb2


@dataclass
class RequestStats:
    num_prompt_tokens: int
    received_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_verified_tokens: int = 0  # tokens committed by verify steps

    def record_step(self, num_committed: int, num_draft_tokens: int, num_accepted: int, is_prefill: bool) -> None:
        now = time.perf_counter()
        self.first_token_s = self.first_token_s or now
        self.last_token_s = now
        if not is_prefill:
            self.num_verify_steps += 1
            self.num_verified_tokens += num_committed
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_tokens += num_accepted

    def to_pb(self, num_completion_tokens: int) -> gateway_pb2.GenerationStats:
        elapsed = (self.last_token_s or self.received_s) - self.received_s
        return gateway_pb2.GenerationStats(
            num_prompt_tokens=self.num_prompt_tokens,
            num_completion_tokens=num_completion_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            acceptance_rate=self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            num_verify_steps=self.num_verify_steps,
            mean_accepted_len=self.num_verified_tokens / self.num_verify_steps if self.num_verify_steps else 0.0,
            time_to_first_token_s=(self.first_token_s or self.received_s) - self.received_s,
            tokens_per_s=num_completion_tokens / elapsed if elapsed > 0 else 0.0,
        )
