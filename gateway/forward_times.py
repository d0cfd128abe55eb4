"""A forward's time by k (the tokens a step drafts), as the adaptive speculation policy
(gateway/speculation_policy.py) estimates it from the services' reported forward times."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

JITTER = 0.2  # of a forward's log time, step to step (2-core VM: p10-p90 about -25 % to +25 %)
SPEED_DRIFT = 1e-3  # variance a step of the log speed shared by all k (the machine, a GPU's load)
COST_DRIFT = 1e-4  # variance a step of a k's log cost (a GPU's batch makes long verifies dearer)
SPEED = -1  # ForwardTimes' index of the speed, next to the costs' (k >= 0)


@dataclass
class ForwardTimes:
    """A forward's time by k: log time(k) = log speed + log cost(k) + jitter, followed by a Kalman
    filter over the log speed and the log costs.

    The speed is shared by all k and drifts (`SPEED_DRIFT` a step), the costs hardly (`COST_DRIFT`),
    a step's time jitters (`JITTER`). Per-k averages mixed up the machine with k: a k measured in a
    slow minute kept its slow time while the k that ran got faster (traced: k = 1 at 69 ms from
    earlier requests against ~58 at k = 2 now, where fixed k = 1 won by 12 %). The filter puts what
    a step says where it is uncertain: a k measured once or twice learns its cost from its next
    steps, a well-measured k's steps move the speed and so every k's time. What it cannot tell
    apart (a k that runs alone: its cost or the machine?) stays uncertain, and `spread` says how
    much, so another k can be measured beside it."""

    mean: dict[int, float] = field(default_factory=lambda: {SPEED: 0.0})  # log speed, log cost by k
    cov: dict[int, dict[int, float]] = field(default_factory=lambda: {SPEED: {SPEED: 0.0}})

    def add(self, k: int, seconds: float) -> None:
        if seconds <= 0:
            return
        for i in self.cov:
            self.cov[i][i] += SPEED_DRIFT if i == SPEED else COST_DRIFT
        y = math.log(seconds)
        if k not in self.mean:  # the cost this step says, as uncertain as the speed, plus its jitter
            self.mean[k] = y - self.mean[SPEED]
            for i in self.cov:
                self.cov[i][k] = -self.cov[i][SPEED]
            self.cov[k] = {i: self.cov[i][k] for i in self.cov}
            self.cov[k][k] = self.cov[SPEED][SPEED] + JITTER**2
            return
        # y = log speed + log cost(k) + jitter: h = e_speed + e_k
        h_cov = {j: self.cov[SPEED][j] + self.cov[k][j] for j in self.cov}  # h . cov
        variance = h_cov[SPEED] + h_cov[k] + JITTER**2
        innovation = y - self.mean[SPEED] - self.mean[k]
        gains = {i: h_cov[i] / variance for i in self.cov}
        for i, gain in gains.items():
            self.mean[i] += gain * innovation
            for j in self.cov:
                self.cov[i][j] -= gain * h_cov[j]

    def by_k(self) -> dict[int, float]:
        return {k: math.exp(self.mean[SPEED] + m) for k, m in self.mean.items() if k != SPEED}

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
        kept = [i for i in other.mean if i <= k_max]
        self.mean = {i: other.mean[i] for i in kept}
        self.cov = {i: {j: other.cov[i][j] for j in kept} for i in kept}
