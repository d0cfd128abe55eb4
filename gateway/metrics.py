"""The gateway's Prometheus metrics: requests by outcome, latency, throughput and speculation.

Speculation counters follow vLLM's spec-decode metrics: per verify step that carried draft
tokens, `draft_tokens_per_pos{position=i}` counts a proposed token at position i and
`accepted_tokens_per_pos{position=i}` an accepted one, so acceptance at position i is their ratio.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.stats import RequestStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
TOKENS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)

# how a request ended: a finish reason, or one of these
OUTCOME_INVALID = "invalid_request"
OUTCOME_CANCELLED = "cancelled"
OUTCOME_UNAVAILABLE = "unavailable"
OUTCOME_REJECTED = "rejected"  # no capacity: the gateway's queue or a model service's KV (RESOURCE_EXHAUSTED)
OUTCOME_ERROR = "error"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specdec_gateway_requests", "Requests by API and outcome (finish reason or error)",
                                ["api", "outcome"], registry=r)
        self.ttft = Histogram("specdec_gateway_time_to_first_token_seconds", "Time from receipt to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specdec_gateway_time_per_output_token_seconds",
                              "Per request: mean time between output tokens after the first",
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.tokens_per_s = Histogram("specdec_gateway_request_tokens_per_second",
                                      "Per request: completion tokens / time from receipt to the last token",
                                      buckets=TOKENS_PER_S_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specdec_gateway_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("specdec_gateway_generation_tokens",
                                         "Completion tokens of finished requests", registry=r)
        self.steps = Counter("specdec_gateway_spec_decode_steps",
                             "Verify steps that carried at least one draft token", registry=r)
        self.draft_tokens = Counter("specdec_gateway_spec_decode_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("specdec_gateway_spec_decode_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.draft_tokens_per_pos = _ByPosition(Counter(
            "specdec_gateway_spec_decode_draft_tokens_per_pos", "Draft tokens proposed at each position (0-based) of a step",
            ["position"], registry=r))
        self.accepted_tokens_per_pos = _ByPosition(Counter(
            "specdec_gateway_spec_decode_accepted_tokens_per_pos",
            "Draft tokens accepted at each position (0-based) of a step", ["position"], registry=r))
        self.chosen_k = Histogram("specdec_gateway_spec_decode_num_draft_tokens",
                                  "Draft tokens proposed per verify step (0: a target-only step, or a drafter "
                                  "that found nothing to propose)",
                                  buckets=K_BUCKETS, registry=r)
        self.forward_seconds = Counter("specdec_gateway_model_forward_seconds",
                                       "Forward time the model services reported for this gateway's requests",
                                       ["service"], registry=r)
        self.waiting = Gauge("specdec_gateway_requests_waiting",
                             "Requests received that have no first token yet (prefill queue and run)", registry=r)
        self.running = Gauge("specdec_gateway_requests_running", "Requests streaming tokens (active streams)",
                             registry=r)

    def record_step(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verify step: k proposed (0 for a target-only step), a prefix of `num_accepted` kept."""
        self.chosen_k.observe(num_draft_tokens)
        if num_draft_tokens == 0:
            return
        self.steps.inc()
        self.draft_tokens.inc(num_draft_tokens)
        self.accepted_tokens.inc(num_accepted)
        self.draft_tokens_per_pos.inc_first(num_draft_tokens)
        self.accepted_tokens_per_pos.inc_first(num_accepted)

    def record_finished(self, stats: RequestStats, num_completion_tokens: int) -> None:
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(num_completion_tokens)
        if num_completion_tokens > 1:  # a one-token request has no time between tokens
            self.tpot.observe(stats.time_per_output_token_s(num_completion_tokens))
        self.tokens_per_s.observe(stats.tokens_per_s(num_completion_tokens))
        self.forward_seconds.labels("draft").inc(stats.draft_forward_ns / 1e9)
        self.forward_seconds.labels("target").inc(stats.target_forward_ns / 1e9)


class _ByPosition:
    """A counter labelled by position whose children are looked up once each: `labels()` takes a lock
    and builds a key, ~2-3 us a call, and a step increments up to 2k of them."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._children: list[Counter] = []

    def inc_first(self, n: int) -> None:
        """Increments positions 0 .. n - 1."""
        while len(self._children) < n:
            self._children.append(self.counter.labels(str(len(self._children))))
        for child in self._children[:n]:
            child.inc()
