"""bench/gpu_swap.py: a chunk's gap counts in the window it ends in; first tokens apart."""
from __future__ import annotations

import pytest
from harness import bench_module


@pytest.fixture(scope="module")
def gpu_swap():
    yield from bench_module("gpu_swap")


def test_gaps_and_first_tokens_fall_in_the_window_they_end_in(gpu_swap):
    chunks = [  # (arrival s, tokens, seconds since the previous chunk or the request, first chunk)
        (0.5, 1, 0.100, True), (0.6, 1, 0.010, False), (0.7, 2, 0.020, False),  # before
        (1.2, 1, 0.500, False), (1.9, 1, 0.300, True),  # during: a stall, and a first token
        (2.5, 1, 0.010, False), (2.6, 1, 0.012, False),  # after
        (9.0, 1, 0.010, False),  # past the end: not counted
    ]
    m = gpu_swap.window_metrics(chunks, {"before": (0.0, 1.0), "during": (1.0, 2.0), "after": (2.0, 3.0)})
    assert m["tok_s_before"] == pytest.approx(4.0) and m["tok_s_during"] == pytest.approx(2.0)
    assert m["tok_s_after"] == pytest.approx(2.0)
    assert (m["num_gaps_before"], m["num_gaps_during"], m["num_gaps_after"]) == (2, 1, 2)
    assert m["gap_ms_max_before"] == pytest.approx(20.0) and m["gap_ms_p50_before"] == pytest.approx(15.0)
    assert m["gap_ms_max_during"] == pytest.approx(500.0) and m["gap_ms_p99_during"] == pytest.approx(500.0)
    assert m["ttft_ms_max_before"] == pytest.approx(100.0) and m["ttft_ms_max_during"] == pytest.approx(300.0)
    assert m["ttft_ms_max_after"] is None and m["gap_ms_p50_after"] == pytest.approx(11.0)


def test_an_empty_window_has_no_gaps_rather_than_an_error(gpu_swap):
    m = gpu_swap.window_metrics([(0.5, 1, 0.01, False)], {"during": (1.0, 1.0)})
    assert m["tok_s_during"] == 0.0 and m["gap_ms_p99_during"] is None and m["num_gaps_during"] == 0


def test_the_draft_gpu_memory_figures_are_the_last_before_the_swap_the_peak_and_the_last(gpu_swap):
    samples = [(1.0, 3000.0), (2.0, 3010.0), (3.0, 5900.0), (4.0, 5600.0)]
    assert gpu_swap.gpu_memory_figures(samples, swap_start=2.5) == {
        "draft_gpu_mib_before_swap": 3010.0, "draft_gpu_mib_peak": 5900.0, "draft_gpu_mib_end": 5600.0}
    assert set(gpu_swap.gpu_memory_figures([], swap_start=2.5).values()) == {None}  # no GPU: no samples
