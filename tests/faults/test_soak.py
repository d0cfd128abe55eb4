"""A bounded soak (bench/soak.py, 30 s here; `python bench/soak.py` runs 120 s and writes
bench/results/soak.json): 32 streams of mixed requests (greedy, seeded sampling, stop strings,
deadlines, bad requests, the OpenAI API), random cancellations, a target KV pool too small for all
of them at once, live draft swaps, a draft and a target replica killed and restarted in the middle,
a target replica stopped gracefully (SIGTERM) and restarted.
No wrong output, no unexpected error, no failed swap, no leaked KV, flat memory."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from soak import run_soak

pytestmark = pytest.mark.slow


def test_soak_of_mixed_requests_through_restarts_and_swaps_keeps_every_output_exact_and_leaks_nothing(tmp_path):
    metrics = run_soak(tmp_path, duration_s=30, num_streams=32)
    assert metrics["requests_completed"] > 50
    assert set(metrics["completed_by_kind"]) >= {"greedy", "sampled", "stop", "openai"}, metrics["completed_by_kind"]
    assert metrics["requests_refused"] > 0  # the bad requests, each with its expected status code
    assert metrics["wrong_outputs"] == 0, metrics["examples"]
    assert metrics["unexpected_errors"] == 0, metrics["errors_by_kind"]
    # a swap may only fail on the replica being restarted just then
    assert metrics["draft_swaps"].get("ok", 0) >= 8 and set(metrics["draft_swaps"]) <= {"ok", "UNAVAILABLE"}
    assert metrics["max_waiting_sequences"] > 0  # the small KV pool made requests wait for room
    assert metrics["graceful_drain_s"] < 15  # the stopped replica's running requests finished, then it exited
    assert metrics["leaked_kv_blocks"] == 0
    for name, before in metrics["rss_mb_before_by_process"].items():
        assert metrics["rss_mb_after_by_process"][name] < before + 64, f"{name} memory grew: {metrics}"
