"""Concurrent requests share forwards, and sharing a forward changes no result."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from engine.model_drafter import ModelDrafter
from engine.model_runner import ModelRunner, RuntimeConfig
from engine.target_engine import TargetEngine, TargetEngineConfig
from specdec.errors import ServiceUnavailableError

PROMPTS = [[5, 6, 7], list(range(20, 41)), [9], list(range(100, 108))]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _runner(model_dir, device: str = "cpu") -> ModelRunner:
    """On CUDA: graphs, and the fused kernels (a row computed alike in any batch), and batches polled on
    the event loop while several requests are open (engine/batching_loop.py)."""
    if device == "cpu":
        return ModelRunner(RuntimeConfig(model=str(model_dir), kv_cache_tokens=2048))
    return ModelRunner(RuntimeConfig(model=str(model_dir), device=device, kv_cache_tokens=2048, layer_kernels="fused",
                                     attention_backend="triton"))


async def _target_run(engine: TargetEngine, prompt: list[int], drafts: list[list[int]]):
    seq, first, prefill_timing = await engine.prefill(prompt, 32)
    verifies = [await engine.verify(seq, d) for d in drafts]
    engine.release(seq)
    return first, [v.committed_ids for v, _ in verifies], prefill_timing.batch_size


@pytest.mark.parametrize("device", DEVICES)
def test_concurrent_prefills_and_verifies_share_forwards(model_dirs, device):
    drafts = [[1, 2, 3], [4], [], [7, 7]]

    async def main():
        engine = TargetEngine(_runner(model_dirs["target"], device))
        engine.start()
        together = await asyncio.gather(*(_target_run(engine, p, drafts) for p in PROMPTS))
        forwards_together = engine.num_forwards
        alone = [await _target_run(engine, p, drafts) for p in PROMPTS]
        await engine.stop()  # after the releases handed to its worker (CPU)
        return together, forwards_together, alone, engine.stats()["num_kv_blocks_used"]

    together, forwards_together, alone, blocks_used = asyncio.run(main())
    # one prefill forward for all; on CUDA (fused kernels, batch-invariant) a prompt longer than the graphs'
    # widest step (8 tokens: the second) in a forward of its own (ModelRunner.forward_groups)
    prefill_sizes, prefill_forwards = ([4] * 4, 1) if device == "cpu" else ([3, 1, 3, 3], 2)
    assert [t[2] for t in together] == prefill_sizes
    assert forwards_together == prefill_forwards + len(drafts)  # and one forward per verify round
    assert [t[:2] for t in together] == [a[:2] for a in alone]
    assert blocks_used == 0  # released during others' batches too


@pytest.mark.parametrize("device", DEVICES)
def test_concurrent_proposals_share_forwards(model_dirs, device):
    async def run(drafter: ModelDrafter, prompt: list[int]) -> list[list[int]]:
        seq = await drafter.start(prompt, 64)
        first, _ = await drafter.propose(seq, 0, [11], 4)
        second, _ = await drafter.propose(seq, 4, [12], 3)  # all accepted: the catch-up case
        third, _ = await drafter.propose(seq, 1, [13], 2)  # partly accepted: rollback
        drafter.release(seq)
        return [first, second, third]

    async def main():
        drafter = ModelDrafter(_runner(model_dirs["perturbed"], device))
        drafter.start_background()
        together = await asyncio.gather(*(run(drafter, p) for p in PROMPTS))
        forwards_together = drafter.stats()["num_forwards"]
        alone = [await run(drafter, p) for p in PROMPTS]
        await drafter.stop()  # after the releases handed to its worker (CPU)
        return together, forwards_together, alone, drafter.stats()["num_kv_blocks_used"]

    together, forwards_together, alone, blocks_used = asyncio.run(main())
    assert together == alone
    assert forwards_together == 1 + 4 + 3 + 2  # start, then k forwards per proposal round
    assert blocks_used == 0
    assert all(len(p) == k for props in together for p, k in zip(props, (4, 3, 2)))


def test_a_drafter_batches_no_more_sequences_than_its_runner_is_built_for(model_dirs):
    """The runner's max_batch_size (its largest graph bucket on CUDA) bounds the drafter's batches:
    four concurrent starts over a runner of 2 take two forwards of 2."""
    sizes: list[int] = []

    async def main():
        drafter = ModelDrafter(ModelRunner(RuntimeConfig(model=str(model_dirs["perturbed"]), kv_cache_tokens=2048,
                                                         max_batch_size=2)))
        drafter.observe_forwards(SimpleNamespace(observe_forward=lambda phase, size, seconds: sizes.append(size)))
        drafter.start_background()
        seqs = await asyncio.gather(*(drafter.start(p, 16) for p in PROMPTS))
        for seq in seqs:
            drafter.release(seq)
        await drafter.stop()

    asyncio.run(main())
    assert sizes == [2, 2]


def test_a_target_engine_batches_no_more_sequences_than_its_runner_is_built_for(model_dirs):
    """The runner's max_batch_size bounds the engine's iterations too (one value, not one per engine):
    four concurrent prefills over a runner of 2 take two forwards of 2, and so do their verifies."""
    sizes: list[tuple[str, int]] = []

    async def main():
        engine = TargetEngine(ModelRunner(RuntimeConfig(model=str(model_dirs["target"]), kv_cache_tokens=2048,
                                                        max_batch_size=2)))
        engine.observe_forwards(SimpleNamespace(observe_forward=lambda phase, size, seconds: sizes.append((phase, size))))
        engine.start()
        await asyncio.gather(*(_target_run(engine, p, [[1, 2]]) for p in PROMPTS))
        await engine.stop()

    asyncio.run(main())
    assert [size for _, size in sizes] == [2, 2, 2, 2]


def test_draft_proposals_equal_greedy_continuation_of_the_target_when_identical(model_dirs):
    """An identical draft proposes exactly the target's greedy tokens, including after catch-up."""

    async def main():
        engine = TargetEngine(_runner(model_dirs["target"]))
        drafter = ModelDrafter(_runner(model_dirs["identical"]))
        engine.start()
        drafter.start_background()
        prompt = list(range(30, 45))
        seq, first, _ = await engine.prefill(prompt, 40)
        draft_seq = await drafter.start(prompt, 40)
        num_accepted, append, accepted = 0, [first], []
        for _ in range(5):
            draft_ids, _ = await drafter.propose(draft_seq, num_accepted, append, 3)
            verification, _ = await engine.verify(seq, draft_ids)
            accepted.append(verification.num_accepted)
            num_accepted, append = verification.num_accepted, verification.committed_ids[-1:]
        engine.release(seq)
        drafter.release(draft_seq)
        await engine.stop()
        await drafter.stop()
        return accepted

    assert asyncio.run(main()) == [3] * 5


