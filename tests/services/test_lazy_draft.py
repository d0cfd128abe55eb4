"""A request at k = 0 leaves the draft service alone: its draft sequence is opened by the first step
that drafts, prefilled with the prompt and everything committed so far in one catch-up, and freed at
the end like any other. Counted on the draft service itself (its engine stats), real servers."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from harness import channel, generate

from engine.sampling import SamplingParams
from gateway.backends import Backends, RequestStreams
from gateway.config import GatewayConfig
from gateway.lazy_draft import LazyDraft
from gateway.server import start_gateway_server
from gateway.speculative_loop import speculative_generate
from specdec.v1 import common_pb2, gateway_pb2_grpc

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Speculative decoding is"]


def _draft_stats(draft_stub) -> common_pb2.EngineStats:
    return draft_stub.GetEngineStats(common_pb2.EngineStatsRequest())


def _wait_draft_idle(draft_stub, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while (stats := _draft_stats(draft_stub)).num_active_sequences or stats.num_kv_blocks_used:
        assert time.monotonic() < deadline, f"the draft kept a sequence: {stats}"
        time.sleep(0.05)


async def _backends(target_port: int, draft_port: int) -> Backends:
    return Backends(f"127.0.0.1:{target_port}", f"127.0.0.1:{draft_port}")  # its channels belong to the loop


def test_late_opened_draft_catches_up_on_everything_committed(loop, target_server, draft_servers, draft_stub,
                                                              tokenizer, hf_greedy):
    prompt_ids = tokenizer.encode("The quick brown fox")
    expected = hf_greedy(prompt_ids, 20)
    assert len(expected) >= 13
    identical = draft_stub("identical")  # the target's own weights: a right catch-up proposes its next tokens
    before = _draft_stats(identical)

    backends = loop.run(_backends(target_server.port, draft_servers["identical"].port))
    streams = RequestStreams(backends, "", use_draft=True, timeout_s=60)
    draft = LazyDraft(streams, prompt_ids, 20, SamplingParams())
    try:
        for token_id in expected[:10]:  # ten steps at k = 0: nothing reaches the draft service
            draft.commit([token_id])
        num_started_while_off = _draft_stats(identical).num_sequences_started
        proposed = loop.run(draft.propose(3)).token_ids
    finally:
        loop.run(streams.close())
        loop.run(backends.close())
    assert num_started_while_off == before.num_sequences_started
    assert proposed == expected[10:13]
    after = _draft_stats(identical)
    assert after.num_sequences_started == before.num_sequences_started + 1
    _wait_draft_idle(identical)


def test_open_draft_catches_up_after_steps_off(loop, target_server, draft_servers, draft_stub, tokenizer,
                                               hf_greedy):
    """Drafting, then steps at k = 0 (the policy switched off), then a probe: the draft first drops
    its rejected tokens and appends everything committed meanwhile, so it proposes the right tokens."""
    prompt_ids = tokenizer.encode("The quick brown fox")
    expected = hf_greedy(prompt_ids, 24)
    assert len(expected) >= 16
    backends = loop.run(_backends(target_server.port, draft_servers["identical"].port))
    streams = RequestStreams(backends, "", use_draft=True, timeout_s=60)
    draft = LazyDraft(streams, prompt_ids, 24, SamplingParams())
    try:
        loop.run(draft.open())
        draft.commit(expected[:1])  # the target's prefill token
        assert loop.run(draft.propose(2)).token_ids == expected[1:3]
        draft.commit([expected[1], 7], num_accepted=1)  # the second draft token rejected: the target said 7
        for token_id in (8, 9, 10):  # steps at k = 0 (the target's tokens, whatever they are)
            draft.commit([token_id])
        context = prompt_ids + expected[:2] + [7, 8, 9, 10]
        assert loop.run(draft.propose(3)).token_ids == hf_greedy(context, 3)
    finally:
        loop.run(streams.close())
        loop.run(backends.close())
    _wait_draft_idle(draft_stub("identical"))


def test_request_at_k0_makes_no_draft_calls_and_a_later_probe_keeps_output_identical(
        loop, target_server, draft_servers, draft_stub, gateway_stub):
    """A fresh gateway learns that the unrelated draft loses; its later requests start at k = 0, and
    the shared probe schedule has one of them try k = 1 now and then."""
    config = GatewayConfig(f"127.0.0.1:{target_server.port}", f"127.0.0.1:{draft_servers['unrelated'].port}")
    server = loop.run(start_gateway_server(config))
    unrelated = draft_stub("unrelated")
    try:
        with channel(server.port) as c:
            stub = gateway_pb2_grpc.GatewayStub(c)
            generate(stub, prompt=PROMPTS[0], max_new_tokens=64)  # explores, learns that the draft loses
            seen_off = seen_probe = False
            for i in range(30):
                if seen_off and seen_probe:
                    break
                prompt = PROMPTS[i % len(PROMPTS)]
                before = _draft_stats(unrelated)
                tokens, _, final = generate(stub, prompt=prompt, max_new_tokens=24)  # k left to the policy
                after = _draft_stats(unrelated)
                assert tokens == generate(gateway_stub("none"), prompt=prompt, max_new_tokens=24)[0]
                by_k = list(final.stats.num_steps_by_k)
                if len(by_k) == 1:  # every step at k = 0: the draft service never heard of the request
                    seen_off = True
                    assert final.stats.num_draft_tokens == 0 and final.stats.draft_forward_s == 0
                    assert after.num_sequences_started == before.num_sequences_started
                    assert after.num_forwards == before.num_forwards
                elif by_k[0] > 0:  # off, then a probe: opened late, once
                    seen_probe = True
                    assert after.num_sequences_started == before.num_sequences_started + 1
                _wait_draft_idle(unrelated)
            assert seen_off and seen_probe
    finally:
        loop.run(server.stop())



def test_a_request_of_two_new_tokens_or_fewer_leaves_the_draft_alone(gateway_stub, draft_stub, hf_greedy, tokenizer):
    """The prefill gives the first token and a verify commits up to k + 1: no step could draft."""
    perturbed = draft_stub("perturbed")
    before = _draft_stats(perturbed).num_sequences_started
    for max_new in (1, 2):
        tokens, _, final = generate(gateway_stub("perturbed"), prompt=PROMPTS[0], max_new_tokens=max_new,
                                    num_draft_tokens=3)
        assert tokens == hf_greedy(tokenizer.encode(PROMPTS[0]), max_new)
        assert final.stats.draft_prefill_forward_s == 0
    assert _draft_stats(perturbed).num_sequences_started == before


class _OrderedStreams(RequestStreams):
    """The request's real streams, noting when the draft's is opened and when the target's first token is in."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[str] = []

    def open_target(self):
        stream = super().open_target()
        prefill = stream.prefill

        async def noted(*args, **kwargs) -> int:
            token_id = await prefill(*args, **kwargs)
            self.events.append("first token")
            return token_id

        stream.prefill = noted
        return stream

    def open_draft(self):
        self.events.append("draft opened")
        return super().open_draft()


