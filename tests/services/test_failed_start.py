"""A server whose start fails lets go of everything it took: its gRPC port, its socket file, its metrics port.

A supervisor that retries a start in-process (or a test) must be able to bind the same ports again at
once, while the failed start's error, and so its frames, are still held.
"""
from __future__ import annotations

import socket

import pytest

from harness import free_port

from specdec.serving import start_server


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _fail_start(loop, tmp_path, cause: str, port: int) -> tuple[pytest.ExceptionInfo, dict]:
    taken = socket.socket()
    kwargs: dict = {}
    if cause == "socket refused":
        (tmp_path / "not-a-socket").write_text("keep me")
        kwargs["unix_socket"] = tmp_path / "not-a-socket"
    elif cause == "metrics port busy":
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        kwargs["metrics_port"] = taken.getsockname()[1]
        kwargs["unix_socket"] = tmp_path / "s.sock"
    else:  # the ready file's directory is missing: the server had started
        kwargs["ready_file"] = tmp_path / "missing" / "ready"
        kwargs["metrics_port"] = 0
    try:
        with pytest.raises(OSError) as failed:
            loop.run(start_server(lambda s: None, [], "127.0.0.1", port, **kwargs))
    finally:
        taken.close()
    return failed, kwargs


@pytest.mark.parametrize("cause", ["socket refused", "metrics port busy", "ready file unwritable"])
def test_a_failed_start_frees_its_grpc_port_and_socket_file(loop, tmp_path, cause):
    port = free_port()
    failed, kwargs = _fail_start(loop, tmp_path, cause, port)
    assert _bindable(port), "the failed start still holds its gRPC port"
    assert failed.value.__traceback__ is not None  # the error is still held
    if cause == "metrics port busy":
        assert not (tmp_path / "s.sock").exists()  # the socket it had made is removed
    # the same port serves a second start at once
    server = loop.run(start_server(lambda s: None, [], "127.0.0.1", port))
    try:
        assert server.port == port
    finally:
        loop.run(server.stop())