def test_long_prefill_is_chunked_and_gives_the_same_tokens(model_dirs):
    """With a 8-token budget a 30-token prompt takes several iterations while another request
    keeps verifying; the tokens equal those of an unchunked engine."""
    prompt, other = list(range(40, 70)), [5, 6, 7]

    async def run(config: TargetEngineConfig):
        engine = TargetEngine(_runner(model_dirs["target"]), config)
        engine.start()
        other_seq, _, _ = await engine.prefill(other, 20)

        async def keep_verifying():
            return [(await engine.verify(other_seq, [1]))[0].committed_ids for _ in range(6)]

        (seq, first, _), other_out = await asyncio.gather(engine.prefill(prompt, 8), keep_verifying())
        verification, _ = await engine.verify(seq, [3, 4])
        engine.release(seq)
        before = engine.num_forwards
        alone, _, _ = await engine.prefill(prompt, 8)  # the same prompt with nothing else running
        forwards_alone = engine.num_forwards - before
        engine.release(alone)
        await engine.stop()
        return first, verification.committed_ids, other_out, forwards_alone

    chunked = asyncio.run(run(TargetEngineConfig(max_num_batched_tokens=8)))
    whole = asyncio.run(run(TargetEngineConfig(max_num_batched_tokens=2048)))
    assert chunked[:3] == whole[:3]
    assert (chunked[3], whole[3]) == (4, 1)  # 30 prompt tokens in chunks of 8, or in one forward


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_engine_computes_a_request_alike_beside_another_prefill(model_dirs, device):
    """--layer-kernels fused: a verify gets the same logits, bit for bit, alone or in an engine
    iteration that also prefills another request's long prompt; and that prompt's first token gets
    the same logits as when it is prefilled alone (chunks cut at multiples of the budget, each chunk
    in a forward of its own: ModelRunner.forward_groups)."""
    runner = ModelRunner(RuntimeConfig(model=str(model_dirs["target"]), device=device, kv_cache_tokens=2048,
                                       layer_kernels="fused", attention_backend="triton"))
    recorded: dict[tuple[int, ...], list[torch.Tensor]] = {}
    forward = runner.forward_greedy  # the engine's forward for greedy requests

    def recording_forward(steps):
        out, ids = forward(steps)
        for step, logits in zip(steps, out):
            if step.num_logits:
                recorded.setdefault(tuple(step.token_ids), []).append(logits.clone())
        return out, ids

    runner.forward_greedy = recording_forward
    phases: list[str] = []

    class Phases:
        def observe_forward(self, phase: str, batch_size: int, duration_s: float) -> None:
            phases.append(phase)

    prompt, long_prompt, drafts = list(range(30, 50)), list(range(100, 170)), [7, 8, 9]

    async def main():
        engine = TargetEngine(runner, TargetEngineConfig(max_num_batched_tokens=32))
        engine.observe_forwards(Phases())
        engine.start()
        alone, _, _ = await engine.prefill(prompt, 16)
        await engine.verify(alone, drafts)
        long_alone, long_first, _ = await engine.prefill(long_prompt, 4)
        crowded, _, _ = await engine.prefill(prompt, 16)
        phases.clear()
        (long_crowded, long_first_crowded, _), _ = await asyncio.gather(  # one iteration: see phases
            engine.prefill(long_prompt, 4), engine.verify(crowded, drafts))
        for seq in (alone, long_alone, crowded, long_crowded):
            engine.release(seq)
        await engine.stop()
        return long_first, long_first_crowded

    firsts = asyncio.run(main())
    assert "mixed" in phases  # the verify and a prefill chunk were in one iteration
    verify_key = next(k for k in recorded if k[1:] == tuple(drafts))
    long_key = tuple(long_prompt[64:])  # the last chunk: tokens 64..69 (budget 32)
    for key in (verify_key, long_key):
        first, second = recorded[key]
        assert torch.equal(first, second), f"{key}: max |difference| {(first - second).abs().max()}"
    assert firsts[0] == firsts[1]


