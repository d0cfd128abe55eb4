"""GatewayMetrics.record_step: the per-position speculation counters, as Prometheus exports them."""
from __future__ import annotations

from gateway.metrics import GatewayMetrics


def per_position(metrics: GatewayMetrics, name: str) -> dict[str, float]:
    samples = next(m for m in metrics.registry.collect() if m.name == name).samples
    return {s.labels["position"]: s.value for s in samples if s.name.endswith("_total")}


def test_steps_of_growing_and_shrinking_k_count_each_position():
    metrics = GatewayMetrics()
    for k, accepted in [(4, 3), (2, 0), (6, 6), (0, 0), (1, 1)]:
        metrics.record_step(k, accepted)
    assert per_position(metrics, "specdec_gateway_spec_decode_draft_tokens_per_pos") == {
        "0": 4, "1": 3, "2": 2, "3": 2, "4": 1, "5": 1}
    assert per_position(metrics, "specdec_gateway_spec_decode_accepted_tokens_per_pos") == {
        "0": 3, "1": 2, "2": 2, "3": 1, "4": 1, "5": 1}
    assert metrics.registry.get_sample_value("specdec_gateway_spec_decode_steps_total") == 4  # the k = 0 step is not one
    assert metrics.registry.get_sample_value("specdec_gateway_spec_decode_draft_tokens_total") == 13
    assert metrics.registry.get_sample_value("specdec_gateway_spec_decode_accepted_tokens_total") == 10
    assert metrics.registry.get_sample_value("specdec_gateway_spec_decode_num_draft_tokens_count") == 5
