"""Adaptive speculation: how many tokens (k) one request drafts in each step.

The model: each draft token is accepted with probability a, so a step proposing k tokens commits
E(k) = 1 + a + ... + a^k tokens on average. Its wall time, as the gateway sees it, is

  t(k) = verify(k) + draft(k) + overhead(k > 0)

verify(k) is the target's forward over k + 1 tokens and draft(k) the draft's forwards proposing k
tokens, both as the services report them with every answer (so they reflect the target's current
batch load: a verify of k + 1 tokens costs about one decode step on a GPU at small batch, and much
more on a CPU or a busy GPU), each kept as a cost by k times a speed that all k share, followed by
a Kalman filter (gateway/forward_times.py: the machine's drift and a step's jitter move every k
alike instead of whichever k ran then, and the extra time of a step right after a change of k is
learnt apart, so a k measured mostly when a request switched to it is not judged by those steps).
overhead is the rest of the step's wall time, measured around the whole step in the loop: gRPC
round trips, (de)serialisation, the gateway's own work -
kept apart for steps that draft and steps that do not, because a drafting step adds a round trip to
the draft service that no forward time shows (on the 2-core CPU: ~4 ms per drafting step against
~2 ms per target-only step, next to a 14 ms draft forward and a 57 ms verify), as moving averages.
Each step takes the k in [0, k_max] with the most committed tokens per second,
E(k) / t(k), so speculation grows where drafts are accepted and verifies are cheap, shrinks as
acceptance falls or verifies get expensive, and switches off (k = 0) where it would lose.

A k not measured yet is estimated optimistically, and then measured: its forward times are those of
the longest measured k below it (a longer forward costs no less), so it is tried wherever the extra
tokens it may commit could pay, and from then on its measured times decide. One drafting step in
`REMEASURE_EVERY` measures another drafting k again where it would win were its times one standard
deviation shorter than estimated (relative to the best k's, as the filter knows them): a k whose
first step or two were slow gets another try, beside the best k at the same speed (traced: one
verify at k = 1 of 73 ms, against ~58 usually, sent a cold request to k = 3 for good). A cold
request thus measures each k that might win. Estimates from the short k (a line through them, or
the draft's time per token at k = 1) misjudge the long ones: on the 2-core CPU, in one run, a verify took ~62 ms
at k = 0, ~58 at k = 1 to 3 and ~70 at k = 4, the draft 17 ms at k = 1 but 24 at k = 2 and 28 at
k = 3 (its first forward also takes the tokens the last verify committed); and growing one k at a
time stops at the first k that loses, short of a longer one that wins. A draft's history forgets a
k's times after `forget_after` steps without it (bar the drafting k measured last), so a k measured
once at a bad moment, or before the machine's speed or load changed, is tried again.

Growing is earned, not assumed: a request with no history starts at k = 1 (not k_max) from a modest
acceptance prior (worth `PRIOR_TRIALS` draft positions), measures k = 0 in its second step for a
baseline to compare with (later requests start from its history, and measure it again only once it
is forgotten), and then goes to the k its estimates favour. Acceptance is a count of accepted over
tried draft positions, the oldest fading past `ACCEPTANCE_MEMORY` (not a per-step average with a
heavy weight: three unlucky steps must not switch a good draft off, since a request that is off
learns nothing more until it probes).

Steps that follow a step at k = 0 do not count towards the drafting overhead or the draft's forward
time: they include the draft's catch-up on the tokens it missed (the whole context, the first time),
a cost of switching on, not of drafting.

While off, a request probes k = 1 on a `ProbeSchedule`, so it notices when the draft starts agreeing
again. Probing is kept cheap, because with a draft that always loses every probe is pure cost: a
request that is off touches the draft service not at all (gateway/lazy_draft.py opens its draft
sequence only when a step drafts), so a probe also pays the draft's catch-up. The rule: a draft's
requests share one schedule (in its `SpeculationHistory`); it counts the steps they run with k = 0
and probes after `every` (8) of them, twice as many after each probe that accepted nothing, at most
`max_interval` (256), and `every` again after a probe that accepted a token or a step of any of its
requests that drafted on its merits. So a draft that loses everywhere is probed about once per 256
target steps over all its requests, not twice per request, while one that wins on some prompts and
not on others (near break-even, where a probe costs little) is probed every 8 steps off: a request
that started off on the history's word finds out soon that its own prompt suits the draft.

Requests learn from each other: a `SpeculationHistory` per draft and decoding mode (greedy or
sampled: they accept differently; kept by the gateway) follows the estimates of the requests that
used it, slowly, and a new request starts from it instead of from the prior - so with a draft that
loses, requests after the first start at k = 0 (and, unless a probe falls due, never open the draft),
and with one that wins they start at the k that won. A request whose draft's history says off, but
only just (it would win at `START_OPTIMISM` times the history's acceptance), drafts its first step
anyway: its own prompt may suit the draft better, and the history cannot tell.

Output is unaffected: the loop is lossless for every k. A request can pin k instead
(GenerateRequest.num_draft_tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.forward_times import ForwardTimes

ACCEPTANCE_PRIOR = 0.5  # modest: a cold request drafts (k = 1) but must measure before it grows
PRIOR_TRIALS = 2  # what the prior counts for, in draft positions: a few steps overrule it
SEED_TRIALS = 8  # what a draft's history counts for in a new request (its prompt may differ)
ACCEPTANCE_MEMORY = 32  # draft positions a request's acceptance remembers
START_OPTIMISM = 1.5  # prompts' acceptance varies around their draft's average (CPU, greedy: 0.22-0.6)
RPC_PRIOR_S = 2e-4  # the extra round trip of a drafting step before one is measured (loopback)
REMEASURE_EVERY = 8  # drafting steps: one in this many may measure another drafting k again


@dataclass
class _Average:
    """An exponential moving average that starts at its first sample."""

    weight: float
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


@dataclass
class _Acceptance:
    """Per-token acceptance: accepted draft positions over tried ones, the oldest fading once more
    than `memory` positions were tried (a running count that starts at a prior of a few trials)."""

    memory: float
    num_accepted: float = 0.0
    num_trials: float = 0.0

    @property
    def value(self) -> float:
        return self.num_accepted / self.num_trials if self.num_trials else ACCEPTANCE_PRIOR

    def start_at(self, acceptance: float, num_trials: float) -> None:
        self.num_accepted, self.num_trials = acceptance * num_trials, num_trials

    def add(self, num_accepted: int, num_draft_tokens: int) -> None:
        # the accepted prefix ends at the first rejection: num_accepted positions succeeded, one
        # failed unless all were accepted, the rest were never tried (a geometric sample)
        self.num_accepted += num_accepted
        self.num_trials += num_accepted + (num_accepted < num_draft_tokens)
        if self.num_trials > self.memory:
            fade = self.memory / self.num_trials
            self.num_accepted, self.num_trials = self.num_accepted * fade, self.memory


@dataclass
class _Estimates:
    """What steps measured: acceptance, and the three parts of a step's wall time, the two forward
    times by k. With `forget_after`, a k's times are forgotten once that many steps passed without
    it (bar the drafting k measured last, so a draft's cost is never unknown again): a GPU's load
    changes the costs by k, and a k measured at a bad moment must get another try."""

    weight: float  # of the newest step in the overhead averages
    acceptance: _Acceptance
    forget_after: int | None = None  # steps; None: never
    verify_s: ForwardTimes = field(init=False)  # by k
    draft_s: ForwardTimes = field(init=False)  # by k > 0, of steps that paid no catch-up
    overhead_s: dict[bool, _Average] = field(init=False)  # by whether the step drafted
    num_steps: int = field(default=0, init=False)
    _last_step: dict[int, int] = field(default_factory=dict, init=False)  # by k: when last measured

    def __post_init__(self) -> None:
        self.verify_s, self.draft_s = ForwardTimes(), ForwardTimes()
        self.overhead_s = {False: _Average(self.weight), True: _Average(self.weight)}

    def seed(self, other: _Estimates, k_max: int) -> None:
        """Starts from `other`'s values (keeping this one's weights)."""
        self.acceptance.start_at(other.acceptance.value, SEED_TRIALS)
        self.verify_s.start_at(other.verify_s, k_max)
        self.draft_s.start_at(other.draft_s, k_max)
        for is_drafting, average in other.overhead_s.items():
            self.overhead_s[is_drafting].value = average.value

    def record(self, k: int, num_accepted: int, verify_s: float, draft_s: float, step_s: float,
               is_steady: bool, switched: bool) -> None:
        """`is_steady`: the step paid no catch-up, its draft time and overhead are a drafting step's own;
        `switched`: the request's step before ran another k (or was its prefill)."""
        self.verify_s.add(k, verify_s, switched)
        if k > 0:
            self.acceptance.add(num_accepted, k)
        if k == 0 or is_steady:
            self.overhead_s[k > 0].add(max(step_s - verify_s - draft_s, 0.0))
        if k > 0 and is_steady:
            self.draft_s.add(k, draft_s, switched)
        self.num_steps += 1
        self._last_step[k] = self.num_steps
        if self.forget_after is not None:
            self._forget_old(self.forget_after)

    def _forget_old(self, forget_after: int) -> None:
        latest_drafting = max((k for k in self._last_step if k > 0), key=self._last_step.get, default=None)
        for k, step in list(self._last_step.items()):
            if k != latest_drafting and self.num_steps - step > forget_after:
                del self._last_step[k]
                self.verify_s.forget(k)
                self.draft_s.forget(k)


