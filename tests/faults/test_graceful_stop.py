"""A service stopped by SIGTERM (a rolling restart, a scale-down) refuses new requests and lets the
running ones finish where they are (--shutdown-grace-s); a second signal ends them at once."""
from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
from harness import channel, free_port, generate, start_streaming

from specdec.client import collect
from specdec.processes import Replica
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("replicas_up")]  # starts service processes
PROMPT = "Speculative decoding: a draft proposes, the target verifies."
# 2000 took ~34-40 s on the 2-vCPU VM by 2026-12-06 (5 s when written), past a target's default 30 s grace, so
# the stopped target cut its stream (1000: 20 s); 800: well inside that grace, longer than a short grace allows
MAX_NEW_TOKENS = 800


@pytest.fixture(scope="module")
def reference(cluster, cluster_gateway) -> list[int]:
    cluster.ensure_running()
    token_ids, _, _ = generate(cluster_gateway, prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=0,
                               ignore_eos=True)
    assert len(token_ids) == MAX_NEW_TOKENS
    return token_ids


@pytest.fixture
def gateway_process(cluster, tmp_path):
    """A gateway of its own, as a process (the CLI: its signal handling is what is tested), with the OpenAI
    HTTP API on `http_port`."""
    http_port = free_port()
    gateway = Replica("gateway", "gateway", [
        "--target", cluster.target_pool, "--draft", cluster.draft_pool, "--shutdown-grace-s", "60",
        "--http-port", str(http_port), "--served-model-name", "graceful"], tmp_path)
    gateway.start()
    gateway.http_port = http_port
    yield gateway
    gateway.stop()


def _start(stub):
    return start_streaming(stub, prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, num_draft_tokens=3)


def test_a_target_stopped_mid_request_finishes_it_there_while_new_requests_go_elsewhere(cluster, cluster_gateway,
                                                                                         reference):
    call, received = _start(cluster_gateway)
    stopped = cluster.holder(cluster.targets)
    survivor = next(t for t in cluster.targets if t is not stopped)
    started_before = survivor.engine_stats().num_sequences_started
    stopped.process.terminate()  # SIGTERM
    time.sleep(0.5)  # its health says NOT_SERVING, and its connections are going away
    short, _, _ = generate(cluster_gateway, prompt="A new request", max_new_tokens=8, num_draft_tokens=0)
    rest = collect(call)
    assert received + rest.token_ids == reference
    assert len(short) == 8
    # the survivor started the new request alone: the running one was not moved (re-prefilled) there
    assert survivor.engine_stats().num_sequences_started == started_before + 1
    assert stopped.process.wait(30) == 0  # it exits once its streams have ended, well within its grace


def test_a_gateway_stopped_mid_stream_finishes_it_and_refuses_new_ones(gateway_process, reference):
    with channel(gateway_process.port) as c:
        stub = gateway_pb2_grpc.GatewayStub(c)
        call, received = _start(stub)
        gateway_process.process.terminate()
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, prompt="A new request", max_new_tokens=8)
        rest = collect(call)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert received + rest.token_ids == reference
    assert rest.final.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert gateway_process.process.wait(30) == 0


def test_a_gateway_stopped_mid_http_stream_finishes_it(gateway_process, reference):
    body = {"model": "graceful", "prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "stream": True,
            "temperature": 0}
    request = urllib.request.Request(f"http://127.0.0.1:{gateway_process.http_port}/v1/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        events = [response.readline() for _ in range(20)]  # some chunks in: the stream is running
        gateway_process.process.terminate()
        events += response.readlines()
    data = [line[len(b"data: "):].strip() for line in events if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert gateway_process.process.wait(30) == 0


def test_a_second_signal_ends_the_running_streams_at_once(cluster, gateway_process, reference):
    with channel(gateway_process.port) as c:
        call, received = _start(gateway_pb2_grpc.GatewayStub(c))
        gateway_process.process.terminate()
        time.sleep(0.5)
        gateway_process.process.terminate()
        with pytest.raises(grpc.RpcError) as ended:
            for chunk in call:
                received += chunk.token_ids
    assert ended.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert received == reference[:len(received)] and len(received) < len(reference)
    assert gateway_process.process.wait(10) == 0
    cluster.wait_idle()  # the model services freed the ended request's sequences
