"""A causal-LM drafter: greedy proposals from a small model with its own paged KV cache.

Proposals of concurrent requests are batched: new sequences' prompts are prefilled in one
forward, then one proposal loop (engine/draft_loop.py; a single CUDA graph on the GPU) feeds every
proposing sequence's pending tokens (the committed tokens it has not seen, including the
"catch-up" last draft token when everything was accepted) and extends all of them together.

Draft-ahead (`ahead=True`, greedy sequences): once a proposal d_1..d_k is answered, the drafter
goes on while the target verifies it, as if all k were accepted: it feeds d_k and proposes k + 1
more tokens, g, e_1..e_k (g: its guess of the target's bonus token). If the next propose says all
k were accepted and the target's token was g, its answer is e_1..e_k, computed already: the
proposal costs no draft time on the request's critical path (a hit; the timing says 0). Otherwise
(a miss) the sequence rolls back to the accepted prefix as always, dropping the chain's KV; a
propose that reports a rejection (or asks another k) cancels the chain instead of waiting for it. Greedy
proposals are a function of the tokens, so a hit answers exactly what a fresh proposal would have;
the output is the target's either way. Sampled sequences never draft ahead: their proposals draw
from the draft's generator, and whether a chain was drawn must not depend on timing. A chain is
drafted only where it fits within the sequence's own limit (prompt + max_new_tokens), so it needs
no KV beyond what admission promised. The cost: draft forwards that misses throw away - worth it
where the draft has a device of its own; on a shared one they take its time from the target's verify.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.batch import StepInput
from engine.batching_loop import BatchingLoop, ForwardObserver
from engine.draft_loop import DraftLoop, LoopConfig
from engine.drafter import DraftSequence, ProposeTiming, check_propose
from engine.gpu_work import GpuWork
from engine.kv_cache import KVAdmission
from engine.limits import check_new_sequence
from engine.model_runner import ModelRunner
from engine.rehearsal import Rehearsal
from engine.sampling import SamplingParams
from specdec.errors import CapacityError, InvalidRequestError


@dataclass(frozen=True)
class _Job:
    seq: DraftSequence
    num_draft_tokens: int  # 0: start (prefill only)
    num_kv_valid: int  # leading tokens whose KV is still correct
    is_ahead: bool = False  # continues the open proposal; leaves the sequence's tokens alone


class ModelDrafter:
    def __init__(
        self, runner: ModelRunner, max_draft_tokens: int = 16,
        executor: ThreadPoolExecutor | None = None, ahead: bool = False,
    ) -> None:
        """`executor`: the thread that loaded `runner` (see batching_loop.torch_thread); `ahead`:
        draft ahead while the target verifies (module doc). Batches of at most the runner's
        max_batch_size sequences, the largest its graphs are captured for."""
        self.runner = runner
        self.description = runner.description
        self._max_draft_tokens = max_draft_tokens
        self._ahead = ahead
        self._loop: BatchingLoop[_Job, tuple[list[int], ProposeTiming]] = BatchingLoop(
            self._process, runner.max_batch_size, executor,
            phase_of=lambda job: "prefill" if job.num_draft_tokens == 0 else "propose", inline=runner.inline)
        self.admission = KVAdmission(runner.kv.config.num_blocks, runner.kv.block_size)
        # on CUDA: captures its graphs (call on the torch thread)
        self.draft_loop = DraftLoop(runner, LoopConfig().for_max_batch(runner.max_batch_size))
        self._rehearsal: Rehearsal | None = None
        self._counters = {"num_active_sequences": 0, "num_sequences_started": 0, "num_forwards": 0,
                          "num_sequence_steps": 0, "num_ahead_hits": 0, "num_ahead_misses": 0}

    def observe_forwards(self, observer: ForwardObserver) -> None:
        """`observer` hears of every batched step: phase ("prefill", "propose", "mixed"), size, time."""
        self._loop.observer = observer

    def start_background(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def start(self, prompt_ids: list[int], max_new_tokens: int,
                    sampling: SamplingParams = SamplingParams()) -> DraftSequence:
        """Opens a sequence and prefills the prompt into the draft's KV cache."""
        check_new_sequence(prompt_ids, max_new_tokens, self.runner.max_model_len)
        self.runner.check_token_ids(prompt_ids, "prompt_ids")
        # the draft's KV holds at most the committed tokens plus k - 1 proposals (a draft-ahead chain
        # is drafted only within max_len)
        max_len = len(prompt_ids) + max_new_tokens
        promised = await self.admission.admit(max_len + self._max_draft_tokens)
        seq = DraftSequence(list(prompt_ids), kv=self.runner.kv.new_sequence(), num_promised_blocks=promised,
                            sampling=sampling, max_len=max_len)
        self._counters["num_active_sequences"] += 1
        self._counters["num_sequences_started"] += 1
        try:
            _, timing = await self._loop.submit(_Job(seq, 0, 0))
            seq.prefill_forward_ns = timing.forward_ns
        except BaseException:
            self.release(seq)
            raise
        return seq

    async def propose(
        self, seq: DraftSequence, num_accepted: int, append_ids: list[int], num_draft_tokens: int
    ) -> tuple[list[int], ProposeTiming]:
        """Rolls back to the accepted prefix, appends the committed tokens, proposes k more."""
        check_propose(num_draft_tokens, self._max_draft_tokens)
        self.runner.check_token_ids(append_ids, "append_ids")
        chain = None
        if seq.may_use_ahead(num_accepted, num_draft_tokens):
            chain = await self._finish_ahead(seq)
        elif self._cancel_ahead(seq):  # of no use: dropped at once, not waited for
            self._counters["num_ahead_misses"] += 1
        # the target's token guessed (a chain is drafted only within max_len: _start_ahead)
        if chain is not None and append_ids == chain[:1]:
            self._counters["num_ahead_hits"] += 1
            seq.token_ids += chain
            seq.num_proposed = num_draft_tokens
            result = (chain[1:], ProposeTiming(0))
        else:
            self._counters["num_ahead_misses"] += chain is not None
            num_kept = seq.reconcile(num_accepted, append_ids, num_draft_tokens)  # the next batch also drops the chain's KV
            result = await self._loop.submit(_Job(seq, num_draft_tokens, num_kept))
        self._start_ahead(seq, num_draft_tokens)
        return result

    def _start_ahead(self, seq: DraftSequence, num_draft_tokens: int) -> None:
        """Continues the open proposal in the background (module doc), where it fits the sequence."""
        if self._ahead and seq.sampling.is_greedy and len(seq.token_ids) + num_draft_tokens + 1 <= seq.max_len:
            job = _Job(seq, num_draft_tokens + 1, len(seq.token_ids), is_ahead=True)
            seq.ahead = asyncio.ensure_future(self._loop.submit(job))

    @staticmethod
    def _cancel_ahead(seq: DraftSequence) -> bool:
        """Cancels the sequence's chain, if any (not computed yet: never; running: the next batch
        rolls its KV back); whether there was one."""
        ahead, seq.ahead = seq.ahead, None
        if ahead is not None:
            ahead.cancel()
        return ahead is not None

    @staticmethod
    async def _finish_ahead(seq: DraftSequence) -> list[int] | None:
        """The sequence's ahead chain (g, e_1..e_k) once computed; None if none was started or it failed."""
        ahead, seq.ahead = seq.ahead, None
        if ahead is None:
            return None
        try:
            chain, _ = await ahead
        except Exception:  # noqa: BLE001 - e.g. no KV room: the proposal is made afresh
            return None
        return chain

    def rehearse(self) -> None:
        """A proposal's host work on scratch objects (engine/rehearsal.py: its checks, its first step, the
        loop inputs' host writes), to keep that code warm between steps; the drafter's state is not touched."""
        if self._rehearsal is None:
            self._rehearsal = Rehearsal(self.runner.kv.block_size, 1, self.runner.max_model_len, num_extra=2)
        rehearsal = self._rehearsal
        self.runner.check_token_ids(rehearsal.token_ids, "append_ids")
        check_propose(1, self._max_draft_tokens)
        step = rehearsal.step()
        rehearsal.fill(step, extra=[[len(step.token_ids) - 1], [step.kv.num_tokens + len(step.token_ids) - 1]])

    def release(self, seq: DraftSequence) -> None:
        self._cancel_ahead(seq)
        self._counters["num_active_sequences"] -= 1
        assert seq.kv is not None
        self._loop.run_serialized(seq.kv.release)
        self.admission.retire(seq.num_promised_blocks)

    def stats(self) -> dict[str, int]:
        allocator = self.runner.kv.allocator
        counters = {**self._counters, "num_forwards": self._counters["num_forwards"] + self.draft_loop.num_forwards,
                    "num_sequence_steps": self._counters["num_sequence_steps"] + self.draft_loop.num_sequence_steps}
        return {**counters, "num_kv_blocks_used": allocator.num_used,
                "num_waiting_sequences": self.admission.num_waiting,
                "num_kv_blocks_total": allocator.num_blocks, "kv_block_size": self.runner.kv.block_size}

    def _process(self, jobs: list[_Job]) -> GpuWork[list[tuple[list[int], ProposeTiming] | Exception]]:
        """Prefill the new sequences, then one batched proposal loop for the rest; yields before its read
        back (engine/gpu_work.py: the batching loop may serve others while the GPU works)."""
        start = time.perf_counter_ns()
        results: list[tuple[list[int], ProposeTiming] | Exception | None] = []
        prefills: list[StepInput] = []
        proposing: list[tuple[int, _Job, StepInput]] = []
        for job in jobs:
            kv = job.seq.kv
            results.append(None)
            if kv.is_released:
                results[-1] = InvalidRequestError("sequence was released")
                continue
            if job.num_draft_tokens:
                kv.truncate(min(kv.num_tokens, job.num_kv_valid))  # roll back rejected drafts
            pending = job.seq.token_ids[kv.num_tokens:]
            # the last proposed token is never fed, so room for pending + k - 1 tokens
            if not kv.can_reserve(len(pending) + max(job.num_draft_tokens - 1, 0)):
                results[-1] = CapacityError("draft KV cache is full; retry later")  # admission prevents this
            elif job.num_draft_tokens == 0:
                prefills.append(StepInput(kv, pending, num_logits=0))
            else:
                proposing.append((len(results) - 1, job, StepInput(kv, pending, num_logits=1)))
        if prefills:
            self.runner.forward(prefills)
            self._counters["num_forwards"] += 1
            self._counters["num_sequence_steps"] += len(prefills)
        proposals = []
        if proposing:
            proposals = yield from self.draft_loop.propose_work([step for _, _, step in proposing],
                                                                [job.num_draft_tokens for _, job, _ in proposing],
                                                                [job.seq.sampling for _, job, _ in proposing])
        timing = ProposeTiming(time.perf_counter_ns() - start)
        for (index, job, _), proposal in zip(proposing, proposals):
            if not job.is_ahead:
                job.seq.token_ids += proposal.token_ids
                job.seq.num_proposed = len(proposal.token_ids)
                job.seq.proposal_probs = proposal.probs
            results[index] = (proposal.token_ids, timing)
        return [([], timing) if r is None else r for r in results]
