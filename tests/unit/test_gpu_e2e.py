"""bench/gpu_e2e.py: a configuration's figures are its round of median throughput, whole."""
from __future__ import annotations

import pytest
from harness import bench_module


@pytest.fixture(scope="module")
def gpu_e2e():
    yield from bench_module("gpu_e2e")


def _rounds(gpu_e2e, monkeypatch, results: list[dict]) -> dict:
    calls = iter(results)
    monkeypatch.setattr(gpu_e2e, "run_config", lambda *args, **kwargs: next(calls))
    return gpu_e2e.run_rounds(len(results), None, ["a prompt"], 1, 8, 4)


def test_the_round_of_median_throughput_is_reported_whole_beside_every_rounds_figures(gpu_e2e, monkeypatch):
    results = [{"tok_s": tok_s, "rpc_overhead_fraction": fraction, "step_ms": step, "token_ids": [[5, 6]]}
               for tok_s, fraction, step in ((390.0, 0.09, 8.6), (370.0, 0.12, 9.1), (900.0, 0.01, 3.7))]
    result = _rounds(gpu_e2e, monkeypatch, results)
    assert (result["tok_s"], result["rpc_overhead_fraction"], result["step_ms"]) == (390.0, 0.09, 8.6)
    assert result["rounds_tok_s"] == [390.0, 370.0, 900.0]
    assert result["rounds_rpc_overhead_fraction"] == [0.09, 0.12, 0.01]
    assert result["rounds_outputs_differ"] == 0


def test_of_an_even_count_the_slower_middle_round_and_rounds_whose_outputs_differ_are_counted(gpu_e2e, monkeypatch):
    results = [{"tok_s": tok_s, "rpc_overhead_fraction": 0.1, "token_ids": ids}
               for tok_s, ids in ((300.0, [[1, 2]]), (320.0, [[1, 3]]), (310.0, [[1, 2]]), (330.0, [[9, 9]]))]
    result = _rounds(gpu_e2e, monkeypatch, results)
    assert result["tok_s"] == 310.0 and result["token_ids"] == [[1, 2]]
    assert result["rounds_outputs_differ"] == 2
