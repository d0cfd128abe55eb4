"""Prometheus metrics and request ids: counters move consistently after real requests."""
from __future__ import annotations

import logging
import time

import grpc
import pytest
from harness import channel, generate

from draft_service.registry import DraftRegistry
from draft_service.server import start_draft_server
from engine.ngram_drafter import NgramDrafter
from specdec.request_id import REQUEST_ID_KEY, RequestIdFilter
from specdec.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Große Straße", "x y z"]


def _run_requests(stub, k: int = 3) -> list[gateway_pb2.GenerationStats]:
    return [generate(stub, prompt=p, max_new_tokens=16, num_draft_tokens=k)[2].stats for p in PROMPTS]


def _scrape_when_idle(scrape, port: int, timeout_s: float = 10, **labels: str):
    """A scrape once the service holds no sequence and no KV block: a stream's state is freed after
    the client has its final chunk (the gateway's cancel reaches the service a moment later), so the
    counters settle shortly after the requests; a leak never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = scrape(port)
        idle = result.value("specdec_engine_active_sequences", **labels) == 0 \
            and result.value("specdec_engine_kv_blocks_used", **labels) == 0
        if idle or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


def _per_pos(scrape, name: str) -> dict[int, float]:
    return {int(pos): value for pos, value in scrape.by_label(name, "position").items()}


def test_gateway_speculation_counters_add_up(observed_gateway, observed_stub, scrape):
    before = scrape(observed_gateway.metrics_port)
    stats = _run_requests(observed_stub)
    after = scrape(observed_gateway.metrics_port)

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    finished = sum(delta("specdec_gateway_requests_total", api="grpc", outcome=o) for o in ("length", "eos", "stop"))
    assert finished == len(PROMPTS)
    proposed = delta("specdec_gateway_spec_decode_draft_tokens_total")
    accepted = delta("specdec_gateway_spec_decode_accepted_tokens_total")
    assert proposed == sum(s.num_draft_tokens for s in stats) > 0
    assert accepted == sum(s.num_accepted_tokens for s in stats)
    assert 0 < accepted < proposed  # the perturbed draft is partly rejected
    # per position: proposed and accepted sum to the totals, accepted <= proposed, acceptance decays
    proposed_pos = _per_pos(after, "specdec_gateway_spec_decode_draft_tokens_per_pos_total")
    accepted_pos = _per_pos(after, "specdec_gateway_spec_decode_accepted_tokens_per_pos_total")
    assert sum(proposed_pos.values()) == after.value("specdec_gateway_spec_decode_draft_tokens_total")
    assert sum(accepted_pos.values()) == after.value("specdec_gateway_spec_decode_accepted_tokens_total")
    assert all(accepted_pos[p] <= proposed_pos[p] for p in accepted_pos)
    assert [accepted_pos[p] for p in sorted(accepted_pos)] == sorted(accepted_pos.values(), reverse=True)
    assert delta("specdec_gateway_spec_decode_steps_total") == proposed_pos[0] - before.by_label(
        "specdec_gateway_spec_decode_draft_tokens_per_pos_total", "position").get("0", 0)
    assert delta("specdec_gateway_time_to_first_token_seconds_count") == len(PROMPTS)
    assert delta("specdec_gateway_generation_tokens_total") == sum(s.num_completion_tokens for s in stats)
    assert delta("specdec_gateway_spec_decode_num_draft_tokens_count") == sum(s.num_verify_steps for s in stats)
    assert after.value("specdec_gateway_requests_running") == after.value("specdec_gateway_requests_waiting") == 0


def test_final_stats_carry_per_position_acceptance_and_forward_times(observed_stub):
    for s in _run_requests(observed_stub):
        assert sum(s.num_accepted_tokens_per_pos) == s.num_accepted_tokens
        assert list(s.num_accepted_tokens_per_pos) == sorted(s.num_accepted_tokens_per_pos, reverse=True)
        assert s.target_forward_s > 0 and s.draft_forward_s > 0
        assert s.time_per_output_token_s > 0
        # the prefills' forwards are part of each model's and leave the verifies' and proposals' apart
        assert 0 < s.target_prefill_forward_s < s.target_forward_s
        assert 0 < s.draft_prefill_forward_s < s.draft_forward_s


def test_invalid_requests_are_counted_by_outcome(observed_gateway, observed_stub, scrape):
    before = scrape(observed_gateway.metrics_port).value("specdec_gateway_requests_total", api="grpc",
                                                         outcome="invalid_request")
    with pytest.raises(grpc.RpcError) as e:
        generate(observed_stub, prompt="hi", num_draft_tokens=99)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(observed_gateway.metrics_port).value("specdec_gateway_requests_total", api="grpc",
                                                        outcome="invalid_request")
    assert after == before + 1


def test_target_metrics_follow_the_engine(observed_target, observed_stub, scrape):
    before = scrape(observed_target.metrics_port)
    stats = _run_requests(observed_stub)
    after = _scrape_when_idle(scrape, observed_target.metrics_port)
    forwards = after.value("specdec_engine_forwards_total") - before.value("specdec_engine_forwards_total")
    assert forwards > 0
    batches = after.by_label("specdec_engine_forward_seconds_count", "phase")
    assert {"prefill", "verify"} <= set(batches)
    # every forward is one observed batch; batch sizes sum to the sequence-steps
    assert sum(batches.values()) >= after.value("specdec_engine_forwards_total")
    steps = after.value("specdec_engine_sequence_steps_total")
    assert sum(after.by_label("specdec_engine_batch_size_sum", "phase").values()) >= steps
    started = after.value("specdec_engine_sequences_started_total") - before.value(
        "specdec_engine_sequences_started_total")
    assert started == len(stats)
    assert after.value("specdec_engine_active_sequences") == 0
    assert after.value("specdec_engine_kv_blocks_used") == 0 and after.value("specdec_engine_kv_blocks_free") > 0
    # on CPU no graph is captured: every forward is a miss
    assert after.value("specdec_engine_cuda_graph_steps_total", result="hit") == 0
    assert after.value("specdec_engine_cuda_graph_steps_total", result="miss") == after.value(
        "specdec_engine_forwards_total")
    (info,) = after.labelled("specdec_engine_model_info")
    assert info["role"] == "target" and info["architecture"] == "llama"


def test_draft_metrics_follow_each_loaded_draft(observed_draft, observed_stub, scrape):
    before = scrape(observed_draft.metrics_port)
    stats = _run_requests(observed_stub)
    after = _scrape_when_idle(scrape, observed_draft.metrics_port, draft="perturbed")
    started = after.value("specdec_engine_sequences_started_total", draft="perturbed") - before.value(
        "specdec_engine_sequences_started_total", draft="perturbed")
    assert started == len(stats)
    assert after.value("specdec_engine_forwards_total", draft="perturbed") > before.value(
        "specdec_engine_forwards_total", draft="perturbed")
    assert after.value("specdec_engine_active_sequences", draft="perturbed") == 0
    assert after.value("specdec_engine_kv_blocks_used", draft="perturbed") == 0
    assert after.value("specdec_engine_cuda_graph_steps_total", draft="perturbed", result="miss") > 0
    (info,) = after.labelled("specdec_engine_model_info")
    assert info["role"] == "draft" and info["draft"] == "perturbed" and info["default"] == "true"
    proposes = after.by_label("specdec_engine_forward_seconds_count", "phase")
    assert proposes.get("propose", 0) + proposes.get("mixed", 0) > 0  # the per-forward histograms move too


def test_draft_model_info_follows_the_default_draft(loop, scrape):
    drafts = DraftRegistry.of(NgramDrafter(), name="first")
    drafts.add("second", NgramDrafter())
    server = loop.run(start_draft_server(drafts, metrics_port=0, admin_token="secret"))

    def defaults() -> dict[str, str]:
        return {info["draft"]: info["default"] for info in scrape(server.metrics_port).labelled("specdec_engine_model_info")}

    try:
        assert defaults() == {"first": "true", "second": "false"}
        with channel(server.port) as c:
            draft_pb2_grpc.DraftServiceStub(c).SetDefaultDraft(draft_pb2.SetDefaultDraftRequest(name="second"),
                                                               metadata=(("authorization", "Bearer secret"),))
        assert defaults() == {"first": "false", "second": "true"}
    finally:
        loop.run(server.stop())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.addFilter(RequestIdFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def log_records():
    handler, root = _Records(), logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler.records
    root.setLevel(old_level)
    root.removeHandler(handler)


def test_client_request_id_reaches_every_service_log(observed_stub, log_records):
    request = gateway_pb2.GenerateRequest(prompt="The quick brown fox", max_new_tokens=8, num_draft_tokens=2)
    chunks = list(observed_stub.Generate(request, metadata=[(REQUEST_ID_KEY, "req-test-42")], timeout=60))
    assert chunks[-1].stats.request_id == "req-test-42"
    messages = {r.getMessage() for r in log_records if r.request_id == "req-test-42"}
    for method in ("/specdec.v1.Gateway/Generate", "/specdec.v1.TargetService/Sequence",
                   "/specdec.v1.DraftService/Sequence"):
        assert f"{method} started" in messages, method
    assert any(m.startswith("finished:") for m in messages)


def test_gateway_makes_a_request_id_when_the_client_sends_none(observed_stub):
    _, _, final = generate(observed_stub, prompt="x", max_new_tokens=2)
    assert len(final.stats.request_id) == 32


def test_malformed_request_id_is_rejected_and_counted_as_invalid(observed_gateway, observed_stub, scrape):
    def invalid() -> float:
        return scrape(observed_gateway.metrics_port).value("specdec_gateway_requests_total", api="grpc",
                                                           outcome="invalid_request")

    before = invalid()
    request = gateway_pb2.GenerateRequest(prompt="x", max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        list(observed_stub.Generate(request, metadata=[(REQUEST_ID_KEY, "has spaces")], timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert REQUEST_ID_KEY in e.value.details()
    assert invalid() == before + 1


def test_every_service_exports_its_process_and_garbage_collector_figures(observed_gateway, observed_target,
                                                                         observed_draft, observed_stub, scrape):
    _run_requests(observed_stub)
    for service in (observed_gateway, observed_target, observed_draft):
        result = scrape(service.metrics_port)
        assert result.value("process_resident_memory_bytes") > 0 and result.value("process_open_fds") > 0
        assert result.value("python_gc_collections_total", generation="0") > 0
        (info,) = result.labelled("python_info")
        assert info["implementation"] == "CPython"
