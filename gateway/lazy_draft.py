"""One request's draft sequence, opened only when a step drafts, and what the draft has not heard yet.

A request that never drafts (k = 0 for every step, as the adaptive policy chooses for a draft that
loses) never touches the draft service: no stream, no prefill, no KV. The first step that drafts
opens the sequence and catches up in one prefill of the context plus everything committed since,
but the newest token, which its first propose feeds. A lost draft stays lost for the request (it
runs target-only).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from engine.sampling import SamplingParams
from gateway.backends import DraftLost, DraftStream, Proposal, RequestStreams

log = logging.getLogger(__name__)


class LazyDraft:
    def __init__(self, streams: RequestStreams, context_ids: list[int], max_new_tokens: int,
                 sampling: SamplingParams) -> None:
        """`context_ids`, `max_new_tokens`: what the target stream was prefilled with and may add."""
        self._streams = streams
        self._context_ids = list(context_ids)
        self._max_new_tokens = max_new_tokens
        self._sampling = sampling
        self._stream: DraftStream | None = None
        self._opening: asyncio.Task[None] | None = None  # open_soon's
        self.is_lost = False
        # what the draft has not heard yet: how much of its open proposal survived, tokens to append
        self._num_accepted = 0
        self._unheard_ids: list[int] = []
        self._has_proposal = False  # a propose was answered in this step

    @property
    def is_open(self) -> bool:
        return self._stream is not None and not self.is_lost

    def open_soon(self) -> asyncio.Task[None]:
        """Opens the sequence in the background (beside the target's prefill): the first propose waits for
        it, the request's first token need not (a hung draft would hold it up by a step timeout)."""
        self._opening = asyncio.ensure_future(self.open())
        return self._opening

    async def open(self) -> None:
        """Opens the sequence and prefills everything committed so far but the newest token (what is
        committed meanwhile stays unheard, for the first propose)."""
        catch_up_ids = self._unheard_ids[:-1]
        self._stream = self._streams.open_draft()
        try:
            await self._stream.start(self._context_ids + catch_up_ids, self._max_new_tokens - len(catch_up_ids),
                                     self._sampling)
        except DraftLost as lost:
            await self._drop(lost)
            return
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:  # unloaded since: the next request's opens beside the prefill
                self._streams.draft_not_found()
            raise
        self._streams.draft_opened()
        del self._unheard_ids[:len(catch_up_ids)]

    async def propose(self, num_draft_tokens: int) -> Proposal:
        """Up to `num_draft_tokens` tokens after the committed ones; none once the draft is lost."""
        if self._opening is not None:
            opening, self._opening = self._opening, None
            await opening
        if not self.is_open and not self.is_lost:
            await self.open()
        if self.is_lost:
            return Proposal([], [])
        try:
            proposal = await self._stream.propose(self._num_accepted, self._unheard_ids, num_draft_tokens)
        except DraftLost as lost:
            await self._drop(lost)
            return Proposal([], [])
        self._has_proposal = True
        return proposal

    def commit(self, committed_ids: list[int], num_accepted: int = 0) -> None:
        """The target committed `committed_ids`, the first `num_accepted` of them from this step's proposal."""
        if self._has_proposal:  # the draft holds the accepted tokens already
            self._num_accepted, self._unheard_ids = num_accepted, committed_ids[-1:]
            self._has_proposal = False
        else:
            self._unheard_ids += committed_ids

    async def close(self) -> None:
        """Ends the stream, if one was opened; the draft service frees the sequence."""
        if self._opening is not None:  # never awaited by a propose (no step drafted)
            opening, self._opening = self._opening, None
            opening.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):  # its error no longer matters
                await opening
        if self._stream is not None:
            await self._stream.close()

    async def _drop(self, lost: DraftLost) -> None:
        log.warning("%s; the request continues target-only", lost)
        self.is_lost = True
        if lost.timed_out:
            self._streams.pause_draft()
        await self._stream.close()
