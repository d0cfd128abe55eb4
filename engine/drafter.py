"""The drafter interface the draft service serves, and the per-request draft bookkeeping."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv_cache import SequenceKV
from engine.model_runner import ModelDescription
from engine.sampling import Distribution, SamplingParams
from specdec.errors import InvalidRequestError


@dataclass
class DraftSequence:
    """One request's tokens as the drafter sees them: committed tokens, then its open proposal."""

    token_ids: list[int]
    max_len: int  # prompt + max_new_tokens: reconcile refuses a proposal past it
    num_proposed: int = 0  # trailing entries of token_ids that are unverified proposals
    kv: SequenceKV | None = None  # model drafters only
    num_promised_blocks: int = 0  # what KV admission promised (model drafters only)
    sampling: SamplingParams = SamplingParams()  # greedy unless the request samples
    proposal_probs: list[Distribution] = field(default_factory=list)  # what the open proposal was drawn from
    ahead: asyncio.Future | None = None  # draft-ahead (engine/model_drafter.py): the open proposal continued
    prefill_forward_ns: int = 0  # the forward time of the prompt's prefill at start (model drafters only)

    def may_use_ahead(self, num_accepted: int, num_draft_tokens: int) -> bool:
        """Whether a propose with these arguments can be answered from the draft-ahead chain: only
        after all of the open proposal was accepted, asking the same k again."""
        return self.ahead is not None and num_accepted == self.num_proposed == num_draft_tokens

    def reconcile(self, num_accepted: int, append_ids: list[int], num_draft_tokens: int) -> int:
        """Keeps the first `num_accepted` proposed tokens, drops the rest, appends `append_ids`, ahead
        of proposing `num_draft_tokens` more. Every check comes before anything changes; the sequence
        ends at max_len (prompt + max_new_tokens), as the target's does: a model drafter's promised KV
        and its model's positions end there, and an n-gram drafter's lookups scan it all.

        Returns how many leading tokens are unchanged (a KV cache stays valid up to there).
        """
        if not 0 <= num_accepted <= self.num_proposed:
            raise InvalidRequestError(
                f"num_accepted_draft_tokens={num_accepted} but the last proposal had {self.num_proposed} tokens"
            )
        if not append_ids:
            raise InvalidRequestError("append_ids is empty; send the committed token(s) after the accepted ones")
        num_kept = len(self.token_ids) - self.num_proposed + num_accepted
        committed = num_kept + len(append_ids)
        if committed + num_draft_tokens > self.max_len:
            raise InvalidRequestError(
                f"proposing {num_draft_tokens} tokens after {committed} committed would pass the sequence's "
                f"limit of {self.max_len} tokens (prompt + max_new_tokens)"
            )
        del self.token_ids[num_kept:]
        self.token_ids += append_ids
        self.num_proposed = 0
        return num_kept


@dataclass(frozen=True)
class ProposeTiming:
    forward_ns: int


class Drafter(Protocol):
    description: ModelDescription

    async def start(self, prompt_ids: list[int], max_new_tokens: int,
                    sampling: SamplingParams = SamplingParams()) -> DraftSequence: ...

    async def propose(
        self, seq: DraftSequence, num_accepted: int, append_ids: list[int], num_draft_tokens: int
    ) -> tuple[list[int], ProposeTiming]:
        """Also sets seq.proposal_probs: for sampled sequences, the distribution of each proposed token."""

    def release(self, seq: DraftSequence) -> None: ...

    def start_background(self) -> None: ...

    async def stop(self) -> None: ...

    def stats(self) -> dict[str, int]: ...


def check_propose(num_draft_tokens: int, max_draft_tokens: int) -> None:
    if not 1 <= num_draft_tokens <= max_draft_tokens:
        raise InvalidRequestError(f"num_draft_tokens must be in [1, {max_draft_tokens}], got {num_draft_tokens}")
