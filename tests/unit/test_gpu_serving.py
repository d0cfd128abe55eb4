"""bench/gpu_serving.py: the Poisson schedule, the percentiles, a request's TTFT/TPOT/ITL and the metrics of a run."""
from __future__ import annotations

import argparse
import statistics

import pytest
from harness import bench_module


@pytest.fixture(scope="module")
def gpu_serving():
    yield from bench_module("gpu_serving")


def test_the_poisson_schedule_is_seeded_starts_at_zero_and_increases(gpu_serving):
    schedule = gpu_serving.poisson_schedule(100, 8.0, seed=3)
    assert schedule == gpu_serving.poisson_schedule(100, 8.0, seed=3)
    assert schedule != gpu_serving.poisson_schedule(100, 8.0, seed=4)
    assert len(schedule) == 100 and schedule[0] == 0.0
    assert all(a < b for a, b in zip(schedule, schedule[1:]))


def test_the_poisson_schedules_mean_gap_approaches_one_over_the_rate(gpu_serving):
    for rate in (4.0, 16.0):
        schedule = gpu_serving.poisson_schedule(20000, rate, seed=0)
        gaps = [b - a for a, b in zip(schedule, schedule[1:])]
        assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.03)
        assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.05)  # exponential: sd = mean


def test_an_infinite_rate_sends_every_request_at_once(gpu_serving):
    assert gpu_serving.poisson_schedule(5, float("inf"), seed=0) == [0.0] * 5


def test_percentiles_interpolate_linearly_between_the_closest_ranks(gpu_serving):
    percentile = gpu_serving.percentile
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0 and percentile([1.0, 2.0, 3.0, 4.0, 5.0], 25) == 2.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_a_requests_ttft_tpot_and_itls_come_from_its_chunks(gpu_serving):
    # sent at 10 s; chunks of 1, 3 (a speculative step) and 2 tokens
    ttft, tpot, itls = gpu_serving.request_figures(10.0, [(10.1, 1), (10.15, 3), (10.3, 2)])
    assert ttft == pytest.approx(0.1)
    assert tpot == pytest.approx(0.2 / 5)  # 6 tokens: 5 after the first, over first to last chunk
    assert itls == pytest.approx([0.05, 0.15])  # per chunk, not per token


def test_a_request_of_one_token_has_no_tpot_or_itl_and_one_without_chunks_no_figures(gpu_serving):
    assert gpu_serving.request_figures(1.0, [(1.5, 1)]) == (pytest.approx(0.5), None, [])
    assert gpu_serving.request_figures(1.0, []) == (None, None, [])


def _record(gpu_serving, prompt: int, sent: float, chunks: list[tuple[float, int]], finished: float,
            error: str | None = None, drafted: int = 0, accepted: int = 0, token_ids: list[int] | None = None):
    """A record whose output is its prompt's reference [prompt] * tokens unless `token_ids` says otherwise."""
    tokens = sum(n for _, n in chunks)
    return gpu_serving.RequestRecord(prompt, sent, chunks, finished,
                                     [prompt] * tokens if token_ids is None else token_ids, error, drafted, accepted)


