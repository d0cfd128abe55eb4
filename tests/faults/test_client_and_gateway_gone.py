"""When the client goes (cancel, disconnect, deadline) or the gateway dies, both model streams end
and every KV block goes back to the pool on both services."""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from contextlib import aclosing

import grpc
import pytest
from harness import generate, mid_stream_deadline_s
from transformers import PreTrainedTokenizerBase

from gateway.backends import Backends
from gateway.config import GatewayConfig
from gateway.driver import Driver
from gateway.metrics import GatewayMetrics
from gateway.request import GenerationParams
from specdec.processes import Replica
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("replicas_up")]  # starts service processes
PROMPT = "The quick brown fox jumps over the lazy dog."
REQUEST = {"prompt": PROMPT, "max_new_tokens": 1500, "num_draft_tokens": 3}
# A client process that streams one long request and prints each chunk's token count as it comes.
CLIENT = """
import sys, grpc
from specdec.processes import Replica
from specdec.v1 import gateway_pb2, gateway_pb2_grpc
stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(sys.argv[1]))
for chunk in stub.Generate(gateway_pb2.GenerateRequest(prompt=sys.argv[2], max_new_tokens=1500, num_draft_tokens=3)):
    print(len(chunk.token_ids), flush=True)
"""


def _wait_holding(cluster) -> None:
    """Until one target and one draft hold the request's sequence."""
    deadline = time.monotonic() + 30
    while True:
        holding = [r for r in cluster.replicas if r.engine_stats().num_kv_blocks_used > 0]
        if len(holding) == 2:
            return
        assert time.monotonic() < deadline, "the request never held KV on both services"
        time.sleep(0.02)


def test_client_cancel_frees_kv_on_both_services(cluster, cluster_gateway):
    call = cluster_gateway.Generate(gateway_pb2.GenerateRequest(**REQUEST), timeout=300)
    next(call)
    _wait_holding(cluster)
    call.cancel()
    cluster.wait_idle()


def test_client_deadline_frees_kv_on_both_services(cluster, cluster_gateway):
    # not a fixed 1 s: on a GPU the whole request can end sooner
    deadline_s = mid_stream_deadline_s(cluster_gateway, **REQUEST)
    cluster.wait_idle()
    call = cluster_gateway.Generate(gateway_pb2.GenerateRequest(**REQUEST), timeout=deadline_s)
    next(call)
    _wait_holding(cluster)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cluster.wait_idle()


def test_a_deadline_that_ends_a_hung_drafts_stream_ends_the_request_as_a_deadline_not_a_lost_draft(
        loop, cluster, caplog):
    # A driver of our own, without a gRPC client whose deadline would cancel it first: the request's deadline
    # reaches the model streams alone, and the first to end is the draft's (both drafts hang: SIGSTOP).
    config = GatewayConfig(target_address=cluster.target_pool, draft_address=cluster.draft_pool,
                           default_num_draft_tokens=3, connect_timeout_s=60)

    async def connected() -> tuple[Backends, PreTrainedTokenizerBase]:  # its channels: the driver's loop's
        backends = Backends.for_config(config)
        return backends, await backends.connect(config.connect_timeout_s)

    backends, tokenizer = loop.run(connected())
    metrics = GatewayMetrics()
    driver = Driver(config, backends, tokenizer, metrics, None)
    params = GenerationParams(tokenizer(PROMPT).input_ids, REQUEST["max_new_tokens"],
                              REQUEST["num_draft_tokens"], [])

    async def generate_until_the_deadline() -> None:
        async with aclosing(driver.generate(params, "grpc", timeout_s=2.0)) as deltas:
            async for _ in deltas:
                pass

    for draft in cluster.drafts:
        draft.pause()
    try:
        with caplog.at_level(logging.WARNING, logger="gateway"), pytest.raises(grpc.aio.AioRpcError) as info:
            loop.run(generate_until_the_deadline())
    finally:
        for draft in cluster.drafts:
            draft.resume()
        loop.run(backends.close())
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not [r for r in caplog.records if "lost the draft" in r.getMessage()]  # the draft was not at fault
    outcomes = {s.labels["outcome"]: s.value for m in metrics.registry.collect() for s in m.samples
                if s.name == "specdec_gateway_requests_total"}
    assert outcomes == {"cancelled": 1.0}
    cluster.wait_idle()


def test_client_process_killed_mid_stream_frees_kv_on_both_services(cluster, cluster_gateway_port):
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{cluster_gateway_port}", PROMPT],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip()  # it is streaming
        _wait_holding(cluster)
        client.kill()  # the connection just breaks
    finally:
        client.kill()
        client.wait(30)
    cluster.wait_idle()


def test_gateway_killed_mid_request_frees_its_sequences_and_a_new_gateway_serves(cluster, tmp_path):
    args = ["--target", cluster.target_pool, "--draft", cluster.draft_pool]
    gateway = Replica("gateway", "gateway", args, tmp_path)
    try:
        gateway.start()
        with grpc.insecure_channel(gateway.address) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(**REQUEST), timeout=300)
            next(call)
            _wait_holding(cluster)
            gateway.kill()  # SIGKILL: the model services see the streams' connection break
            with pytest.raises(grpc.RpcError):
                list(call)
        cluster.wait_idle()
        gateway.start()  # the restarted gateway (same port) serves as before
        with grpc.insecure_channel(gateway.address) as channel:
            token_ids, _, final = generate(gateway_pb2_grpc.GatewayStub(channel), prompt=PROMPT, max_new_tokens=16)
        assert len(token_ids) == final.stats.num_completion_tokens == 16
    finally:
        gateway.stop()
    cluster.wait_idle()
