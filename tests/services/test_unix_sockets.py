"""The trio over Unix sockets (--unix-socket): a gateway beside its model services reaches them without TCP."""
from __future__ import annotations

import socket

import grpc
import pytest

from harness import free_port, generate

from draft_service.registry import DraftRegistry
from draft_service.server import start_draft_server
from engine.model_drafter import ModelDrafter
from engine.model_runner import ModelRunner, RuntimeConfig
from gateway.config import GatewayConfig
from gateway.server import start_gateway_server
from specdec.serving import start_server
from specdec.v1 import gateway_pb2_grpc
from target_service.server import start_target_server

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "x"]


def _runner(path) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=str(path), kv_cache_tokens=4096))


def test_a_trio_over_unix_sockets_gives_the_targets_greedy_output_and_removes_its_sockets(
        loop, model_dirs, tokenizer, hf_greedy, pool, tmp_path):
    sockets = {name: tmp_path / f"{name}.sock" for name in ("target", "draft", "gateway")}
    target = loop.run(start_target_server(_runner(model_dirs["target"]), unix_socket=sockets["target"]))
    draft = loop.run(start_draft_server(DraftRegistry.of(ModelDrafter(_runner(model_dirs["perturbed"]))),
                                        unix_socket=sockets["draft"]))
    gateway = loop.run(start_gateway_server(
        GatewayConfig(f"unix:{sockets['target']}", f"unix:{sockets['draft']}"), unix_socket=sockets["gateway"]))
    try:
        assert all(path.is_socket() for path in sockets.values())
        with grpc.insecure_channel(f"unix:{sockets['gateway']}") as c:
            stub = gateway_pb2_grpc.GatewayStub(c)
            futures = [pool.submit(generate, stub, prompt=p, max_new_tokens=16, num_draft_tokens=3) for p in PROMPTS]
            for prompt, future in zip(PROMPTS, futures):
                token_ids, _, final = future.result()
                assert token_ids == hf_greedy(tokenizer.encode(prompt), 16), prompt
                assert final.stats.num_draft_tokens > 0  # the draft was reached
    finally:
        for server in (gateway, draft, target):
            loop.run(server.stop())
    assert not any(path.exists() for path in sockets.values())


def test_a_socket_left_by_a_killed_server_is_replaced(loop, tmp_path):
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays, as after a SIGKILL
    server = loop.run(start_server(lambda s: None, [], "127.0.0.1", 0, unix_socket=path))
    try:
        assert path.is_socket()
        with grpc.insecure_channel(f"unix:{path}") as c:
            grpc.channel_ready_future(c).result(timeout=10)
    finally:
        loop.run(server.stop())


def test_a_socket_a_live_server_listens_on_is_refused_and_that_server_keeps_serving(loop, tmp_path):
    path = tmp_path / "taken.sock"
    first = loop.run(start_server(lambda s: None, [], "127.0.0.1", 0, unix_socket=path))
    try:
        with pytest.raises(OSError, match="another server is listening there"):
            loop.run(start_server(lambda s: None, [], "127.0.0.1", 0, unix_socket=path))
        with grpc.insecure_channel(f"unix:{path}") as c:
            grpc.channel_ready_future(c).result(timeout=10)
    finally:
        loop.run(first.stop())


@pytest.mark.parametrize("kind", ["file", "missing_directory"])
def test_a_unix_socket_that_cannot_be_made_fails_the_start_clearly(loop, tmp_path, kind):
    path = tmp_path / "not-a-socket"
    if kind == "file":
        path.write_text("keep me")
        message = "a file that is not a socket is there"
    else:
        path = tmp_path / "missing" / "s.sock"
        message = "cannot listen on unix:"
    with pytest.raises(OSError, match=message):
        loop.run(start_server(lambda s: None, [], "127.0.0.1", 0, unix_socket=path))
    if kind == "file":
        assert path.read_text() == "keep me"


def test_a_gateway_whose_socket_cannot_be_made_fails_its_start_and_frees_its_http_port(loop, target_server, tmp_path):
    http_port = free_port()
    # the port must be let go by the failed start itself, while its error (and so its frames) is still held
    with pytest.raises(OSError, match="cannot listen on unix:") as failed:
        loop.run(start_gateway_server(GatewayConfig(f"127.0.0.1:{target_server.port}", None), http_port=http_port,
                                      unix_socket=tmp_path / "missing" / "gateway.sock"))
    with socket.socket() as again:
        again.bind(("127.0.0.1", http_port))  # "address in use" while the failed start holds it
    assert failed.value.__traceback__ is not None
