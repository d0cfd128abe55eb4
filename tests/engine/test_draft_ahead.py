"""Draft-ahead: a proposal answered from the chain drafted during the last verify is exactly the one a
drafter without it proposes, and a chain that turns out wrong is rolled back without a trace."""
from __future__ import annotations

import asyncio

from engine.model_drafter import ModelDrafter
from engine.model_runner import ModelRunner, RuntimeConfig
from engine.sampling import SamplingParams
from engine.target_engine import TargetEngine

PROMPT = list(range(30, 45))
K = 3


def _drafter(model_dir, ahead: bool) -> ModelDrafter:
    drafter = ModelDrafter(ModelRunner(RuntimeConfig(model=str(model_dir), kv_cache_tokens=2048)), ahead=ahead)
    drafter.start_background()
    return drafter


def test_hits_and_misses_propose_what_a_drafter_without_draft_ahead_proposes(model_dirs):
    """Scripted verdicts: all accepted with the chain's guess (a hit), a rejection, all accepted
    with another token (misses), then a hit again; each proposal is compared with a plain drafter's."""

    async def main() -> tuple[list[list[int]], list[list[int]], list[int], dict, dict]:
        ahead, plain = _drafter(model_dirs["perturbed"], True), _drafter(model_dirs["perturbed"], False)
        seqs = [await d.start(PROMPT, 40) for d in (ahead, plain)]
        answers: dict[bool, list[list[int]]] = {True: [], False: []}
        forward_ns = []

        async def step(num_accepted: int, append_ids: list[int]) -> None:
            for drafter, seq in zip((ahead, plain), seqs):
                ids, timing = await drafter.propose(seq, num_accepted, append_ids, K)
                answers[drafter is ahead].append(ids)
                if drafter is ahead:
                    forward_ns.append(timing.forward_ns)

        async def guess() -> int:  # the chain's first token: its guess of the target's next one
            chain, _ = await asyncio.shield(seqs[0].ahead)
            return chain[0]

        await step(0, [11])
        await step(K, [await guess()])  # hit
        await step(1, [7])  # a rejection after one accepted draft: miss
        await step(K, [(await guess() + 1) % 100])  # all accepted, another target token: miss
        await step(K, [await guess()])  # hit
        stats = ahead.stats()
        for drafter, seq in zip((ahead, plain), seqs):
            drafter.release(seq)
            await asyncio.sleep(0.05)  # the release runs between batches
        after = ahead.stats()
        await ahead.stop()
        await plain.stop()
        return answers[True], answers[False], forward_ns, stats, after

    with_ahead, without, forward_ns, stats, after = asyncio.run(main())
    assert with_ahead == without
    assert all(len(ids) == K for ids in with_ahead)
    assert (stats["num_ahead_hits"], stats["num_ahead_misses"]) == (2, 2)
    assert forward_ns[1] == forward_ns[4] == 0 and min(forward_ns[0], forward_ns[2], forward_ns[3]) > 0
    assert after["num_kv_blocks_used"] == 0 and after["num_active_sequences"] == 0


def test_an_identical_draft_hits_every_step_and_the_target_accepts_everything(model_dirs):
    """With the target's own weights the chain's guess is the target's token every time."""

    async def main() -> tuple[list[int], dict]:
        engine = TargetEngine(ModelRunner(RuntimeConfig(model=str(model_dirs["target"]), kv_cache_tokens=2048)))
        engine.start()
        drafter = _drafter(model_dirs["identical"], True)
        seq, first, _ = await engine.prefill(PROMPT, 40)
        draft_seq = await drafter.start(PROMPT, 40)
        num_accepted, append, accepted = 0, [first], []
        for _ in range(5):
            draft_ids, _ = await drafter.propose(draft_seq, num_accepted, append, K)
            verification, _ = await engine.verify(seq, draft_ids)
            accepted.append(verification.num_accepted)
            num_accepted, append = verification.num_accepted, verification.committed_ids[-1:]
        stats = drafter.stats()
        engine.release(seq)
        drafter.release(draft_seq)
        await engine.stop()
        await drafter.stop()
        return accepted, stats

    accepted, stats = asyncio.run(main())
    assert accepted == [K] * 5
    assert (stats["num_ahead_hits"], stats["num_ahead_misses"]) == (4, 0)


def test_sampled_sequences_never_draft_ahead(model_dirs):
    async def main() -> dict:
        drafter = _drafter(model_dirs["perturbed"], True)
        seq = await drafter.start(PROMPT, 40, SamplingParams(temperature=0.8, seed=1))
        await drafter.propose(seq, 0, [11], K)
        started = seq.ahead is not None
        drafter.release(seq)
        await drafter.stop()
        return started

    assert asyncio.run(main()) is False


def test_a_rejection_drops_the_chain_without_waiting_for_it(model_dirs):
    """A propose that reports a rejection cannot use the chain: it is cancelled, not waited for (here
    before it ever ran: the drafter's forward count equals a plain drafter's)."""

    async def forwards(ahead: bool) -> tuple[int, dict]:
        drafter = _drafter(model_dirs["perturbed"], ahead)
        seq = await drafter.start(PROMPT, 40)
        await drafter.propose(seq, 0, [11], K)
        await drafter.propose(seq, 0, [12], K)  # the first draft rejected
        stats = drafter.stats()
        drafter.release(seq)
        await drafter.stop()
        return stats["num_forwards"], stats

    async def main() -> tuple[int, int, dict]:
        (with_ahead, stats), (plain, _) = await forwards(True), await forwards(False)
        return with_ahead, plain, stats

    with_ahead, plain, stats = asyncio.run(main())
    assert with_ahead == plain
    assert (stats["num_ahead_hits"], stats["num_ahead_misses"]) == (0, 1)
