"""The target's verbs: prefill a sequence, verify draft tokens, release; batched across requests.

Invariant of a target sequence: its KV cache holds every committed token except the last one,
which is fed at the head of the next verify (so a verify of k drafts is one k+1-token forward).

Each engine iteration runs one forward over every ready job: verifies first (they are short and
latency-bound), then prefill chunks up to the iteration's token budget, so a long prompt is
prefilled over several iterations while other requests keep verifying. A batch-invariant runner
(fused kernels) splits the iteration into its forward groups instead: the verifies together, each
prefill chunk alone, so no token's logits depend on which other requests were running; each forward's
results are answered as soon as it is read back, not once the iteration's last forward is.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.batch import StepInput
from engine.batching_loop import BatchingLoop, ForwardObserver
from engine.gpu_work import Answered, GpuWork
from engine.kv_cache import KVAdmission, SequenceKV
from engine.limits import check_new_sequence, check_verify
from engine.model_runner import ModelRunner
from engine.rehearsal import Rehearsal
from engine.sampling import Distribution, SamplingParams, check_draft_probs, sample_token, verify_sampled
from engine.verification import Verification, verify_greedy
from specdec.errors import InvalidRequestError
from specdec.turns import Turns


REHEARSAL_DRAFT_TOKENS = 4  # the verify a rehearsal runs (engine/rehearsal.py): k = 4, the common case


@dataclass(frozen=True)
class TargetEngineConfig:
    """Jobs an iteration: the runner's max_batch_size (its largest graph bucket), not a second value."""

    max_num_batched_tokens: int = 2048  # tokens per forward; longer prompts are chunked
    # prompts prefilling in one iteration, at most (0: as many as the token budget takes); the others wait their
    # turn in arrival order. With a batch-invariant runner each prompt's chunk is a forward of its own, and running
    # requests' next verifies wait for the iteration's last: 1 holds them up by one prefill forward, not a burst's
    max_prefills_per_iteration: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefills_per_iteration < 0:
            raise ValueError(f"max_prefills_per_iteration must be >= 0 (0: no limit), got "
                             f"{self.max_prefills_per_iteration}")


@dataclass
class TargetSequence:
    token_ids: list[int]  # prompt + committed tokens
    kv: SequenceKV
    max_len: int  # prompt + max_new_tokens
    num_promised_blocks: int  # what admission promised this sequence
    sampling: SamplingParams = SamplingParams()


@dataclass(frozen=True)
class StepTiming:
    forward_ns: int
    batch_size: int


@dataclass(frozen=True)
class _Job:
    seq: TargetSequence
    draft_ids: list[int] | None  # None: prefill
    draft_probs: list[Distribution] | None = None  # sampled sequences: what each draft token was drawn from


@dataclass(frozen=True)
class _Outcome:
    verification: Verification
    timing: StepTiming


