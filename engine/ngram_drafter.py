"""Prompt-lookup (n-gram) drafting: propose what followed the latest earlier occurrence of the
sequence's last n tokens. Needs no weights and works with any tokenizer."""
from __future__ import annotations

from engine.drafter import DraftSequence, ProposeTiming, check_propose
from engine.limits import check_new_sequence
from engine.model_runner import ModelDescription
from engine.sampling import SamplingParams


def ngram_lookup(token_ids: list[int], num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Tokens that followed the most recent earlier match of the longest matching suffix n-gram."""
    for n in range(min(max_ngram, len(token_ids) - 1), min_ngram - 1, -1):
        pattern = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):  # latest match first, not the suffix itself
            if token_ids[start:start + n] == pattern:
                follow = token_ids[start + n:start + n + num_draft_tokens]
                if follow:
                    return follow
    return []


class NgramDrafter:
    def __init__(self, max_model_len: int = 1 << 20, max_draft_tokens: int = 16, max_ngram: int = 3) -> None:
        self.description = ModelDescription(
            model_id="ngram", architecture="ngram", vocab_size=0, tokenizer_fingerprint="",
            max_model_len=max_model_len, eos_token_ids=[],
        )
        self._max_draft_tokens = max_draft_tokens
        self._max_ngram = max_ngram
        self._num_active = 0
        self._num_started = 0

    async def start(self, prompt_ids: list[int], max_new_tokens: int,
                    sampling: SamplingParams = SamplingParams()) -> DraftSequence:
        check_new_sequence(prompt_ids, max_new_tokens, self.description.max_model_len)
        self._num_active += 1
        self._num_started += 1
        return DraftSequence(list(prompt_ids), sampling=sampling, max_len=len(prompt_ids) + max_new_tokens)

    async def propose(
        self, seq: DraftSequence, num_accepted: int, append_ids: list[int], num_draft_tokens: int
    ) -> tuple[list[int], ProposeTiming]:
        check_propose(num_draft_tokens, self._max_draft_tokens)
        seq.reconcile(num_accepted, append_ids, num_draft_tokens)
        draft_ids = ngram_lookup(seq.token_ids, num_draft_tokens, self._max_ngram)
        seq.token_ids += draft_ids
        seq.num_proposed = len(draft_ids)
        # a lookup is deterministic: each token was "drawn" from a point mass on itself
        seq.proposal_probs = [] if seq.sampling.is_greedy else [([t], [1.0]) for t in draft_ids]
        return draft_ids, ProposeTiming(forward_ns=0)

    def release(self, seq: DraftSequence) -> None:
        self._num_active -= 1

    def start_background(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"num_active_sequences": self._num_active, "num_sequences_started": self._num_started}
