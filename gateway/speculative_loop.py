"""The speculative decoding loop of one request: propose -> verify -> commit/rollback.

  draft proposes k tokens after the committed ones (from its own KV cache; k from the request, or
    per step from gateway/speculation_policy.py; while k = 0 the draft is not asked at all, and
    its sequence is opened by the first step that drafts: gateway/lazy_draft.py; else in the background once
    the first token is in, or beside the target's prefill);
  target runs all k + 1 positions in one forward and commits the accepted prefix plus one token
  of its own (recovered at the first mismatch, bonus if all matched) - exactly its greedy output,
    or for sampled requests a rejection-sampling verify that keeps its distribution (engine/sampling.py);
  draft is told how many of its tokens survived and rolls its KV cache back to them.

Faults: a lost draft ends speculation for the request, which decodes on target-only (k = 0). A
lost target replica is replaced: a new target stream (another replica) and a new draft sequence
(when a step drafts) are prefilled with everything committed so far, and the target's prefill
token is the next token - exactly what the lost replica's next verify would have committed first.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from engine.sampling import SamplingParams
from gateway.backends import Proposal, RequestStreams, TargetLost, TargetStream
from gateway.lazy_draft import LazyDraft
from gateway.speculation_policy import SpeculationPolicy
from specdec.errors import ServiceUnavailableError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    committed_ids: list[int]
    num_draft_tokens: int  # proposed in this step (0 for the prefill step)
    num_accepted: int


async def speculative_generate(
    prompt_ids: list[int],
    max_new_tokens: int,
    num_draft_tokens: int,
    streams: RequestStreams,
    max_target_retries: int = 2,
    sampling: SamplingParams = SamplingParams(),
    policy: SpeculationPolicy | None = None,
) -> AsyncIterator[Step]:
    """Yields the committed tokens step by step; the caller stops iterating when it is done.

    After a lost target replica the committed tokens are re-prefilled elsewhere, at most
    `max_target_retries` times; then ServiceUnavailableError (the tokens yielded so far stay valid).
    `policy` chooses k per step (at most `num_draft_tokens`); None: k = `num_draft_tokens` always.
    """
    generated: list[int] = []
    lost: TargetLost | None = None
    for _ in range(max_target_retries + 1):
        if not await streams.wait_for_target():
            raise ServiceUnavailableError(
                f"no target replica is reachable ({lost or 'none connected'}){_kept(generated)}")
        try:
            steps = _decode(prompt_ids + generated, max_new_tokens - len(generated), num_draft_tokens, streams,
                            sampling, policy)
            async with aclosing(steps):
                async for step in steps:
                    generated += step.committed_ids
                    yield step
            return
        except TargetLost as e:
            lost = e
            log.warning("%s; re-prefilling %d committed tokens on another replica", lost,
                        len(prompt_ids) + len(generated))
    raise ServiceUnavailableError(
        f"no target replica could continue the request after {max_target_retries} re-prefill(s) ({lost})"
        f"{_kept(generated)}")


def _kept(generated: list[int]) -> str:
    """What a client that saw `generated` should do next."""
    if not generated:
        return "; retry the request"
    return f"; the {len(generated)} token(s) already streamed are valid, retry for the rest"


async def _decode(
    context_ids: list[int], max_new_tokens: int, num_draft_tokens: int, streams: RequestStreams,
    sampling: SamplingParams, policy: SpeculationPolicy | None,
) -> AsyncIterator[Step]:
    """Prefills `context_ids` on a new target stream (and a new draft sequence, when the first step
    drafts; else the first step that drafts opens it), then speculates."""
    target = streams.open_target()
    # a verify commits up to k + 1 tokens after the prefill's one: with two new tokens or fewer none drafts
    draft = LazyDraft(streams, context_ids, max_new_tokens, sampling) \
        if num_draft_tokens > 0 and streams.use_draft and max_new_tokens > 2 else None
    # the draft opens once the first token is in (the target's prefill alone on hardware the two share), or beside
    # it where streams.opens_draft_with_prefill says so
    beside = streams.opens_draft_with_prefill
    opening = _open_early(draft, policy) if beside else None
    try:
        first = await target.prefill(context_ids, max_new_tokens, sampling)
        # the draft's own errors come before the first token where they are in by then, and always for a draft
        # name not yet checked (an unknown draft_model: NOT_FOUND, however fast the target's prefill)
        if opening is not None and (opening.done() or streams.checks_draft_name):
            await opening
    except BaseException:
        await _close(target, draft)
        raise
    try:
        if draft is not None:
            draft.commit([first])
            if not beside:
                _open_early(draft, policy)
        yield Step([first], 0, 0)
        num_generated = 1
        step_start = time.perf_counter()  # a step's wall time includes the caller's work on the previous one
        while num_generated < max_new_tokens:
            # a verify commits up to k + 1 tokens; never run past max_new_tokens
            k = min(policy.next_k() if policy else num_draft_tokens, max_new_tokens - num_generated - 1) \
                if draft is not None and not draft.is_lost else 0
            proposal = await draft.propose(k) if k > 0 else Proposal([], [])
            target_ns = target.forward_ns
            try:
                verified = await target.verify(proposal)
            except TargetLost:
                await _close(target, draft)
                raise
            if policy is not None:
                step_end = time.perf_counter()
                policy.record(len(proposal.token_ids), verified.num_accepted, (target.forward_ns - target_ns) / 1e9,
                              proposal.forward_ns / 1e9, step_end - step_start)
                step_start = step_end
            if draft is not None:
                draft.commit(verified.committed_ids, verified.num_accepted)
            num_generated += len(verified.committed_ids)
            yield Step(verified.committed_ids, len(proposal.token_ids), verified.num_accepted)
    finally:  # a draft still opening in the background is stopped with the request
        if draft is not None:
            await draft.close()


def _open_early(draft: LazyDraft | None, policy: SpeculationPolicy | None) -> asyncio.Task[None] | None:
    """Starts opening the draft in the background (beside the target's prefill, or after it) when the first step
    will draft (a pinned k, or estimates that favour drafting); a request that starts at k = 0 leaves the draft
    service alone. The first token waits for the target only; the first propose waits for the draft."""
    if draft is not None and (policy is None or policy.is_drafting):
        return draft.open_soon()
    return None


async def _close(target: TargetStream, draft: LazyDraft | None) -> None:
    """Ends both streams of a lost replica's attempt at once (their services free the sequences)."""
    await target.close()
    if draft is not None:
        await draft.close()