def test_a_fused_engine_answers_each_request_once_its_own_forward_is_read_back(model_dirs):
    """--layer-kernels fused: an iteration of a verify and three prompts' prefills is four forwards (the verify,
    then each prompt alone: ModelRunner.forward_groups). Each request is answered once its own forward is read
    back, not after the iteration's last: a burst's first prompt streams its first token after one prefill,
    not after all of them, and a running request is not held up by the burst. The tokens are those of each
    prompt prefilled alone."""
    runner = ModelRunner(RuntimeConfig(model=str(model_dirs["target"]), kv_cache_tokens=2048, layer_kernels="fused",
                                       attention_backend="triton"))
    events: list[str] = []

    class Iterations:
        def observe_forward(self, phase: str, batch_size: int, duration_s: float) -> None:
            events.append(f"{phase} iteration of {batch_size} ends")

    prompts = [list(range(30 + 20 * i, 50 + 20 * i)) for i in range(3)]  # 20 tokens: a forward of its own each

    async def main() -> tuple[list[int], list[int]]:
        engine = TargetEngine(runner)
        engine.observe_forwards(Iterations())
        engine.start()
        running, _, _ = await engine.prefill([5, 6, 7], 16)
        events.clear()

        async def verify() -> None:
            await engine.verify(running, [1, 2])
            events.append("verify answered")

        async def prefill(i: int) -> int:
            seq, first, _ = await engine.prefill(prompts[i], 4)
            events.append(f"prompt {i} answered")
            engine.release(seq)
            return first

        _, *burst = await asyncio.gather(verify(), *(prefill(i) for i in range(3)))
        alone = [await prefill(i) for i in range(3)]
        engine.release(running)
        await engine.stop()
        return burst, alone

    burst, alone = asyncio.run(main())
    assert events[:5] == ["verify answered", "prompt 0 answered", "prompt 1 answered", "mixed iteration of 4 ends",
                          "prompt 2 answered"]
    assert burst == alone


