"""bench/gpu_ab.py: variants as given, run in rotation, each first as often; medians, ratios, output checks."""
from __future__ import annotations

from pathlib import Path

import pytest
from harness import bench_module


@pytest.fixture(scope="module")
def gpu_ab():
    yield from bench_module("gpu_ab")


def _result(tok_s: float, token_ids: list[list[int]], draft_ms: float = 3.0, ttft_ms: float = 12.0) -> dict:
    return {"tok_s": tok_s, "draft_ms_per_step": draft_ms, "target_ms_per_step": 4.8, "step_ms": 8.6,
            "rpc_overhead_fraction": 0.1, "ttft_ms": ttft_ms, "target_prefill_ms": 10.0, "token_ids": token_ids}


def test_a_variant_spec_names_its_label_variables_arguments_mps_uds_streams_and_tree(gpu_ab):
    v = gpu_ab.parse_variant("warm:SPECDEC_KEEP_WARM=1,mps,tree=.ab/base,X=a=b,--max-batch-size=8,streams=8,uds")
    assert (v.label, v.env, v.mps, v.tree) == ("warm", {"SPECDEC_KEEP_WARM": "1", "X": "a=b"}, True, Path(".ab/base"))
    assert (v.args, v.streams, v.uds) == (["--max-batch-size", "8"], 8, True)
    assert gpu_ab.parse_variant("base") == gpu_ab.Variant("base", {}, False, None)
    assert not gpu_ab.parse_variant("base").uds


@pytest.mark.parametrize(("spec", "message"), [
    ("warm:SPECDEC_KEEP_WARM", "is not NAME=VALUE, --FLAG=VALUE, mps, uds, streams=N or tree=DIR"),
    ("s:streams=two", "streams=N needs a whole number of streams, got 'two'"),
    ("b:--=1", "is not NAME=VALUE"),
    ("a b:mps", "its label must be a name"),
    (":mps", "its label must be a name"),
])
def test_a_malformed_variant_is_refused_saying_what_is_wrong(gpu_ab, spec, message):
    with pytest.raises(ValueError, match=message):
        gpu_ab.parse_variant(spec)


def test_each_variant_runs_first_in_as_many_rounds(gpu_ab):
    variants = [gpu_ab.parse_variant(label) for label in ("base", "warm", "mps")]
    order = [v.label for v in gpu_ab.rotations(variants, 3)]
    assert order == ["base", "warm", "mps", "warm", "mps", "base", "mps", "base", "warm"]


def test_the_report_takes_medians_over_rounds_and_counts_outputs_that_differ(gpu_ab):
    reference = [[1, 2, 3], [4, 5, 6]]
    base = gpu_ab.Variant("base", {}, False, None, reference=reference)
    mps = gpu_ab.Variant("mps", {}, True, None, reference=[[1, 2, 3], [4, 5, 9]])
    for spec_tok_s in (300.0, 310.0, 900.0):  # an outlier round moves the median little
        base.rounds.append({"target_only": _result(190.0, reference), "spec": _result(spec_tok_s, reference)})
    for spec_tok_s in (330.0, 341.0, 320.0):
        mps.rounds.append({"target_only": _result(200.0, mps.reference),
                           "spec": _result(spec_tok_s, [[1, 2, 3], [4, 5, 7]], draft_ms=2.5, ttft_ms=9.0)})
    metrics = gpu_ab.ab_metrics([base, mps])
    assert metrics["rounds"] == 3
    assert metrics["base_spec_tok_s_alpha0.8_k4"] == 310.0
    assert metrics["mps_spec_tok_s_alpha0.8_k4"] == 330.0
    assert metrics["mps_over_base_spec_tok_s_alpha0.8_k4"] == pytest.approx(330 / 310)
    assert metrics["mps_over_base_draft_propose_ms_k4"] == pytest.approx(2.5 / 3.0)
    assert metrics["mps_spec_ttft_ms"] == 9.0 and metrics["mps_over_base_spec_ttft_ms"] == pytest.approx(9 / 12)
    assert metrics["base_spec_outputs_differ"] == 0
    assert metrics["mps_spec_outputs_differ"] == 3  # one prompt's output differs from its reference in each round
    assert metrics["mps_target_only_differs_from_base"] == 1
