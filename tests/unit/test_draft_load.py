"""bench/draft_load.py: proposals belong to the window they end in."""
from __future__ import annotations

import pytest
from harness import bench_module


@pytest.fixture(scope="module")
def draft_load():
    yield from bench_module("draft_load")


def test_proposals_count_in_the_loads_they_end_in_and_their_rate_is_over_those_spans(draft_load):
    # (end time, seconds): ends at 1.5 and 4.0 fall in the loads [1, 2) and [3, 5); 2.5 between them, 5.0 after
    ends = [(1.5, 0.010), (2.5, 0.500), (4.0, 0.030), (5.0, 0.900)]
    metrics = draft_load.window_metrics("during", [(1.0, 2.0), (3.0, 5.0)], ends)
    assert metrics == {"proposals_per_s_during": 2 / 3, "propose_ms_p50_during": pytest.approx(30.0),
                       "propose_ms_p99_during": pytest.approx(30.0), "propose_ms_max_during": pytest.approx(30.0)}


def test_a_window_no_proposal_ended_in_has_no_latencies(draft_load):
    metrics = draft_load.window_metrics("idle", [(0.0, 1.0)], [(2.0, 0.01)])
    assert metrics["proposals_per_s_idle"] == 0
    assert metrics["propose_ms_p50_idle"] is None and metrics["propose_ms_max_idle"] is None