@dataclass
class ProbeSchedule:
    """When a request that is not drafting tries k = 1: after `interval` steps off, the interval
    doubling after each probe that accepted nothing (at most `max_interval`), `every` again after one
    that accepted a token or a step that drafted on its merits."""

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
        """A step that drafts on its merits: the draft wins somewhere, so the back-off (meant for a
        draft that loses everywhere) starts over. The steps off keep counting: of requests sharing
        the schedule, those that draft must not keep the others from probing."""
        self.interval = self.every

    def record_probe(self, num_accepted: int) -> None:
        self.interval = min(self.interval * 2, self.max_interval) if num_accepted == 0 else self.every


@dataclass
class SpeculationHistory:
    """What the requests that used one draft (in one decoding mode) measured, followed slowly, and
    the probe schedule they share."""

    weight: float = 0.05  # of the newest step in the overhead averages
    acceptance_memory: float = 256  # draft positions
    forget_after: int = 256  # steps without a k before its times are measured afresh
    estimates: _Estimates = field(init=False)
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)

    def __post_init__(self) -> None:
        self.estimates = _Estimates(self.weight, _Acceptance(self.acceptance_memory), self.forget_after)

    @property
    def is_learned(self) -> bool:
        return bool(self.estimates.verify_s.by_k())


@dataclass
class SpeculationPolicy:
    k_max: int
    acceptance_prior: float = ACCEPTANCE_PRIOR
    weight: float = 0.3  # of the newest step in the overhead averages
    history: SpeculationHistory | None = None  # shared with the draft's other requests
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)  # the history's, to share it
    _estimates: _Estimates = field(init=False)
    _planned_k: int = field(init=False)  # the next step's k on the estimates, probes aside
    _probing: bool = field(default=False, init=False)
    _was_drafting: bool = field(init=False)  # the previous step drafted (its draft is caught up)
    _last_k: int | None = field(default=None, init=False)  # the previous step's (None: the prefill)
    _num_drafting_plans: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._estimates = _Estimates(self.weight, _Acceptance(ACCEPTANCE_MEMORY))
        self._estimates.acceptance.start_at(self.acceptance_prior, PRIOR_TRIALS)
        if self.history is not None and self.history.is_learned:
            self._estimates.seed(self.history.estimates, self.k_max)
        self._planned_k = self._plan(is_first_step=True)
        self._was_drafting = self.is_drafting  # the loop opens the draft with the target's prefill then

    @property
    def is_drafting(self) -> bool:
        """Whether the next step will draft on the estimates (probes aside); no side effects."""
        return self._planned_k > 0

    @property
    def acceptance(self) -> float:
        return self._estimates.acceptance.value

    def next_k(self) -> int:
        """The k for the next step."""
        if self._planned_k > 0:
            self.probes.count_step_on()
            return self._planned_k
        if self.k_max == 0 or 0 not in self._estimates.verify_s.by_k():
            return 0  # the baseline's measurement is not a step off: no probe in its place
        self._probing = self.probes.count_step_off()
        return 1 if self._probing else 0

    def record(self, k: int, num_accepted: int, verify_s: float, draft_s: float, step_s: float) -> None:
        """What a step of k draft tokens gave: accepted tokens, the two services' forward times and
        the step's wall time in the gateway (from the end of the previous step)."""
        is_steady, switched = self._was_drafting, k != self._last_k
        self._estimates.record(k, num_accepted, verify_s, draft_s, step_s, is_steady, switched)
        if self.history is not None:
            self.history.estimates.record(k, num_accepted, verify_s, draft_s, step_s, is_steady, switched)
        self._was_drafting, self._last_k = k > 0, k
        if self._probing:
            self.probes.record_probe(num_accepted)
            self._probing = False
        self._planned_k = self._plan(is_first_step=False)

    def _plan(self, is_first_step: bool) -> int:
        """The best k on the estimates. Before anything is measured, k = 1; once something is, k = 0
        first where k = 0 was never measured (the baseline that drafting must beat). For a request's
        first step, k = 1 where the estimates say off but its draft would win at START_OPTIMISM times
        their acceptance: prompts differ, and near break-even finding out costs little."""
        verify_s = self._estimates.verify_s.by_k()
        if self.k_max == 0:
            return 0
        if not verify_s:
            return 1
        best = self._best_k(self.acceptance)
        if best > 0 and 0 not in verify_s:
            return 0
        if best == 0 and is_first_step and self._best_k(self.acceptance * START_OPTIMISM) > 0:
            return 1
        if best > 0:
            self._num_drafting_plans += 1
            if self._num_drafting_plans % REMEASURE_EVERY == 0:
                return self._runner_up(best)
        return best

    def _runner_up(self, best: int) -> int:
        """The drafting k that would beat `best` if its times relative to best's were one standard
        deviation (`ForwardTimes.spread`) shorter than estimated, else `best`. Measured beside `best`, at
        the same speed, a k that lost on a slow step or two gets its due; one that lost on many is
        not tried again. It costs at most one step in REMEASURE_EVERY, each by about a spread."""
        rate = self._tokens_per_s(best, self.acceptance)
        others = [k for k in range(1, self.k_max + 1) if k != best]
        runner_up = max(others, key=lambda k: self._tokens_per_s(k, self.acceptance, best), default=best)
        return runner_up if self._tokens_per_s(runner_up, self.acceptance, best) > rate else best

    def _best_k(self, acceptance: float) -> int:
        return max(range(self.k_max + 1), key=lambda k: self._tokens_per_s(k, acceptance))

    def _tokens_per_s(self, k: int, acceptance: float, hopeful_against: int | None = None) -> float:
        """`hopeful_against`: with k's times a spread shorter relative to that k's."""
        a = min(acceptance, 0.999)
        expected_tokens = (1 - a ** (k + 1)) / (1 - a)
        step_s = self._forward_estimate(k, hopeful_against) + self._overhead_estimate(k > 0)
        return expected_tokens / step_s if step_s > 0 else float(k)

    def _forward_estimate(self, k: int, hopeful_against: int | None = None) -> float:
        """Both forwards of a step at k (drafting no tokens costs nothing)."""
        verify, draft = self._estimates.verify_s, self._estimates.draft_s
        verify_s = _estimate(verify.by_k(), k) or 0.0
        draft_s = _estimate({0: 0.0} | draft.by_k(), k) or 0.0
        if hopeful_against is not None:
            verify_s *= math.exp(-verify.spread(k, hopeful_against))
            draft_s *= math.exp(-draft.spread(k, hopeful_against))
        return verify_s + draft_s

    def _overhead_estimate(self, is_drafting: bool) -> float:
        measured = self._estimates.overhead_s
        if measured[is_drafting].value is not None:
            return measured[is_drafting].value
        other = measured[not is_drafting].value or 0.0
        return other + RPC_PRIOR_S if is_drafting else other


def _estimate(measured: dict[int, float], k: int) -> float | None:
    """A forward time at k from the times measured by k: k's own, or for a k not measured, the time
    of the longest measured k below it (a longer forward costs no less: optimistic, and trying k
    measures it), else of the shortest above it; None where nothing was measured."""
    if k in measured or not measured:
        return measured.get(k)
    below = [m for m in measured if m < k]
    return measured[max(below)] if below else measured[min(measured)]