class TargetEngine:
    def __init__(
        self, runner: ModelRunner, config: TargetEngineConfig = TargetEngineConfig(),
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        """`executor`: the thread that loaded `runner` (see batching_loop.torch_thread)."""
        self.runner = runner
        self.config = config
        self._loop: BatchingLoop[_Job, _Outcome] = BatchingLoop(self._process, runner.max_batch_size, executor,
                                                               phase_of=_phase, inline=runner.inline)
        self.admission = KVAdmission(runner.kv.config.num_blocks, runner.kv.block_size)
        self.num_active_sequences = 0
        self.num_sequences_started = 0
        self.num_forwards = 0
        self.num_sequence_steps = 0
        self._rehearsal: tuple[Rehearsal, TargetSequence] | None = None
        limit = config.max_prefills_per_iteration
        self._prefill_turns = Turns(limit) if limit else None  # its waiters: prompts admitted, awaiting a turn

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    def observe_forwards(self, observer: ForwardObserver) -> None:
        """`observer` hears of every batched step: phase ("prefill", "verify", "mixed"), size, time."""
        self._loop.observer = observer

    def stats(self) -> dict[str, int]:
        """Counters read at the time of the call (the EngineStats message's fields)."""
        allocator = self.runner.kv.allocator
        return {"num_active_sequences": self.num_active_sequences,
                "num_waiting_sequences": self.admission.num_waiting + self._num_awaiting_turn(),
                "num_sequences_started": self.num_sequences_started, "num_forwards": self.num_forwards,
                "num_sequence_steps": self.num_sequence_steps, "num_kv_blocks_used": allocator.num_used,
                "num_kv_blocks_total": allocator.num_blocks, "kv_block_size": self.runner.kv.block_size}

    async def prefill(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams()
                      ) -> tuple[TargetSequence, int, StepTiming]:
        """Opens a sequence on the prompt (waiting for KV room if needed); returns the first token."""
        check_new_sequence(prompt_ids, max_new_tokens, self.runner.max_model_len)
        sampling.check()
        self.runner.check_token_ids(prompt_ids, "prompt_ids")
        max_len = len(prompt_ids) + max_new_tokens
        promised = await self.admission.admit(max_len)
        seq = TargetSequence(list(prompt_ids), self.runner.kv.new_sequence(), max_len, promised, sampling)
        self.num_active_sequences += 1
        self.num_sequences_started += 1
        try:
            outcome = await self._prefill_in_turn(_Job(seq, None))
        except BaseException:
            self.release(seq)
            raise
        return seq, outcome.verification.committed_ids[0], outcome.timing

    def _num_awaiting_turn(self) -> int:
        return self._prefill_turns.num_waiting if self._prefill_turns is not None else 0

    async def _prefill_in_turn(self, job: _Job) -> _Outcome:
        """The prefill job, once it has a turn (config.max_prefills_per_iteration): every chunk of its prompt runs in
        it, in arrival order (specdec/turns.py)."""
        if self._prefill_turns is None:
            return await self._loop.submit(job)
        async with self._prefill_turns.turn():
            return await self._loop.submit(job)

    async def verify(self, seq: TargetSequence, draft_ids: list[int], draft_probs: list[Distribution] | None = None
                     ) -> tuple[Verification, StepTiming]:
        """Checks `draft_ids` after the committed tokens; commits accepted + recovered/bonus.

        Sampled sequences need `draft_probs`: the distribution each draft token was drawn from.
        """
        self.runner.check_token_ids(draft_ids, "draft_ids")
        if not seq.sampling.is_greedy:
            check_draft_probs(draft_ids, draft_probs or [], self.runner.description.vocab_size)
        check_verify(len(draft_ids), len(seq.token_ids), seq.max_len)
        outcome = await self._loop.submit(_Job(seq, list(draft_ids), draft_probs))
        return outcome.verification, outcome.timing

    def rehearse(self) -> None:
        """A verify's host work on scratch objects (engine/rehearsal.py: its checks, its step, the graph
        inputs' host writes, the greedy verification of small CPU logits), to keep that code warm between
        steps; the engine's state is not touched."""
        if self._rehearsal is None:
            rehearsal = Rehearsal(self.runner.kv.block_size, REHEARSAL_DRAFT_TOKENS + 1, self.runner.max_model_len)
            seq = TargetSequence(list(range(rehearsal.context + 1)), rehearsal.kv, self.runner.max_model_len, 0)
            self._rehearsal = rehearsal, seq
        rehearsal, seq = self._rehearsal
        job = _Job(seq, rehearsal.token_ids[1:])
        self.runner.check_token_ids(job.draft_ids, "draft_ids")
        step = _step_input(job, self.config.max_num_batched_tokens, None, first_prefill=True)
        self.runner.forward_groups([step])
        rehearsal.fill(step)
        verify_greedy(job.draft_ids, rehearsal.logits.argmax(-1).tolist())

    def release(self, seq: TargetSequence) -> None:
        """Frees the sequence's KV blocks (after any batch that uses them has finished)."""
        self.num_active_sequences -= 1
        self._loop.run_serialized(seq.kv.release)
        self.admission.retire(seq.num_promised_blocks)

    def _process(self, jobs: list[_Job]) -> GpuWork[list[_Outcome | Exception | None]]:
        """The verifies, then prefill chunks within the budget, in the runner's forwards; yields before each
        forward's read back (engine/gpu_work.py: the batching loop may serve others while the GPU works), and
        after each forward but the last the results it finished: a batch-invariant runner's iteration is a
        forward for the verifies, then one for each prefill chunk, and a request need not wait for the
        others' chunks (the first tokens of a burst of 8 prompts: the first after one prefill, not all 8).

        A prefill whose prompt is not finished by this iteration's chunk returns None (run again).
        Batch-invariant runners (ModelRunner.forward_groups) get prefill chunks cut at multiples of the
        budget whatever else is waiting, so a prompt token's products never depend on other requests.
        """
        results: list[_Outcome | Exception | None] = [None] * len(jobs)
        steps: dict[int, StepInput] = {}
        budget = self.config.max_num_batched_tokens
        chunk_multiple = self.config.max_num_batched_tokens if self.runner.batch_invariant else None
        prefilling = False
        for i in sorted(range(len(jobs)), key=lambda i: jobs[i].draft_ids is None):  # verifies first
            step = _step_input(jobs[i], budget, chunk_multiple, first_prefill=not prefilling)
            if step is None:
                continue  # no budget left: the prefill waits for the next iteration
            if step.kv.is_released:
                results[i] = InvalidRequestError("sequence was released")
                continue
            steps[i] = step
            budget -= len(step.token_ids)
            prefilling |= jobs[i].draft_ids is None
        entries = list(steps.items())  # (job index, step)
        groups = self.runner.forward_groups([step for _, step in entries])
        for num_run, group in enumerate(groups, 1):
            chosen = [entries[g] for g in group]
            start = time.perf_counter_ns()
            # every row's argmax comes back in one copy for all (sampled sequences read their logits)
            logits, greedy = self.runner.forward_greedy([step for _, step in chosen])
            yield greedy.ready
            committed = {i: _commit(jobs[i], step_logits, ids)  # a finished prefill or a verify
                         for (i, step), step_logits, ids in zip(chosen, logits, greedy.get()) if step.num_logits}
            timing = StepTiming(time.perf_counter_ns() - start, len(group))
            self.num_forwards += 1
            self.num_sequence_steps += len(group)
            for i, verification in committed.items():
                results[i] = _Outcome(verification, timing)
            if num_run < len(groups) and committed:  # answered now, not after the iteration's other forwards
                yield Answered({i: results[i] for i in committed})
        return results


def _phase(job: _Job) -> str:
    return "prefill" if job.draft_ids is None else "verify"


def _step_input(job: _Job, budget: int, chunk_multiple: int | None, first_prefill: bool) -> StepInput | None:
    """The job's step this iteration, or None to wait. A prefill takes what the budget leaves or, with
    `chunk_multiple`, the tokens up to the next multiple of it: once they fit, or as the iteration's
    first prefill (so a prompt always moves on)."""
    seq = job.seq
    if job.draft_ids is not None:  # verifies always run (admission promised their blocks)
        return StepInput(seq.kv, [seq.token_ids[-1], *job.draft_ids], num_logits=len(job.draft_ids) + 1)
    start = seq.kv.num_tokens
    if chunk_multiple is None:
        if budget <= 0:
            return None
        end = min(start + budget, len(seq.token_ids))
    else:
        end = min((start // chunk_multiple + 1) * chunk_multiple, len(seq.token_ids))
        if end - start > budget and not first_prefill:
            return None
    return StepInput(seq.kv, seq.token_ids[start:end], num_logits=1 if end == len(seq.token_ids) else 0)


def _commit(job: _Job, logits: torch.Tensor, greedy_ids: list[int]) -> Verification:
    """`greedy_ids`: the argmax token of each of `logits`' rows (read back already)."""
    seq, sampling = job.seq, job.seq.sampling
    position = len(seq.token_ids)  # of the first new token
    if job.draft_ids is None:
        first = greedy_ids[-1] if sampling.is_greedy else sample_token(logits[-1], sampling, position)
        seq.token_ids.append(first)
        return Verification(num_accepted=0, committed_ids=[first])
    if sampling.is_greedy:
        verification = verify_greedy(job.draft_ids, greedy_ids)
    else:
        verification = verify_sampled(job.draft_ids, job.draft_probs or [], logits, sampling, position)
    seq.token_ids += verification.committed_ids
    seq.kv.truncate(len(seq.token_ids) - 1)  # drop rejected drafts; the last token is fed next time
    return verification
