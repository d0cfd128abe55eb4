"""Busy polling in the running trio: each service's loop polls while its streams are open, lets go
when they end (finished or cancelled), and the output is the target's own."""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import channel, generate

from draft_service.registry import DraftRegistry
from draft_service.server import start_draft_server
from engine.model_drafter import ModelDrafter
from engine.model_runner import ModelRunner, RuntimeConfig
from gateway.config import GatewayConfig
from gateway.server import start_gateway_server
from specdec import busy_poll
from specdec.v1 import gateway_pb2, gateway_pb2_grpc
from target_service.server import start_target_server


@pytest.fixture(scope="module")
def polling_trio(loop, model_dirs):
    """All three services polling on the one loop of this process, beside the CPU models' torch threads:
    a setting `auto` never picks (it polls for CUDA models only) and the services never share (a process
    each). Each torch op's return to Python waits for the GIL the spinning loop keeps taking back, up to
    the switch interval (5 ms); a 24-token stream took 15-67 s on the 2-core CI machine, against a 60 s
    deadline. A 0.5 ms interval for these tests bounds that wait as a loop of its own would."""
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    # the model services keep warm too (specdec/busy_poll.py): their rehearsals run beside real streams
    keep_warm = os.environ.get(busy_poll.KEEP_WARM_ENV)
    os.environ[busy_poll.KEEP_WARM_ENV] = "1"
    runner = lambda name: ModelRunner(RuntimeConfig(model=str(model_dirs[name]), kv_cache_tokens=4096))  # noqa: E731
    target = loop.run(start_target_server(runner("target"), busy_poll=True))
    draft = loop.run(start_draft_server(DraftRegistry.of(ModelDrafter(runner("perturbed"))), busy_poll=True))
    gateway = loop.run(start_gateway_server(
        GatewayConfig(f"127.0.0.1:{target.port}", f"127.0.0.1:{draft.port}"), http_port=0, busy_poll="on"))
    yield {"gateway": gateway, "target": target, "draft": draft}
    for server in (gateway, draft, target):
        loop.run(server.stop())
    sys.setswitchinterval(switch_interval)
    if keep_warm is None:
        os.environ.pop(busy_poll.KEEP_WARM_ENV)
    else:
        os.environ[busy_poll.KEEP_WARM_ENV] = keep_warm


def _holders(trio) -> dict[str, int]:
    return {name: server.busy_poll.num_holders for name, server in trio.items()}


def _wait_released(trio, timeout_s: float = 10) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while any(_holders(trio).values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _holders(trio)


def test_every_service_polls_during_a_stream_and_stops_after_it(polling_trio):
    request = {"prompt": "The quick brown fox", "max_new_tokens": 24, "num_draft_tokens": 3, "ignore_eos": True}
    polls = {name: server.busy_poll.num_polls for name, server in polling_trio.items()}
    with channel(polling_trio["gateway"].port) as c:
        stream = gateway_pb2_grpc.GatewayStub(c).Generate(gateway_pb2.GenerateRequest(**request), timeout=60)
        next(stream)  # the first token; the draft's stream opens once it is in
        next(stream)  # a step's tokens: its proposal came through the draft's stream, every stream is open
        during = _holders(polling_trio)
        for _ in stream:
            pass
    assert during == {"gateway": 1, "target": 1, "draft": 1}
    assert all(server.busy_poll.num_polls > polls[name] for name, server in polling_trio.items())
    # every service rehearsed its step while polling (none failed: a failure drops the rehearsal)
    assert all(server.busy_poll.num_rehearsals > 0 and server.busy_poll.rehearse is not None
               for server in polling_trio.values())
    assert _wait_released(polling_trio) == {"gateway": 0, "target": 0, "draft": 0}


def test_an_openai_http_stream_polls_as_a_grpc_one_does(polling_trio):
    gateway = polling_trio["gateway"]
    with openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=24, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        during = _holders(polling_trio)
        for _ in stream:
            pass
    assert during == {"gateway": 1, "target": 1, "draft": 1}
    assert _wait_released(polling_trio) == {"gateway": 0, "target": 0, "draft": 0}


def test_the_output_is_the_targets_own_while_polling(polling_trio, gateway_stub):
    request = {"prompt": "Once upon a time", "max_new_tokens": 24, "num_draft_tokens": 3, "ignore_eos": True}
    target_only, _, _ = generate(gateway_stub("none"), **request)  # the session's target, not polling
    with channel(polling_trio["gateway"].port) as c:
        token_ids, _, final = generate(gateway_pb2_grpc.GatewayStub(c), **request)
    assert token_ids == target_only
    assert final.stats.num_accepted_tokens > 0  # the draft took part


@pytest.mark.parametrize(("mode", "polls"), [("auto", False), ("on", True)])
def test_a_gateway_polls_on_auto_only_for_a_target_on_cuda(loop, target_server, monkeypatch, mode, polls):
    """The session's target runs on the CPU: auto leaves a gateway in front of it asleep, even on a
    host of many cores."""
    if os.environ.get("SPECDEC_TEST_DEVICE", "cpu") != "cpu":
        pytest.skip("the session's target runs on the CPU only by default")
    monkeypatch.setattr(busy_poll.os, "cpu_count", lambda: 64)
    gateway = loop.run(start_gateway_server(GatewayConfig(f"127.0.0.1:{target_server.port}", None), busy_poll=mode))
    try:
        assert (gateway.busy_poll is not None) is polls
    finally:
        loop.run(gateway.stop())


def test_a_health_watch_left_open_does_not_make_an_idle_service_poll(polling_trio):
    """Watch is a server stream like Generate, but a monitor may hold it open for good."""
    with channel(polling_trio["target"].port) as c:
        watch = health_pb2_grpc.HealthStub(c).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        held = _holders(polling_trio)["target"]
        watch.cancel()
    assert held == 0


def test_a_cancelled_stream_lets_go_of_every_poll(polling_trio):
    request = gateway_pb2.GenerateRequest(prompt="Hello there", max_new_tokens=200, num_draft_tokens=3, ignore_eos=True)
    with channel(polling_trio["gateway"].port) as c:
        stream = gateway_pb2_grpc.GatewayStub(c).Generate(request, timeout=60)
        next(stream)
        stream.cancel()
    assert _wait_released(polling_trio) == {"gateway": 0, "target": 0, "draft": 0}


def test_eight_concurrent_streams_let_go_of_every_poll_when_they_end(polling_trio):
    """A poll held past its stream keeps a service from polling for the lone streams that follow."""
    requests = [gateway_pb2.GenerateRequest(prompt=f"Story {i}:", max_new_tokens=16, num_draft_tokens=3,
                                            ignore_eos=True) for i in range(8)]
    with channel(polling_trio["gateway"].port) as c, ThreadPoolExecutor(8) as pool:
        stub = gateway_pb2_grpc.GatewayStub(c)
        list(pool.map(lambda r: list(stub.Generate(r, timeout=120)), requests))
    assert _wait_released(polling_trio) == {"gateway": 0, "target": 0, "draft": 0}
