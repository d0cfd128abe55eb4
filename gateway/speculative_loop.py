"""The speculative decoding loop of one request: propose -> verify -> commit/rollback.

  draft proposes k tokens after the committed ones (greedy, from its own KV cache);
  target runs all k + 1 positions in one forward and commits the accepted prefix plus one token
  of its own (recovered at the first mismatch, bonus if all matched) - exactly its greedy output;
  draft is told how many of its tokens survived and rolls its KV cache back to them.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.backends import DraftStream, TargetStream


@dataclass(frozen=True)
class Step:
    committed_ids: list[int]
    num_draft_tokens: int  # proposed in this step (0 for the prefill step)
    num_accepted: int


async def speculative_generate(
    prompt_ids: list[int],
    max_new_tokens: int,
    num_draft_tokens: int,
    target: TargetStream,
    draft: DraftStream | None,
) -> AsyncIterator[Step]:
    """Yields the committed tokens step by step; the caller stops iterating when it is done."""
    if draft is None:
        first = await target.prefill(prompt_ids, max_new_tokens)
    else:  # prefill both models at once
        first, _ = await asyncio.gather(target.prefill(prompt_ids, max_new_tokens),
                                        draft.start(prompt_ids, max_new_tokens))
    yield Step([first], 0, 0)
    num_generated = 1
    # what the draft has not heard yet: how much of its last proposal survived, tokens to append
    num_accepted, append_ids = 0, [first]
    while num_generated < max_new_tokens:
        # a verify commits up to k + 1 tokens; never run past max_new_tokens
        k = min(num_draft_tokens, max_new_tokens - num_generated - 1) if draft else 0
        draft_ids = await draft.propose(num_accepted, append_ids, k) if k > 0 else []
        verified = await target.verify(draft_ids)
        if k > 0:
            num_accepted, append_ids = verified.num_accepted, verified.committed_ids[-1:]
        else:
            append_ids = append_ids + verified.committed_ids
        num_generated += len(verified.committed_ids)
        yield Step(verified.committed_ids, len(draft_ids), verified.num_accepted)
