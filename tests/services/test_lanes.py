"""Lane streams: many requests' sequences on one stream to a model service (specdec/lane_server.py,
gateway/lanes.py). Real services on loopback; every sequence must behave as on a Sequence stream of
its own - same answers, same errors ending only it, state freed by close or by the lane's end - and
the answers of one batched forward come back in one message."""
from __future__ import annotations

import asyncio
import queue
import time

import grpc
import pytest
from harness import channel, generate

from engine.sampling import SamplingParams
from gateway.backends import Backends, Proposal, RequestStreams
from gateway.config import GatewayConfig
from gateway.lanes import count_replicas
from gateway.server import start_gateway_server
from specdec.v1 import common_pb2, gateway_pb2_grpc, target_pb2

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Speculative decoding is", "Große Straße"]


class _LaneClient:
    """A raw Lane stream: send a message of commands, read messages of answers."""

    def __init__(self, stub) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = stub.Lane(iter(self._requests.get, None), timeout=60)

    def send(self, *commands: target_pb2.TargetLaneCommand) -> None:
        self._requests.put(target_pb2.TargetLaneRequest(commands=commands))

    def read(self) -> target_pb2.TargetLaneResponse:
        return next(self._responses)

    def answers(self, count: int) -> dict[int, target_pb2.TargetLaneAnswer]:
        """The next `count` answers (from as many messages as they come in), by sequence."""
        answers = {}
        while len(answers) < count:
            answers.update({a.sequence: a for a in self.read().answers})
        return answers

    def cancel(self) -> None:
        self._responses.cancel()


def _prefill(sequence: int, prompt_ids: list[int], max_new_tokens: int = 16, **fields) -> target_pb2.TargetLaneCommand:
    command = target_pb2.PrefillCommand(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens)
    return target_pb2.TargetLaneCommand(sequence=sequence, request=target_pb2.TargetRequest(prefill=command), **fields)


def _verify(sequence: int, draft_ids: list[int] = ()) -> target_pb2.TargetLaneCommand:
    command = target_pb2.VerifyCommand(draft_ids=draft_ids)
    return target_pb2.TargetLaneCommand(sequence=sequence, request=target_pb2.TargetRequest(verify=command))


def _wait_for_sequences(stub, count: int, timeout_s: float = 10) -> common_pb2.EngineStats:
    deadline = time.monotonic() + timeout_s
    while (stats := stub.GetEngineStats(common_pb2.EngineStatsRequest())).num_active_sequences != count:
        assert time.monotonic() < deadline, f"expected {count} active sequences: {stats}"
        time.sleep(0.05)
    return stats


def test_sequences_of_one_lane_decode_as_alone_and_one_forward_answers_in_one_message(target_stub, tokenizer,
                                                                                     hf_greedy):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    lane = _LaneClient(target_stub)
    try:
        lane.send(*[_prefill(i, ids) for i, ids in enumerate(prompts)])
        tokens = {i: [a.response.prefill.token_id] for i, a in lane.answers(len(prompts)).items()}
        for _ in range(5):  # plain decode steps of all four, each step's commands in one message
            lane.send(*[_verify(i) for i in range(len(prompts))])
            response = lane.read()
            assert sorted(a.sequence for a in response.answers) == list(range(len(prompts)))  # one batch, one message
            assert all(a.response.batch_size == len(prompts) for a in response.answers)
            for answer in response.answers:
                tokens[answer.sequence] += answer.response.verify.committed_ids
        assert [tokens[i] for i in range(len(prompts))] == [hf_greedy(ids, 6) for ids in prompts]

        lane.send(target_pb2.TargetLaneCommand(sequence=0, close=True),
                  target_pb2.TargetLaneCommand(sequence=2, close=True))
        _wait_for_sequences(target_stub, 2)  # closed sequences are freed, the others stay
        lane.send(_verify(1))
        assert [a.sequence for a in lane.read().answers] == [1]
    finally:
        lane.cancel()
    stats = _wait_for_sequences(target_stub, 0)  # the lane's end frees what it still held
    assert stats.num_kv_blocks_used == 0