@pytest.mark.parametrize("with_prefill, draft_model, expected", [
    (True, "", ["beside", "beside"]), (False, "", ["after", "after"]), (False, "default", ["beside", "after"])],
    ids=["beside-the-prefill", "after-the-first-token", "a-new-draft-name-beside-then-after"])
def test_the_draft_opens_beside_the_target_prefill_or_after_the_first_token_and_output_is_identical(
        loop, target_server, draft_servers, draft_stub, tokenizer, hf_greedy, with_prefill, draft_model, expected):
    """By default a request's draft opens once the first token is in (on hardware the services share, the target's
    prefill runs alone); --draft-opens-with-prefill: beside it. A draft name no request has opened yet opens beside
    the prefill (an unknown name is NOT_FOUND before the first token), after it once the draft service took it."""
    prompt_ids = tokenizer.encode(PROMPTS[2])

    async def run():
        backends = Backends(f"127.0.0.1:{target_server.port}", f"127.0.0.1:{draft_servers['identical'].port}",
                            draft_opens_with_prefill=with_prefill)
        orders, outputs = [], []
        try:
            for _ in range(2):
                streams = _OrderedStreams(backends, draft_model, use_draft=True, timeout_s=60)
                try:
                    steps = [step async for step in speculative_generate(prompt_ids, 16, 3, streams)]
                finally:
                    await streams.close()
                orders.append("beside" if streams.events == ["draft opened", "first token"] else
                              "after" if streams.events == ["first token", "draft opened"] else str(streams.events))
                outputs.append(([t for step in steps for t in step.committed_ids],
                                sum(step.num_accepted for step in steps)))
        finally:
            await backends.close()
        return orders, outputs

    orders, outputs = loop.run(run())
    assert orders == expected
    for token_ids, num_accepted in outputs:
        assert token_ids == hf_greedy(prompt_ids, 16)
        assert num_accepted > 0  # the draft (the target's weights) took part
    _wait_draft_idle(draft_stub("identical"))


class _SlowDraftStreams(_OrderedStreams):
    """The request's real streams, the draft's start sent only once the target's first token is in (a draft
    slower than the target's prefill, as beside a GPU target), noting when the draft's answer is in."""

    def open_draft(self):
        stream = super().open_draft()
        start = stream.start

        async def late(*args, **kwargs):
            while "first token" not in self.events:
                await asyncio.sleep(0.005)
            try:
                return await start(*args, **kwargs)
            finally:
                self.events.append("draft answered")

        stream.start = late
        return stream


def test_an_unknown_draft_name_fails_before_the_first_token_even_when_the_target_answers_first(
        loop, target_server, draft_servers, draft_stub, tokenizer):
    """A draft name no request has opened may be unknown to the draft service: its request's first token waits
    for the draft's start, so NOT_FOUND comes before any token, whichever service answers first."""
    prompt_ids = tokenizer.encode(PROMPTS[0])

    async def run():
        backends = Backends(f"127.0.0.1:{target_server.port}", f"127.0.0.1:{draft_servers['identical'].port}")
        streams = _SlowDraftStreams(backends, "nowhere", use_draft=True, timeout_s=60)
        steps = []
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for step in speculative_generate(prompt_ids, 16, 3, streams):
                    steps.append(step)
        finally:
            await streams.close()
            await backends.close()
        return steps, info.value, streams.events

    steps, error, events = loop.run(run())
    assert error.code() == grpc.StatusCode.NOT_FOUND and "nowhere" in error.details()
    assert events == ["draft opened", "first token", "draft answered"]  # the target's prefill came first
    assert steps == []
    _wait_draft_idle(draft_stub("identical"))
