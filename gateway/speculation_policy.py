"""Adaptive speculation: how many tokens (k) one request drafts in each step.

The model: each draft token is accepted with probability a, so a step proposing k tokens commits
E(k) = 1 + a + ... + a^k tokens on average. It costs the target's verify of k + 1 tokens plus the
draft's k-token proposal. Both times are measured as the request runs - the services report the
forward time of every answer, which already reflects the target's current batch load (a verify of
k + 1 tokens costs about one decode step on a GPU at small batch, and much more on a CPU or a busy
GPU) - and kept per k as moving averages. A k not measured yet gets the verify time of a straight
line through the measured ones (t = t0 + slope * k, slope >= 0; the nearest one while only one k
is measured) and the draft's mean per-token time. Each step takes the k in [0, k_max] with the most
committed tokens per second, E(k) / (t_verify(k) + t_draft(k) + t_rpc), so speculation grows while
everything is accepted, shrinks as acceptance falls or verifies get expensive, and switches off
(k = 0) where it would lose. It explores: the k just below the best is tried once when it has no
measurement (the line needs two points), and while off it probes k = 1 on a `ProbeSchedule`, so it
notices when the draft starts agreeing again.

Probing is kept cheap, because with a draft that always loses every probe is pure cost: a request
that is off touches the draft service not at all (gateway/lazy_draft.py opens its draft sequence
only when a step drafts), so a probe also pays the draft's catch-up prefill of the whole context
besides the longer verify. The rule: a draft's requests share one schedule (in its
`SpeculationHistory`); it counts the steps they run with k = 0 and probes after `every` (8) of them,
twice as many after each probe that accepted nothing, at most `max_interval` (256), and `every`
again after a probe that accepted a token. So a losing draft is probed about once per 256 target
steps over all its requests (well under 1% of the time on a CPU), not twice per request.

Requests learn from each other: a `SpeculationHistory` per draft and decoding mode (greedy or sampled:
they accept differently; kept by the gateway) follows the estimates of the requests that used it,
slowly, and a new request starts from it instead of from the
optimistic prior - so with a draft that loses, requests after the first start at k = 0 (and, unless
a probe falls due, never open the draft).

Output is unaffected: the loop is lossless for every k. A request can pin k instead
(GenerateRequest.num_draft_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Average:
    """An exponential moving average that starts at its first sample."""

    weight: float
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


@dataclass
class ProbeSchedule:
    """When a request that is not drafting tries k = 1: after `interval` steps off, the interval
    doubling after each probe that accepted nothing (at most `max_interval`), `every` again after one
    that accepted a token."""

    every: int = 8
    max_interval: int = 256
    interval: int = field(init=False)
    num_steps_off: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.interval = self.every

    def count_step_off(self) -> bool:
        """Counts a step that would not draft; True: probe in this one instead."""
        self.num_steps_off += 1
        if self.num_steps_off < self.interval:
            return False
        self.num_steps_off = 0
        return True

    def count_step_on(self) -> None:
        """A step that drafts on its merits: the steps off start counting again."""
        self.num_steps_off = 0

    def record_probe(self, num_accepted: int) -> None:
        self.interval = min(self.interval * 2, self.max_interval) if num_accepted == 0 else self.every


@dataclass
class SpeculationHistory:
    """What the requests that used one draft measured, followed slowly (weight per step), and the
    probe schedule they share."""

    weight: float = 0.05
    acceptance: _Average = field(init=False)
    verify_s: dict[int, _Average] = field(default_factory=dict)
    draft_s_per_token: _Average = field(init=False)
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)

    def __post_init__(self) -> None:
        self.acceptance = _Average(self.weight)
        self.draft_s_per_token = _Average(self.weight)


@dataclass
class SpeculationPolicy:
    k_max: int
    acceptance_prior: float = 0.8  # optimistic: start by speculating, measure, then adjust
    weight: float = 0.3  # of the newest step in the moving averages
    rpc_s: float = 2e-4  # one extra round trip per step when drafting (measured ~0.2 ms on loopback)
    history: SpeculationHistory | None = None  # shared with the draft's other requests
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)  # the history's, to share it
    _acceptance: _Average = field(init=False)
    _verify_s: dict[int, _Average] = field(default_factory=dict, init=False)
    _draft_s_per_token: _Average = field(init=False)
    _probing: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        h = self.history
        learned = h is not None and h.acceptance.value is not None
        self._acceptance = _Average(self.weight, h.acceptance.value if learned else self.acceptance_prior)
        self._draft_s_per_token = _Average(self.weight, h.draft_s_per_token.value if learned else None)
        if learned:
            self._verify_s = {k: _Average(self.weight, a.value) for k, a in h.verify_s.items() if k <= self.k_max}

    @property
    def is_drafting(self) -> bool:
        """Whether the estimates favour drafting now (probes aside); no side effects."""
        return self._best_k() > 0

    def next_k(self) -> int:
        """The k for the next step."""
        if self.k_max == 0:
            return 0
        if not self._verify_s:  # nothing measured yet: speculate as far as allowed
            return self.k_max
        best = self._best_k()
        if best > 0 and best - 1 not in self._verify_s:
            return best - 1  # one measurement below the best: the verify-time line needs two points
        if best > 0:
            self.probes.count_step_on()
            return best
        self._probing = self.probes.count_step_off()
        return 1 if self._probing else 0

    def record(self, k: int, num_accepted: int, verify_s: float, draft_s: float) -> None:
        """What a step of k draft tokens gave: accepted tokens and the two services' forward times."""
        averages = [(self._verify_s, self._acceptance, self._draft_s_per_token)]
        if self.history is not None:
            h = self.history
            averages.append((h.verify_s, h.acceptance, h.draft_s_per_token))
        for verify, acceptance, draft in averages:
            verify.setdefault(k, _Average(acceptance.weight)).add(verify_s)
            if k > 0:
                # the accepted prefix ends at the first rejection: k trials of which num_accepted
                # succeeded, one failed unless all were accepted (a geometric sample of acceptance)
                acceptance.add(num_accepted / (num_accepted + (1 if num_accepted < k else 0)))
                draft.add(draft_s / k)
        if self._probing:
            self.probes.record_probe(num_accepted)
            self._probing = False

    @property
    def acceptance(self) -> float:
        return self._acceptance.value

    def _best_k(self) -> int:
        if self.k_max == 0:
            return 0
        if not self._verify_s:
            return self.k_max
        return max(range(self.k_max + 1), key=self._tokens_per_s)

    def _tokens_per_s(self, k: int) -> float:
        a = min(self._acceptance.value, 0.999)
        expected_tokens = (1 - a ** (k + 1)) / (1 - a)
        step_s = self._verify_estimate(k)
        if k > 0:
            step_s += k * (self._draft_s_per_token.value or 0.0) + self.rpc_s
        return expected_tokens / step_s if step_s > 0 else float(k == self.k_max)

    def _verify_estimate(self, k: int) -> float:
        if k in self._verify_s:
            return self._verify_s[k].value
        points = [(measured, average.value) for measured, average in self._verify_s.items()]
        if len(points) == 1:
            return points[0][1]
        mean_k = sum(x for x, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        slope = sum((x - mean_k) * (t - mean_t) for x, t in points) / sum((x - mean_k) ** 2 for x, _ in points)
        slope = max(slope, 0.0)
        return max(mean_t + slope * (k - mean_k), 1e-9)
