"""The target's verbs: prefill a sequence, verify draft tokens, release; batched across requests.

Invariant of a target sequence: its KV cache holds every committed token except the last one,
which is fed at the head of the next verify (so a verify of k drafts is one k+1-token forward).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.batch import StepInput
from engine.batching_loop import BatchingLoop
from engine.limits import check_new_sequence
from engine.kv_cache import SequenceKV
from engine.model_runner import ModelRunner
from engine.verification import Verification, verify_greedy
from specdec.errors import CapacityError, InvalidRequestError


@dataclass
class TargetSequence:
    token_ids: list[int]  # prompt + committed tokens
    kv: SequenceKV
    max_len: int  # prompt + max_new_tokens


@dataclass(frozen=True)
class StepTiming:
    forward_ns: int
    batch_size: int


@dataclass(frozen=True)
class _Job:
    seq: TargetSequence
    draft_ids: list[int] | None  # None: prefill


@dataclass(frozen=True)
class _Outcome:
    verification: Verification
    timing: StepTiming


class TargetEngine:
    def __init__(self, runner: ModelRunner, max_batch_size: int = 64, executor: ThreadPoolExecutor | None = None) -> None:
        """`executor`: the thread that loaded `runner` (see batching_loop.torch_thread)."""
        self.runner = runner
        self._loop: BatchingLoop[_Job, _Outcome] = BatchingLoop(self._process, max_batch_size, executor)
        self.num_active_sequences = 0
        self.num_sequences_started = 0
        self.num_forwards = 0
        self.num_sequence_steps = 0

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def prefill(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[TargetSequence, int, StepTiming]:
        """Opens a sequence on the prompt; returns it with the target's first token."""
        check_new_sequence(prompt_ids, max_new_tokens, self.runner.max_model_len)
        self.runner.check_token_ids(prompt_ids, "prompt_ids")
        seq = TargetSequence(list(prompt_ids), self.runner.kv.new_sequence(), len(prompt_ids) + max_new_tokens)
        self.num_active_sequences += 1
        self.num_sequences_started += 1
        try:
            outcome = await self._loop.submit(_Job(seq, None))
        except BaseException:
            self.release(seq)
            raise
        return seq, outcome.verification.committed_ids[0], outcome.timing

    async def verify(self, seq: TargetSequence, draft_ids: list[int]) -> tuple[Verification, StepTiming]:
        """Checks `draft_ids` after the committed tokens; commits accepted + recovered/bonus."""
        self.runner.check_token_ids(draft_ids, "draft_ids")
        if len(seq.token_ids) + len(draft_ids) > seq.max_len:
            raise InvalidRequestError(
                f"verify of {len(draft_ids)} draft tokens would pass the sequence's limit of "
                f"{seq.max_len} tokens (prompt + max_new_tokens); {len(seq.token_ids)} are committed"
            )
        outcome = await self._loop.submit(_Job(seq, list(draft_ids)))
        return outcome.verification, outcome.timing

    def release(self, seq: TargetSequence) -> None:
        """Frees the sequence's KV blocks (after any batch that uses them has finished)."""
        self.num_active_sequences -= 1
        self._loop.run_serialized(seq.kv.release)

    def _process(self, jobs: list[_Job]) -> list[_Outcome | Exception]:
        """Worker thread: one forward over every job that fits in the KV pool."""
        steps: dict[int, StepInput] = {}
        results: list[_Outcome | Exception] = [CapacityError("unreachable")] * len(jobs)
        for i, job in enumerate(jobs):
            step = _step_input(job)
            if step.kv.is_released:
                results[i] = InvalidRequestError("sequence was released")
            elif step.kv.can_reserve(len(step.token_ids)):
                step.kv.reserve(len(step.token_ids))  # so later jobs see the pool as it will be
                steps[i] = step
            else:
                results[i] = CapacityError(
                    f"KV cache is full ({self.runner.kv.allocator.num_used} blocks in use); "
                    "retry later, or send a shorter prompt / smaller max_new_tokens"
                )
        if not steps:
            return results
        start = time.perf_counter_ns()
        logits = self.runner.forward(list(steps.values()))
        timing = StepTiming(time.perf_counter_ns() - start, len(steps))
        self.num_forwards += 1
        self.num_sequence_steps += len(steps)
        for (i, step), step_logits in zip(steps.items(), logits):
            results[i] = _Outcome(_commit(jobs[i], step_logits), timing)
        return results


def _step_input(job: _Job) -> StepInput:
    if job.draft_ids is None:
        return StepInput(job.seq.kv, job.seq.token_ids, num_logits=1)
    fed = [job.seq.token_ids[-1], *job.draft_ids]
    return StepInput(job.seq.kv, fed, num_logits=len(fed))


def _commit(job: _Job, logits: torch.Tensor) -> Verification:
    seq = job.seq
    if job.draft_ids is None:
        first = int(logits[-1].argmax())
        seq.token_ids.append(first)
        return Verification(num_accepted=0, committed_ids=[first])
    verification = verify_greedy(torch.tensor(job.draft_ids, device=logits.device), logits)
    seq.token_ids += verification.committed_ids
    seq.kv.truncate(len(seq.token_ids) - 1)  # drop rejected drafts; the last token is fed next time
    return verification
