"""Runs real gRPC services in-process on loopback (port 0), on an event loop in a thread, so
tests can drive them with ordinary blocking stubs."""
from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from specdec.client import collect
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine, timeout_s: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for a service that must be told its port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def channel(port: int) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{port}")


def generate(stub: gateway_pb2_grpc.GatewayStub, **fields) -> tuple[list[int], str, gateway_pb2.GenerateResponse]:
    """Runs Generate to the end; returns (token ids, text, final chunk)."""
    completion = collect(stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=120))
    return completion.token_ids, completion.text, completion.final


def mid_stream_deadline_s(stub: gateway_pb2_grpc.GatewayStub, **fields) -> float:
    """What the first third of a greedy request takes on `stub`, run here to its end: a deadline for the whole
    request that passes mid-stream on any device (greedy decoding gives the same tokens every run)."""
    third = fields["max_new_tokens"] // 3
    start = time.monotonic()
    token_ids, _, _ = generate(stub, **{**fields, "max_new_tokens": third})
    assert len(token_ids) == third, f"the request ended after {len(token_ids)} of {third} tokens"
    return time.monotonic() - start


def start_streaming(stub: gateway_pb2_grpc.GatewayStub, min_tokens: int = 20, **fields) -> tuple[Any, list[int]]:
    """Starts a streaming Generate and reads its first `min_tokens`-odd tokens (a few steps in): for the tests
    that break something mid-request. Returns the call and the tokens read."""
    call = stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=300)
    received: list[int] = []
    while len(received) < min_tokens:
        received += next(call).token_ids
    return call, received


def seed_ending_at_eos(stub: gateway_pb2_grpc.GatewayStub, seeds: int = 64, **fields) -> tuple[int, list[int]]:
    """The first seed whose sampled completion ends at an end-of-sequence token, and its token ids; with
    the tiny models' near-flat 400-token distribution some seed of the first few dozen does."""
    for seed in range(seeds):
        token_ids, _, final = generate(stub, seed=seed, **fields)
        if final.finish_reason == gateway_pb2.FINISH_REASON_EOS:
            return seed, token_ids
    raise AssertionError(f"none of {seeds} seeds sampled the end-of-sequence token")


def kv_blocks_used(stub) -> int:
    return stub.GetEngineStats(common_pb2.EngineStatsRequest()).num_kv_blocks_used


def bench_module(name: str) -> Iterator[ModuleType]:
    """bench/NAME.py loaded as module NAME for a fixture's span (a script, not a package; its dataclasses
    look their module up in sys.modules): `yield from bench_module("gpu_ab")`."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