@pytest.mark.parametrize("max_prefills", [0, 1])
def test_one_prefill_an_iteration_lets_a_running_request_verify_between_a_bursts_prompts(model_dirs, max_prefills):
    """--max-prefills-per-iteration 1 (fused kernels: each prompt a forward of its own): a request verifying step after
    step while a burst of three prompts arrives gets its next verify into the iteration after each prompt's, not
    after all three; no iteration holds two prefills. Without the limit the burst's three prefills share the first
    iteration and the request's later verifies wait for all of them. Every token is the same either way."""
    runner = ModelRunner(RuntimeConfig(model=str(model_dirs["target"]), kv_cache_tokens=2048, layer_kernels="fused",
                                       attention_backend="triton"))
    events: list[str] = []
    iterations: list[tuple[str, int]] = []

    class Iterations:
        def observe_forward(self, phase: str, batch_size: int, duration_s: float) -> None:
            iterations.append((phase, batch_size))

    prompts = [list(range(30 + 20 * i, 50 + 20 * i)) for i in range(3)]  # 20 tokens: a forward of its own each

    async def main() -> tuple[tuple, tuple]:
        engine = TargetEngine(runner, TargetEngineConfig(max_prefills_per_iteration=max_prefills))
        engine.observe_forwards(Iterations())
        engine.start()
        running, _, _ = await engine.prefill([5, 6, 7], 16)
        iterations.clear()

        async def verify(seq) -> list[list[int]]:
            committed = []
            for step in range(3):
                verification, _ = await engine.verify(seq, [1, 2])
                committed.append(verification.committed_ids)
                events.append(f"verify {step} answered")
            engine.release(seq)
            return committed

        async def prefill(i: int) -> int:
            seq, first, _ = await engine.prefill(prompts[i], 4)
            events.append(f"prompt {i} answered")
            engine.release(seq)
            return first

        committed, *firsts = await asyncio.gather(verify(running), *(prefill(i) for i in range(3)))
        num_iterations = len(iterations)
        alone = await verify((await engine.prefill([5, 6, 7], 16))[0]), [await prefill(i) for i in range(3)]
        del iterations[num_iterations:], events[-6:]
        await engine.stop()
        return (committed, firsts), alone

    together, alone = asyncio.run(main())
    prefilling = [size - (phase == "mixed") for phase, size in iterations if phase != "verify"]  # one verify each
    if max_prefills:
        assert prefilling == [1, 1, 1]
        assert events.index("verify 2 answered") < events.index("prompt 2 answered")
    else:
        assert prefilling == [3]
        assert events.index("verify 1 answered") > events.index("prompt 2 answered")
    assert together == alone  # the same tokens as each request's own, one at a time


def test_a_prompt_cancelled_while_waiting_its_prefill_turn_leaves_no_kv_and_no_turn_taken(model_dirs):
    """--max-prefills-per-iteration 1: a request dropped while another prompt prefills gives its KV blocks back, and
    the prompt after it still gets its turn; the prompts waiting for their turn count as waiting sequences."""
    async def main() -> tuple[list[int], dict]:
        engine = TargetEngine(_runner(model_dirs["target"]), TargetEngineConfig(max_prefills_per_iteration=1))
        engine.start()
        first, dropped, last = (asyncio.create_task(engine.prefill(p, 8)) for p in PROMPTS[1:])
        await asyncio.sleep(0)  # all three admitted; the first holds the turn, the others wait for it
        waiting = [engine.stats()["num_waiting_sequences"]]
        dropped.cancel()
        await asyncio.sleep(0)
        waiting.append(engine.stats()["num_waiting_sequences"])
        for seq, _, _ in [await first, await last]:
            engine.release(seq)
        await engine.stop()
        return waiting, engine.stats()

    waiting, stats = asyncio.run(main())
    assert waiting == [2, 1]
    assert stats["num_kv_blocks_used"] == 0 and stats["num_active_sequences"] == 0
    assert stats["num_sequences_started"] == 3 and stats["num_waiting_sequences"] == 0


def test_prompts_waiting_their_prefill_turn_when_the_engine_stops_fail_as_unavailable_not_hang(model_dirs):
    """--max-prefills-per-iteration 1 and a stop (a shutdown, or a replaced model) while one prompt prefills and two
    wait their turn: each of the three fails with UNAVAILABLE (the gateway moves the request on), none waits on."""
    async def main() -> tuple[list, dict]:
        engine = TargetEngine(_runner(model_dirs["target"]), TargetEngineConfig(max_prefills_per_iteration=1))
        engine.start()
        prefills = [asyncio.create_task(engine.prefill(p, 8)) for p in PROMPTS[1:]]
        await asyncio.sleep(0)  # the first holds the turn, the others wait for it
        await engine.stop()
        results = await asyncio.wait_for(asyncio.gather(*prefills, return_exceptions=True), 30)
        return results, engine.stats()

    results, stats = asyncio.run(main())
    assert [type(r) for r in results] == [ServiceUnavailableError] * 3
    assert stats["num_active_sequences"] == 0 and stats["num_waiting_sequences"] == 0