def test_a_runs_metrics_are_named_by_mode_and_rate_and_count_failures_and_differing_outputs(gpu_serving):
    references = [[0] * 4, [1] * 3]
    records = [
        _record(gpu_serving, 0, 0.0, [(0.1, 1), (0.2, 3)], 0.25, drafted=4, accepted=3),  # ttft 0.1, tpot 0.1/3
        _record(gpu_serving, 1, 0.5, [(0.7, 1), (0.8, 1), (1.0, 1)], 1.0, drafted=4, accepted=1),  # ttft .2, tpot .15
        _record(gpu_serving, 1, 1.0, [(1.2, 1), (1.5, 2)], 2.0, token_ids=[1, 1, 9]),  # differs: ttft .2, tpot .15
        _record(gpu_serving, 0, 1.5, [(1.6, 1)], 1.8, error="UNAVAILABLE"),
        _record(gpu_serving, 0, 1.6, [], 1.7, error="UNAVAILABLE"),
        _record(gpu_serving, 0, 1.7, [], 1.9, error="DEADLINE_EXCEEDED"),
    ]
    m = gpu_serving.aggregate(records, references, "spec_rate4_")
    assert set(m) == {f"spec_rate4_{name}" for name in (
        "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99", "itl_ms_max", "tok_s",
        "req_s", "requests_completed", "requests_failed", "failures_by_code", "outputs_differ", "tokens_per_chunk",
        "acceptance_rate")}
    assert m["spec_rate4_ttft_ms_p50"] == pytest.approx(200.0) and m["spec_rate4_ttft_ms_p99"] == pytest.approx(200.0)
    # TPOTs 33.3, 150, 150 ms: rank 1 and rank 1.98 both 150
    assert m["spec_rate4_tpot_ms_p50"] == pytest.approx(150.0) and m["spec_rate4_tpot_ms_p99"] == pytest.approx(150.0)
    # the gaps: 0.1; 0.1, 0.2; 0.3 (the failed request's chunk not among them)
    assert m["spec_rate4_itl_ms_p50"] == pytest.approx(150.0) and m["spec_rate4_itl_ms_max"] == pytest.approx(300.0)
    assert m["spec_rate4_itl_ms_p99"] == pytest.approx(297.0)
    assert m["spec_rate4_tok_s"] == pytest.approx(10 / 2.0)  # completed tokens over first send (0) to last finish (2)
    assert m["spec_rate4_req_s"] == pytest.approx(3 / 2.0)
    assert (m["spec_rate4_requests_completed"], m["spec_rate4_requests_failed"]) == (3, 3)
    assert m["spec_rate4_failures_by_code"] == {"UNAVAILABLE": 2, "DEADLINE_EXCEEDED": 1}
    assert m["spec_rate4_outputs_differ"] == 1
    assert m["spec_rate4_tokens_per_chunk"] == pytest.approx(10 / 7)
    assert m["spec_rate4_acceptance_rate"] == pytest.approx(4 / 8)


def test_a_target_only_run_without_draft_tokens_has_no_acceptance_rate(gpu_serving):
    m = gpu_serving.aggregate([_record(gpu_serving, 0, 0.0, [(0.1, 1), (0.2, 1)], 0.5)], [[0, 0]], "target_only_rate8_")
    assert m["target_only_rate8_acceptance_rate"] is None and m["target_only_rate8_outputs_differ"] == 0
    assert m["target_only_rate8_tok_s"] == pytest.approx(4.0) and m["target_only_rate8_requests_failed"] == 0


def test_a_variant_is_a_label_and_the_flags_its_target_gets(gpu_serving):
    assert gpu_serving.parse_variant("base") == ("base", [])
    assert gpu_serving.parse_variant("one_prefill:--max-prefills-per-iteration=1,--max-num-batched-tokens=512") == (
        "one_prefill", ["--max-prefills-per-iteration=1", "--max-num-batched-tokens=512"])
    with pytest.raises(argparse.ArgumentTypeError, match="label must be a name"):
        gpu_serving.parse_variant("one prefill:--max-prefills-per-iteration=1")


def test_the_variants_order_rotates_from_one_rate_to_the_next(gpu_serving):
    labels = ["base", "a", "b"]
    assert [gpu_serving.rotated(labels, r) for r in range(4)] == [
        ["base", "a", "b"], ["a", "b", "base"], ["b", "base", "a"], ["base", "a", "b"]]


def test_later_variants_get_their_ratio_to_the_first_of_each_headline_figure(gpu_serving):
    prefixes = ["spec_rate8_"]
    metrics = {f"{label}_spec_rate8_{name}": value for label, value in (("base", 2.0), ("one", 1.0))
               for name in gpu_serving.RATIO_FIGURES}
    metrics["one_spec_rate8_tok_s"] = None  # a figure missing (no completed request) gets no ratio
    ratios = gpu_serving.ratios(metrics, ["base", "one"], prefixes)
    assert ratios == {f"one_over_base_spec_rate8_{name}": 0.5 for name in gpu_serving.RATIO_FIGURES if name != "tok_s"}


class _BrokenStub:
    """A Generate that fails as no gRPC call does: the client thread raises."""

    def Generate(self, request, timeout):  # noqa: N802 (the stub's method name)
        raise ValueError("not a gRPC error")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_client_thread_that_raises_stops_the_run_naming_its_request(gpu_serving):
    with pytest.raises(RuntimeError, match=r"requests \[0\] ended without a record"):
        gpu_serving.run_load(_BrokenStub(), [(0, None)], [0.0])
