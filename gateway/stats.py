"""Per-request speculation statistics, reported in the final Generate chunk and OpenAI `usage`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdec.v1 import gateway_pb2


@dataclass
class RequestStats:
    num_prompt_tokens: int
    request_id: str = ""
    received_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_verified_tokens: int = 0  # tokens committed by verify steps
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: steps that accepted draft i
    num_steps_by_k: list[int] = field(default_factory=list)  # [k]: verify steps that proposed k drafts
    draft_forward_ns: int = 0
    target_forward_ns: int = 0
    draft_prefill_forward_ns: int = 0  # of draft_forward_ns
    target_prefill_forward_ns: int = 0  # of target_forward_ns

    def record_step(self, num_committed: int, num_draft_tokens: int, num_accepted: int, is_prefill: bool) -> None:
        now = time.perf_counter()
        self.first_token_s = self.first_token_s or now
        self.last_token_s = now
        if not is_prefill:
            self.num_verify_steps += 1
            self.num_verified_tokens += num_committed
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_tokens += num_accepted
            missing = num_accepted - len(self.num_accepted_tokens_per_pos)
            self.num_accepted_tokens_per_pos += [0] * max(0, missing)
            for position in range(num_accepted):
                self.num_accepted_tokens_per_pos[position] += 1
            self.num_steps_by_k += [0] * max(0, num_draft_tokens + 1 - len(self.num_steps_by_k))
            self.num_steps_by_k[num_draft_tokens] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        return self.num_verified_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def time_to_first_token_s(self) -> float:
        return (self.first_token_s or self.received_s) - self.received_s

    def time_per_output_token_s(self, num_completion_tokens: int) -> float:
        if num_completion_tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return 0.0
        return (self.last_token_s - self.first_token_s) / (num_completion_tokens - 1)

    def tokens_per_s(self, num_completion_tokens: int) -> float:
        elapsed = (self.last_token_s or self.received_s) - self.received_s
        return num_completion_tokens / elapsed if elapsed > 0 else 0.0

    def to_pb(self, num_completion_tokens: int) -> gateway_pb2.GenerationStats:
        return gateway_pb2.GenerationStats(
            num_prompt_tokens=self.num_prompt_tokens,
            num_completion_tokens=num_completion_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            acceptance_rate=self.acceptance_rate,
            num_verify_steps=self.num_verify_steps,
            mean_accepted_len=self.mean_accepted_len,
            time_to_first_token_s=self.time_to_first_token_s,
            tokens_per_s=self.tokens_per_s(num_completion_tokens),
            draft_forward_s=self.draft_forward_ns / 1e9,
            target_forward_s=self.target_forward_ns / 1e9,
            time_per_output_token_s=self.time_per_output_token_s(num_completion_tokens),
            num_accepted_tokens_per_pos=self.num_accepted_tokens_per_pos,
            request_id=self.request_id,
            num_steps_by_k=self.num_steps_by_k,
            draft_prefill_forward_s=self.draft_prefill_forward_ns / 1e9,
            target_prefill_forward_s=self.target_prefill_forward_ns / 1e9,
        )
