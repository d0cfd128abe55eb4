"""A client that stops reading its stream (connected, its flow-control window full) is dropped after
--stream-stall-timeout-s: its request is cancelled and both model services free its sequence, where it
held a slot and KV blocks until its deadline, or forever. Real servers; the client's stream window kept
small (no BDP probing) so the gateway's writes block after a few hundred bytes."""
from __future__ import annotations

import time

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.server import start_gateway_server
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

STALL_TIMEOUT_S = 1.0
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture
def stall_gateway(loop, target_server, draft_servers):
    config = GatewayConfig(f"127.0.0.1:{target_server.port}", f"127.0.0.1:{draft_servers['perturbed'].port}",
                           stream_stall_timeout_s=STALL_TIMEOUT_S)
    server = loop.run(start_gateway_server(config))
    yield server
    loop.run(server.stop())


def _sequences(stub) -> int:
    stats = stub.GetEngineStats(common_pb2.EngineStatsRequest())
    return stats.num_active_sequences + stats.num_kv_blocks_used


def _wait_for(condition, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, what
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_client_that_stops_reading_is_dropped_and_its_kv_freed(stall_gateway, target_stub, draft_stub,
                                                                  gateway_stub):
    target, draft = target_stub, draft_stub("perturbed")
    assert _sequences(target) == 0 and _sequences(draft) == 0
    with grpc.insecure_channel(f"127.0.0.1:{stall_gateway.port}", options=SMALL_WINDOW) as c:
        call = gateway_pb2_grpc.GatewayStub(c).Generate(gateway_pb2.GenerateRequest(
            prompt="The quick brown fox", max_new_tokens=200, num_draft_tokens=2, ignore_eos=True), timeout=120)
        _wait_for(lambda: _sequences(target) > 0, 30, "the request never reached the target")
        # the client reads nothing: once its window is full the gateway's writes wait, then give up
        held_s = _wait_for(lambda: _sequences(target) == 0 and _sequences(draft) == 0, 30,
                           "a client that stopped reading still holds KV after 30 s")
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
    assert held_s >= STALL_TIMEOUT_S * 0.5
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert "stopped reading" in info.value.details() and "--stream-stall-timeout-s" in info.value.details()
    # the gateway keeps serving
    tokens = list(gateway_stub("perturbed").Generate(gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=8)))
    assert tokens
