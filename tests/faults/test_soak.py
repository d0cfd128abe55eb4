"""A bounded soak (bench/soak.py, 30 s here; `python bench/soak.py` runs 120 s and writes
bench/results/soak.json): 32 streams, random cancellations, a draft and a target replica killed
and restarted in the middle. No wrong output, no unexpected error, no leaked KV, flat memory."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from soak import run_soak

pytestmark = pytest.mark.slow


def test_soak_with_cancellations_and_restarts_keeps_every_output_exact_and_leaks_nothing(tmp_path):
    metrics = run_soak(tmp_path, duration_s=30, num_streams=32)
    assert metrics["requests_completed"] > 50
    assert metrics["wrong_outputs"] == 0
    assert metrics["unexpected_errors"] == 0, metrics["errors_by_kind"]
    assert metrics["leaked_kv_blocks"] == 0
    for name, before in metrics["rss_mb_before_by_process"].items():
        assert metrics["rss_mb_after_by_process"][name] < before + 64, f"{name} memory grew: {metrics}"
