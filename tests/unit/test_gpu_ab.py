"""bench/gpu_ab.py: variants run in turn, each first in half the rounds; medians, ratios, output checks."""
from __future__ import annotations


import pytest
from harness import bench_module


@pytest.fixture(scope="module")
def gpu_ab():
    yield from bench_module("gpu_ab")


def _result(tok_s: float, token_ids: list[list[int]], draft_ms: float = 3.0) -> dict:
    return {"tok_s": tok_s, "draft_ms_per_step": draft_ms, "target_ms_per_step": 4.8,
            "rpc_overhead_fraction": 0.1, "token_ids": token_ids}


def test_each_variant_runs_first_in_half_the_rounds(gpu_ab):
    a, b = gpu_ab.Variant("a", {}, False, None), gpu_ab.Variant("b", {}, True, None)
    order = [v.label for v in gpu_ab.alternating((a, b), 4)]
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_the_report_takes_medians_over_rounds_and_counts_outputs_that_differ(gpu_ab):
    reference = [[1, 2, 3], [4, 5, 6]]
    a = gpu_ab.Variant("base", {}, False, None, reference=reference)
    b = gpu_ab.Variant("mps", {}, True, None, reference=reference)
    for spec_tok_s in (300.0, 310.0, 900.0):  # an outlier round moves the median little
        a.rounds.append({"target_only": _result(190.0, reference), "spec": _result(spec_tok_s, reference)})
    for spec_tok_s in (330.0, 341.0, 320.0):
        b.rounds.append({"target_only": _result(200.0, reference),
                         "spec": _result(spec_tok_s, [[1, 2, 3], [4, 5, 7]], draft_ms=2.5)})
    metrics = gpu_ab.ab_metrics((a, b))
    assert metrics["rounds"] == 3
    assert metrics["base_spec_tok_s_alpha0.8_k4"] == 310.0
    assert metrics["mps_spec_tok_s_alpha0.8_k4"] == 330.0
    assert metrics["b_over_a_spec_tok_s_alpha0.8_k4"] == pytest.approx(330 / 310)
    assert metrics["b_over_a_draft_propose_ms_k4"] == pytest.approx(2.5 / 3.0)
    assert metrics["base_spec_outputs_differ"] == 0
    assert metrics["mps_spec_outputs_differ"] == 3  # one prompt's output differs in each of 3 rounds
    assert metrics["target_only_outputs_differ_a_vs_b"] == 0


def test_variant_variables_must_be_name_value_pairs(gpu_ab):
    import argparse

    parser = argparse.ArgumentParser()
    assert gpu_ab.parse_env(["SPECDEC_PDL=1", "X=a=b"], parser) == {"SPECDEC_PDL": "1", "X": "a=b"}
    with pytest.raises(SystemExit):
        gpu_ab.parse_env(["SPECDEC_PDL"], parser)
