"""Start-up checks (incompatible pairs) and running out of KV cache."""
from __future__ import annotations

import logging
import os

import grpc
import pytest
from harness import channel, generate

from draft_service.registry import DraftRegistry
from draft_service.server import start_draft_server
from engine.model_drafter import ModelDrafter
from engine.model_runner import ModelRunner, RuntimeConfig
from gateway.config import GatewayConfig
from gateway.server import start_gateway_server
from specdec.errors import IncompatibleModelsError, ServiceUnavailableError
from specdec.v1 import common_pb2, gateway_pb2_grpc, target_pb2_grpc
from target_service.server import start_target_server


def test_gateway_refuses_a_draft_with_another_tokenizer(loop, model_dirs, target_server):
    draft = loop.run(start_draft_server(DraftRegistry.of(ModelDrafter(ModelRunner(RuntimeConfig(model=str(model_dirs["other_tokenizer"])))))))
    try:
        config = GatewayConfig(f"127.0.0.1:{target_server.port}", f"127.0.0.1:{draft.port}")
        with pytest.raises(IncompatibleModelsError, match="use different tokenizers.*vocab sizes 330 vs 400"):
            loop.run(start_gateway_server(config))
    finally:
        loop.run(draft.stop())


def test_gateway_start_fails_clearly_when_the_target_is_unreachable(loop, caplog):
    config = GatewayConfig("127.0.0.1:1", None, connect_timeout_s=0.5)
    with caplog.at_level(logging.INFO, logger="gateway.backends"):
        with pytest.raises(ServiceUnavailableError,
                           match=r"cannot reach a model service: the target at 127\.0\.0\.1:1 did not answer within 0\.5 s"):
            loop.run(start_gateway_server(config))
    assert "waiting up to 0.5 s for the target at 127.0.0.1:1" in caplog.text  # said while it waits, not after


def test_gateway_start_names_the_draft_when_the_draft_is_unreachable(loop, target_server):
    config = GatewayConfig(f"127.0.0.1:{target_server.port}", "127.0.0.1:1", connect_timeout_s=0.5)
    with pytest.raises(ServiceUnavailableError, match=r"the draft at 127\.0\.0\.1:1 did not answer within 0\.5 s"):
        loop.run(start_gateway_server(config))


def test_model_info_describes_the_served_models(target_stub, draft_stub, model_dirs):
    target = target_stub.GetModelInfo(common_pb2.ModelInfoRequest())
    draft = draft_stub("identical").GetModelInfo(common_pb2.ModelInfoRequest())
    ngram = draft_stub("ngram").GetModelInfo(common_pb2.ModelInfoRequest())
    assert target.model_id == str(model_dirs["target"])
    assert (target.vocab_size, target.max_model_len, target.architecture) == (400, 256, "llama")
    assert target.tokenizer_fingerprint == draft.tokenizer_fingerprint != ""
    assert ngram.tokenizer_fingerprint == "" and ngram.architecture == "ngram"
    device = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")  # as conftest runs the services
    assert (target.device, draft.device, ngram.device) == (device, device, "cpu")  # the gateway's --busy-poll auto


def test_request_larger_than_the_kv_pool_gets_resource_exhausted(loop, model_dirs):
    runner = ModelRunner(RuntimeConfig(model=str(model_dirs["target"]), kv_cache_tokens=32))
    target = loop.run(start_target_server(runner))
    gateway = loop.run(start_gateway_server(GatewayConfig(f"127.0.0.1:{target.port}", None)))
    try:
        with channel(gateway.port) as c, pytest.raises(grpc.RpcError) as info:
            generate(gateway_pb2_grpc.GatewayStub(c), prompt="The quick brown fox " * 6, max_new_tokens=40)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "pool holds 2 blocks" in info.value.details()
        with channel(target.port) as c:  # nothing leaked, and a small request still fits
            assert target_pb2_grpc.TargetServiceStub(c).GetEngineStats(common_pb2.EngineStatsRequest()).num_kv_blocks_used == 0
        with channel(gateway.port) as c:
            token_ids, _, _ = generate(gateway_pb2_grpc.GatewayStub(c), prompt="hi", max_new_tokens=4)
        assert len(token_ids) > 0
    finally:
        loop.run(gateway.stop())
        loop.run(target.stop())


def test_health_and_reflection_are_served(target_server, gateways):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for port in (target_server.port, gateways["perturbed"]):
        with channel(port) as c:
            status = health_pb2_grpc.HealthStub(c).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            [response] = list(reflection_pb2_grpc.ServerReflectionStub(c).ServerReflectionInfo(iter([request])))
            names = {s.name for s in response.list_services_response.service}
            assert "grpc.health.v1.Health" in names
            assert names & {"specdec.v1.TargetService", "specdec.v1.Gateway"}


def test_requests_beyond_kv_capacity_wait_instead_of_failing(loop, model_dirs, tokenizer, hf_greedy, pool):
    """8 concurrent requests whose worst cases only fit 2 at a time all complete, correctly."""
    from engine.model_runner import ModelRunner, RuntimeConfig

    runner = ModelRunner(RuntimeConfig(model=str(model_dirs["target"]), kv_cache_tokens=96))  # 6 blocks
    target = loop.run(start_target_server(runner))
    gateway = loop.run(start_gateway_server(GatewayConfig(f"127.0.0.1:{target.port}", None)))
    prompts = [f"request {i} says hello" for i in range(8)]
    try:
        with channel(gateway.port) as c:
            stub = gateway_pb2_grpc.GatewayStub(c)
            futures = [pool.submit(generate, stub, prompt=p, max_new_tokens=30) for p in prompts]
            outputs = [f.result()[0] for f in futures]
        assert outputs == [hf_greedy(tokenizer.encode(p), 30) for p in prompts]
        with channel(target.port) as c:
            stats = target_pb2_grpc.TargetServiceStub(c).GetEngineStats(common_pb2.EngineStatsRequest())
        assert stats.num_kv_blocks_used == 0 and stats.num_waiting_sequences == 0
    finally:
        loop.run(gateway.stop())
        loop.run(target.stop())
