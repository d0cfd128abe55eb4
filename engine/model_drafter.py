"""A causal-LM drafter: greedy proposals from a small model with its own paged KV cache.

Proposals of concurrent requests are batched: new sequences' prompts are prefilled in one
forward, then one proposal loop (engine/draft_loop.py; a single CUDA graph on the GPU) feeds every
proposing sequence's pending tokens (the committed tokens it has not seen, including the
"catch-up" last draft token when everything was accepted) and extends all of them together.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.batch import StepInput
from engine.batching_loop import BatchingLoop, ForwardObserver
from engine.draft_loop import DraftLoop
from engine.drafter import DraftSequence, ProposeTiming, check_propose
from engine.kv_cache import KVAdmission
from engine.limits import check_new_sequence
from engine.model_runner import ModelRunner
from engine.sampling import SamplingParams
from specdec.errors import CapacityError, InvalidRequestError


@dataclass(frozen=True)
class _Job:
    seq: DraftSequence
    num_draft_tokens: int  # 0: start (prefill only)
    num_kv_valid: int  # leading tokens whose KV is still correct


class ModelDrafter:
    def __init__(
        self, runner: ModelRunner, max_draft_tokens: int = 16, max_batch_size: int = 64,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        """`executor`: the thread that loaded `runner` (see batching_loop.torch_thread)."""
        self.runner = runner
        self.description = runner.description
        self._max_draft_tokens = max_draft_tokens
        self._loop: BatchingLoop[_Job, tuple[list[int], ProposeTiming]] = BatchingLoop(
            self._process, max_batch_size, executor,
            phase_of=lambda job: "prefill" if job.num_draft_tokens == 0 else "propose", inline=runner.inline)
        self.admission = KVAdmission(runner.kv.config.num_blocks, runner.kv.block_size)
        self.draft_loop = DraftLoop(runner)  # on CUDA: captures its graphs (call on the torch thread)
        self._counters = {"num_active_sequences": 0, "num_sequences_started": 0, "num_forwards": 0,
                          "num_sequence_steps": 0}

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
        # the draft's KV holds at most the committed tokens plus k - 1 proposals
        promised = await self.admission.admit(len(prompt_ids) + max_new_tokens + self._max_draft_tokens)
        seq = DraftSequence(list(prompt_ids), kv=self.runner.kv.new_sequence(), num_promised_blocks=promised,
                            sampling=sampling)
        self._counters["num_active_sequences"] += 1
        self._counters["num_sequences_started"] += 1
        try:
            await self._loop.submit(_Job(seq, 0, 0))
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
        num_kept = seq.reconcile(num_accepted, append_ids)
        return await self._loop.submit(_Job(seq, num_draft_tokens, num_kept))

    def release(self, seq: DraftSequence) -> None:
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

    def _process(self, jobs: list[_Job]) -> list[tuple[list[int], ProposeTiming] | Exception]:
        """Worker thread: prefill the new sequences, then one batched proposal loop for the rest."""
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
        proposals = self.draft_loop.propose([step for _, _, step in proposing],
                                            [job.num_draft_tokens for _, job, _ in proposing],
                                            [job.seq.sampling for _, job, _ in proposing]) if proposing else []
        timing = ProposeTiming(time.perf_counter_ns() - start)
        for (index, job, _), proposal in zip(proposing, proposals):
            job.seq.token_ids += proposal.token_ids
            job.seq.num_proposed = len(proposal.token_ids)
            job.seq.proposal_probs = proposal.probs
            results[index] = (proposal.token_ids, timing)
        return [([], timing) if r is None else r for r in results]
