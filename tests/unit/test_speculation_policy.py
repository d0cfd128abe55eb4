"""The adaptive-k policy: grows while everything is accepted, switches off when nothing is, and
trades acceptance against the measured cost of longer verifies."""
from __future__ import annotations

from gateway.speculation_policy import SpeculationPolicy

MS = 1e-3


def _run(policy: SpeculationPolicy, num_steps: int, accepted_of, verify_s_of, draft_s_per_token: float = 0.2 * MS
         ) -> list[int]:
    ks = []
    for _ in range(num_steps):
        k = policy.next_k()
        policy.record(k, accepted_of(k), verify_s_of(k), k * draft_s_per_token)
        ks.append(k)
    return ks


def test_always_right_draft_speculates_up_to_the_cap():
    ks = _run(SpeculationPolicy(k_max=6), 30, accepted_of=lambda k: k, verify_s_of=lambda k: 5 * MS)
    assert ks[-10:] == [6] * 10


def test_always_wrong_draft_switches_speculation_off_and_only_probes():
    ks = _run(SpeculationPolicy(k_max=6, probe_every=8), 64, accepted_of=lambda k: 0, verify_s_of=lambda k: 5 * MS)
    tail = ks[-32:]
    assert set(tail) <= {0, 1} and tail.count(1) == 4  # off, with a k = 1 probe every 8 steps


def test_speculation_comes_back_when_the_draft_starts_agreeing():
    policy = SpeculationPolicy(k_max=4, probe_every=4)
    _run(policy, 40, accepted_of=lambda k: 0, verify_s_of=lambda k: 5 * MS)
    assert policy.next_k() in (0, 1)
    ks = _run(policy, 40, accepted_of=lambda k: k, verify_s_of=lambda k: 5 * MS)
    assert ks[-5:] == [4] * 5


def test_expensive_verifies_pick_the_k_with_the_most_tokens_per_second():
    verify = lambda k: (40 + 20 * k) * MS  # noqa: E731 - a CPU: each verified token costs half a decode
    accept = {k: round(0.5 * k) for k in range(7)}  # about half of every proposal survives
    ks = _run(SpeculationPolicy(k_max=6), 60, accepted_of=accept.get, verify_s_of=verify,
              draft_s_per_token=5 * MS)
    def rate(k: int, a: float = 0.5) -> float:
        return (1 - a ** (k + 1)) / (1 - a) / (verify(k) + 5 * MS * k)
    best = max(range(7), key=rate)
    assert abs(ks[-1] - best) <= 1 and max(ks[-10:]) < 6


def test_k_max_zero_never_speculates():
    assert _run(SpeculationPolicy(k_max=0), 5, accepted_of=lambda k: k, verify_s_of=lambda k: MS) == [0] * 5
