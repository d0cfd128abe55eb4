"""Rehearsals (engine/rehearsal.py): a step's host work on scratch objects changes nothing a request sees."""
from __future__ import annotations

import asyncio

from engine.model_drafter import ModelDrafter
from engine.model_runner import ModelRunner, RuntimeConfig
from engine.target_engine import TargetEngine

PROMPT = list(range(20, 41))


def _runner(model_dir) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=str(model_dir), kv_cache_tokens=2048))


def _rehearsals_change_nothing(owner: TargetEngine | ModelDrafter, seq, rehearse: bool) -> bool:
    """Rehearses `owner` three times (if asked); whether its KV blocks, forwards, counters and the open
    sequence are as they were."""
    def state():
        return owner.runner.kv.allocator.num_used, owner.runner.num_eager_steps, seq.kv.num_tokens, owner.stats()

    before = state()
    for _ in range(3 if rehearse else 0):
        owner.rehearse()
    return state() == before


def test_target_rehearsals_between_verifies_change_no_result_and_no_state(model_dirs):
    async def run(rehearse: bool):
        engine = TargetEngine(_runner(model_dirs["target"]))
        engine.start()
        seq, first, _ = await engine.prefill(PROMPT, 32)
        committed, states = [first], []
        for drafts in ([1, 2, 3], [4], [7, 7, 7, 7]):
            states.append(_rehearsals_change_nothing(engine, seq, rehearse))
            verification, _ = await engine.verify(seq, drafts)
            committed += verification.committed_ids
        engine.release(seq)
        await engine.stop()
        return committed, states

    rehearsed, unchanged = asyncio.run(run(True))
    assert unchanged == [True, True, True]
    assert rehearsed == asyncio.run(run(False))[0]


def test_draft_rehearsals_between_proposals_change_no_proposal_and_no_state(model_dirs):
    async def run(rehearse: bool):
        drafter = ModelDrafter(_runner(model_dirs["perturbed"]))
        drafter.start_background()
        seq = await drafter.start(PROMPT, 32)
        proposals, states = [], []
        num_accepted, append = 0, [9]
        for _ in range(3):
            states.append(_rehearsals_change_nothing(drafter, seq, rehearse))
            draft_ids, _ = await drafter.propose(seq, num_accepted, append, 3)
            proposals.append(draft_ids)
            num_accepted, append = 1, [draft_ids[1] + 1]
        drafter.release(seq)
        await drafter.stop()
        return proposals, states

    rehearsed, unchanged = asyncio.run(run(True))
    assert unchanged == [True, True, True]
    assert rehearsed == asyncio.run(run(False))[0]
