"""bench/step_trace.py's batch timing: each batched forward is matched to the round trips it served."""
from __future__ import annotations

import json
import time

import pytest
from harness import bench_module

from engine.gpu_work import run_to_end

MS = 1_000_000  # ns


@pytest.fixture(scope="module")
def step_trace():
    yield from bench_module("step_trace")


def test_each_forward_is_timed_against_the_round_trips_it_served(step_trace):
    traces = {
        # forward 1 serves requests sent at 0 and 2 ms; forward 2 the same requests' next round trips,
        # sent at 12 and 13 ms (each sent before forward 1 ended belongs to forward 1)
        "tgt.process": [(3 * MS, 8 * MS), (14 * MS, 20 * MS)],
        "gw.verify": [(0, 9 * MS), (2 * MS, 11 * MS), (12 * MS, 21 * MS), (13 * MS, 24 * MS)],
    }
    parts = step_trace.batch_parts(traces, (0, 30 * MS))
    assert parts["tgt_num_forwards"] == 2
    assert parts["tgt_rpcs_per_forward"] == 2
    assert parts["tgt_first_sent_ms"] == pytest.approx(2.5)  # medians of (3, 2)
    assert parts["tgt_last_sent_ms"] == pytest.approx(1.0)  # of (1, 1)
    assert parts["tgt_first_answered_ms"] == pytest.approx(1.0)  # of (1, 1)
    assert parts["tgt_last_answered_ms"] == pytest.approx(3.5)  # of (3, 4)
    assert parts["tgt_forward_ms"] == pytest.approx(5.5)
    assert parts["dft_num_forwards"] == 0


def test_a_request_sent_while_a_forward_runs_is_timed_against_the_next_one(step_trace):
    # the request arrived while forward 1 ran and was served by forward 2
    traces = {"tgt.process": [(0, 5 * MS), (6 * MS, 10 * MS)], "gw.verify": [(1 * MS, 11 * MS)]}
    parts = step_trace.batch_parts(traces, (0, 20 * MS))
    assert parts["tgt_num_forwards"] == 1
    assert parts["tgt_first_sent_ms"] == pytest.approx(5.0)


def test_a_round_trips_host_work_splits_around_the_launch_and_the_read_back(step_trace):
    us = 1_000  # ns
    traces = {
        "tgt.verify": [(100 * us, 5_000 * us)],
        "tgt.process": [(200 * us, 4_900 * us)],
        # launched 150 us into the work; 4 ms on the device; read back 100 us after the device finished
        "gpu.replay": [(350 * us, 4_350 * us)],
        "tgt.readback": [(400 * us, 4_450 * us)],
    }
    parts = step_trace.round_trip_parts(traces, (0, 5_100 * us), "tgt")
    assert parts["tgt_gpu_ms"] == pytest.approx(4.0)
    assert parts["tgt_pre_launch_ms"] == pytest.approx(0.15)
    assert parts["tgt_launch_and_wait_ms"] == pytest.approx(0.1)
    assert parts["tgt_post_read_ms"] == pytest.approx(0.45)
    assert parts["tgt_pre_launch_ms"] + parts["tgt_launch_and_wait_ms"] + parts["tgt_post_read_ms"] == pytest.approx(
        parts["tgt_host_ms"])



@pytest.fixture(scope="module")
def trace_probe():
    yield from bench_module("trace_probe")


def test_an_engine_step_is_timed_from_its_start_to_its_return_across_its_gpu_wait(trace_probe, tmp_path):
    """trace_probe times a generator step (engine/gpu_work.py) until it returns, not until it is created."""
    rows = tmp_path / "rows.jsonl"
    recorder = trace_probe.Recorder(rows)
    waited = []

    def step(jobs):
        waited.append(time.perf_counter_ns())
        yield None  # the GPU wait
        return [job * 2 for job in jobs]

    work = trace_probe.timed(recorder, "tgt.process", step)([1, 2])
    time.sleep(0.01)  # between its creation and its run: not counted
    assert run_to_end(work) == [2, 4]
    recorder.flush()
    [(name, start, end)] = [json.loads(line) for line in rows.read_text().splitlines()]
    assert name == "tgt.process" and start == pytest.approx(waited[0], abs=1 * MS) and end >= waited[0]
