"""--log-format json: a service's stderr is one JSON object a line, from its start through a live draft load
to its stop; no progress bar (weight loading, graph capture) breaks a line a log pipeline parses."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import pytest

from specdec.launch import wait_serving
from specdec.v1 import draft_pb2, draft_pb2_grpc

pytestmark = pytest.mark.slow  # starts a service process
TOKEN = "json-logs-secret"


def test_a_draft_service_logging_json_writes_only_json_lines_through_a_live_load(model_dirs, tmp_path):
    ready = tmp_path / "draft.addr"
    process = subprocess.Popen(
        [sys.executable, "-m", "draft_service", "--port", "0", "--ready-file", str(ready), "--device", "cpu",
         "--drafter", "model", "--model", str(model_dirs["perturbed"]), "--admin-token", TOKEN,
         "--log-format", "json", "--log-level", "INFO"],
        stderr=subprocess.PIPE, text=True)
    try:
        address = wait_serving("draft", process, ready, 120)
        with grpc.insecure_channel(address) as channel:
            draft_pb2_grpc.DraftServiceStub(channel).LoadDraft(
                draft_pb2.LoadDraftRequest(name="second", model=str(model_dirs["identical"])),
                metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=120)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    records = [json.loads(line) for line in stderr.splitlines() if line.strip()]  # raises on any other line
    assert process.returncode == 0
    assert all({"time", "level", "logger", "message", "request_id"} <= record.keys() for record in records)
    messages = [record["message"] for record in records]
    assert any(m.startswith("serving specdec.v1.DraftService") for m in messages), messages
