"""A forward's time by k (the tokens a step drafts), as the adaptive speculation policy
(gateway/speculation_policy.py) estimates it from the services' reported forward times."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

JITTER = 0.2  # of a forward's log time, step to step (2-core VM: p10-p90 about -25 % to +25 %)
SPEED_DRIFT = 1e-3  # variance a step of the log speed shared by all k (the machine, a GPU's load)
COST_DRIFT = 1e-4  # variance a step of a k's log cost (a GPU's batch makes long verifies dearer)
SWITCH_PRIOR = 0.1  # standard deviation of the log penalty of a step whose k differs from the last one's
SPEED = -1  # ForwardTimes' index of the speed, next to the costs' (k >= 0)
SWITCH = -2  # and of the penalty of a step at another k than the step before
DRIFT = {SPEED: SPEED_DRIFT, SWITCH: 0.0}  # a step's variance added to each term (the costs: COST_DRIFT)


@dataclass
class ForwardTimes:
    """A forward's time by k: log time(k) = log speed + log cost(k) + jitter, followed by a Kalman
    filter over the log speed and the log costs.

    The speed is shared by all k and drifts (`SPEED_DRIFT` a step), the costs hardly (`COST_DRIFT`),
    a step's time jitters (`JITTER`); a step at another k than its request's step before pays a
    penalty of its own (`SWITCH`, learnt like the costs): on the 2-core CPU such a verify took ~15 %
    longer than one at the same k (traced: k = 2 55 ms after a switch, 48 after k = 2), so a k
    measured mostly when a request switched to it (a runner-up, below) looked dearer than it runs.
    `by_k` is each k's time at its own pace, without the penalty. Per-k averages mixed up the
    machine with k: a k measured in a slow minute kept its slow time while the k that ran got
    faster (traced: k = 1 at 69 ms from earlier requests against ~58 at k = 2 now, where fixed
    k = 1 won by 12 %). The filter puts what
    a step says where it is uncertain: a k measured once or twice learns its cost from its next
    steps, a well-measured k's steps move the speed and so every k's time. What it cannot tell
    apart (a k that runs alone: its cost or the machine?) stays uncertain, and `spread` says how
    much, so another k can be measured beside it."""

    mean: dict[int, float] = field(default_factory=lambda: {SPEED: 0.0, SWITCH: 0.0})  # log speed, penalty, costs
    cov: dict[int, dict[int, float]] = field(
        default_factory=lambda: {SPEED: {SPEED: 0.0, SWITCH: 0.0}, SWITCH: {SPEED: 0.0, SWITCH: SWITCH_PRIOR**2}})

    def add(self, k: int, seconds: float, switched: bool = False) -> None:
        """A step at k took `seconds`; `switched`: the step before ran another k (or none)."""
        if seconds <= 0:
            return
        for i in self.cov:
            self.cov[i][i] += DRIFT.get(i, COST_DRIFT)
        terms = [SPEED, SWITCH] if switched else [SPEED]
        y = math.log(seconds)
        if k not in self.mean:  # the cost this step says, as uncertain as its other terms, plus its jitter
            self.mean[k] = y - sum(self.mean[i] for i in terms)
            for i in self.cov:
                self.cov[i][k] = -sum(self.cov[i][t] for t in terms)
            self.cov[k] = {i: self.cov[i][k] for i in self.cov}
            self.cov[k][k] = sum(self.cov[t][u] for t in terms for u in terms) + JITTER**2
            return
        # y = log speed + log cost(k) (+ log penalty) + jitter: h = e_speed + e_k (+ e_switch)
        terms.append(k)
        h_cov = {j: sum(self.cov[t][j] for t in terms) for j in self.cov}  # h . cov
        variance = sum(h_cov[t] for t in terms) + JITTER**2
        innovation = y - sum(self.mean[t] for t in terms)
        gains = {i: h_cov[i] / variance for i in self.cov}
        for i, gain in gains.items():
            self.mean[i] += gain * innovation
            for j in self.cov:
                self.cov[i][j] -= gain * h_cov[j]

    def by_k(self) -> dict[int, float]:
        return {k: math.exp(self.mean[SPEED] + m) for k, m in self.mean.items() if k >= 0}

    def spread(self, k: int, other: int) -> float:
        """The standard deviation of log(time(k) / time(other)); 0 where either was not measured."""
        if k not in self.mean or other not in self.mean:
            return 0.0
        return math.sqrt(max(self.cov[k][k] + self.cov[other][other] - 2 * self.cov[k][other], 0.0))

    def forget(self, k: int) -> None:
        if k in self.mean:
            del self.mean[k], self.cov[k]
            for row in self.cov.values():
                del row[k]

    def start_at(self, other: ForwardTimes, k_max: int) -> None:
        kept = [i for i in other.mean if i <= k_max]  # the speed and the penalty too
        self.mean = {i: other.mean[i] for i in kept}
        self.cov = {i: {j: other.cov[i][j] for j in kept} for i in kept}