def test_a_bad_command_fails_only_its_own_sequence(target_stub, tokenizer, hf_greedy):
    prompt_ids = tokenizer.encode(PROMPTS[0])
    lane = _LaneClient(target_stub)
    try:
        lane.send(_verify(7),  # a verify before any prefill
                  _prefill(8, prompt_ids, request_id="has spaces"),
                  _prefill(9, prompt_ids, max_new_tokens=10**9),  # cannot fit the context
                  _prefill(10, prompt_ids, request_id="req-ok"))
        answers = lane.answers(4)
        assert answers[7].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "unexpected verify command" in answers[7].error.message
        assert answers[8].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "x-request-id" in answers[8].error.message
        assert answers[9].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "max_new_tokens" in answers[9].error.message
        assert not answers[10].HasField("error")
        lane.send(_verify(10))  # the lane and its good sequence go on
        committed = list(lane.read().answers[0].response.verify.committed_ids)
        assert [answers[10].response.prefill.token_id, *committed] == hf_greedy(prompt_ids, 2)
        _wait_for_sequences(target_stub, 1)  # only the good one holds state
    finally:
        lane.cancel()
    _wait_for_sequences(target_stub, 0)


async def _backends(target_port: int, lanes: int, lane_max_age_s: float = 60.0) -> Backends:
    return Backends(f"127.0.0.1:{target_port}", None, lanes=lanes, lane_max_age_s=lane_max_age_s)


def test_requests_share_the_pools_lanes_and_a_retired_lane_closes_after_its_last_sequence(loop, target_server,
                                                                                        target_stub, tokenizer,
                                                                                        hf_greedy):
    prompt_ids = tokenizer.encode(PROMPTS[1])
    expected = hf_greedy(prompt_ids, 3)

    async def decode(streams: RequestStreams) -> list[int]:
        target = streams.open_target()
        tokens = [await target.prefill(prompt_ids, 8, SamplingParams())]
        for _ in range(2):
            tokens += (await target.verify(Proposal([], []))).committed_ids
        return tokens

    async def scenario() -> None:
        backends = await _backends(target_server.port, lanes=1, lane_max_age_s=0.2)
        first, second = (RequestStreams(backends, "", use_draft=False, timeout_s=60) for _ in range(2))
        try:
            assert await decode(first) == expected
            assert await decode(second) == expected
            lanes = backends._target_lanes._lanes
            assert len(lanes) == 1 and lanes[0].num_sequences == 2  # both requests on the one lane
            old = lanes[0]
            await asyncio.sleep(0.3)  # past the lane's age: the next request opens a new lane
            third = RequestStreams(backends, "", use_draft=False, timeout_s=60)
            assert await decode(third) == expected
            assert backends._target_lanes._lanes != [old] and old.failure is None  # retired, still serving
            await first.close()
            await second.close()
            await asyncio.sleep(0.2)
            assert old.failure is not None  # closed with its last sequence
            await third.close()
        finally:
            await backends.close()

    loop.run(scenario())
    _wait_for_sequences(target_stub, 0)


@pytest.fixture(scope="module")
def stream_per_request_stub(loop, target_server, draft_servers):
    """A gateway that opens a Sequence stream per request (--lanes 0), the protocol before lanes."""
    config = GatewayConfig(f"127.0.0.1:{target_server.port}", f"127.0.0.1:{draft_servers['perturbed'].port}",
                           lanes=0)
    server = loop.run(start_gateway_server(config))
    with channel(server.port) as c:
        yield gateway_pb2_grpc.GatewayStub(c)
    loop.run(server.stop())


@pytest.mark.parametrize("k", [0, 3])
def test_stream_per_request_and_lanes_give_the_same_greedy_output(k, stream_per_request_stub, gateway_stub):
    for prompt in PROMPTS:
        fields = dict(prompt=prompt, max_new_tokens=12, num_draft_tokens=k)
        assert generate(stream_per_request_stub, **fields)[0] == generate(gateway_stub(), **fields)[0]


def test_replicas_are_counted_from_the_address():
    assert count_replicas("ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.1:3") == 3
    assert count_replicas("127.0.0.1:50052") == 1
    assert count_replicas("dns:///127.0.0.1:50052") == 1
    assert count_replicas("unix:/tmp/socket") == 1
    assert count_replicas("no-such-host.invalid:1") == 1  # unresolvable now: one lane until it resolves
