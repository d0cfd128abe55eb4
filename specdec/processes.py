"""Service processes for fault tests and soak runs: start one on a port, kill it (SIGKILL), stop it
(SIGTERM), freeze it (SIGSTOP), bring it back on the same port, read its engine counters."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specdec.launch import wait_serving
from specdec.serving import DEFAULT_SHUTDOWN_GRACE_S
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

START_TIMEOUT_S = 180


@dataclass
class Replica:
    """One service process; `restart()` brings it back on the same port."""

    name: str
    module: str
    args: list[str]
    workdir: Path
    port: int = 0
    process: subprocess.Popen | None = None
    _channel: grpc.Channel | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def _ready_file(self) -> Path:
        return self.workdir / f"{self.name}.addr"

    def spawn(self) -> None:
        self._ready_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", self.module, "--port", str(self.port), "--ready-file", str(self._ready_file),
                   "--log-level", "WARNING", *self.args]
        self.process = subprocess.Popen(command)

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def wait_ready(self) -> None:
        address = wait_serving(self.name, self.process, self._ready_file, START_TIMEOUT_S, health_timeout_s=60)
        self.port = int(address.rsplit(":", 1)[1])

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no goodbye, the connections just break."""
        if self.is_running():
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(30)

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self, timeout_s: float = DEFAULT_SHUTDOWN_GRACE_S + 10) -> None:
        """SIGTERM (a graceful stop: running requests finish within the service's shutdown grace), then
        SIGKILL if it still runs `timeout_s` later."""
        if self.is_running():
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def engine_stats(self) -> common_pb2.EngineStats:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        stub_type = target_pb2_grpc.TargetServiceStub if self.module == "target_service" \
            else draft_pb2_grpc.DraftServiceStub
        return stub_type(self._channel).GetEngineStats(common_pb2.EngineStatsRequest(), timeout=10)
