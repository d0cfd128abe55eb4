"""The adaptive-k policy: grows while everything is accepted, switches off when nothing is, and
trades acceptance against the measured cost of longer verifies."""
from __future__ import annotations

import random
from collections import Counter
from itertools import pairwise

from gateway.speculation_policy import ProbeSchedule, SpeculationHistory, SpeculationPolicy

MS = 1e-3


def _run(policy: SpeculationPolicy, num_steps: int, accepted_of, verify_s_of, draft_s_per_token: float = 0.2 * MS,
         overhead_s_of=lambda k: 0.0) -> list[int]:
    """`overhead_s_of(k)`: what a step's wall time adds to the two forwards (round trips, the gateway)."""
    ks = []
    for _ in range(num_steps):
        k = policy.next_k()
        verify_s, draft_s = verify_s_of(k), k * draft_s_per_token
        policy.record(k, accepted_of(k), verify_s, draft_s, verify_s + draft_s + overhead_s_of(k))
        ks.append(k)
    return ks


def test_always_right_draft_speculates_up_to_the_cap():
    ks = _run(SpeculationPolicy(k_max=6), 30, accepted_of=lambda k: k, verify_s_of=lambda k: 5 * MS)
    assert ks[-10:].count(6) >= 9  # bar a k measured only once or twice, measured again


def test_always_wrong_draft_switches_speculation_off_and_probes_ever_less_often():
    ks = _run(SpeculationPolicy(k_max=6, probes=ProbeSchedule(every=8)), 100, accepted_of=lambda k: 0,
              verify_s_of=lambda k: 5 * MS)
    assert sum(k > 1 for k in ks[10:]) <= 1  # a k measured once, measured again while k = 1 looked best
    probes = [i for i, k in enumerate(ks) if k == 1 and i >= 30]
    gaps = [b - a for a, b in pairwise(probes)]
    assert len(probes) >= 2 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # 8, 16, 32 ... steps apart


def test_a_new_request_starts_from_what_earlier_requests_of_its_draft_measured():
    history = SpeculationHistory()
    for _ in range(3):  # three requests with a draft that is always wrong
        _run(SpeculationPolicy(k_max=4, history=history), 30, accepted_of=lambda k: 0, verify_s_of=lambda k: 5 * MS)
    fresh = SpeculationPolicy(k_max=4)
    assert fresh.next_k() == 1  # no history: drafts, but a little
    assert SpeculationPolicy(k_max=4, history=history).next_k() == 0  # history: off from the first step


def test_requests_of_a_losing_draft_share_one_probe_schedule_that_backs_off_to_its_cap():
    history = SpeculationHistory(probes=ProbeSchedule(every=8, max_interval=64))
    ks = []
    for _ in range(40):  # forty 24-step requests with a draft that is always wrong
        policy = SpeculationPolicy(k_max=4, history=history, probes=history.probes)
        ks += _run(policy, 24, accepted_of=lambda k: 0, verify_s_of=lambda k: 5 * MS)
    probes = [i for i, k in enumerate(ks) if k > 0 and i >= 24]  # after the first request's exploration
    gaps = [b - a for a, b in pairwise(probes)]
    assert gaps == sorted(gaps) and gaps[-1] == 64  # backs off over requests, not from scratch in each one
    assert len(probes) < 20  # per-request schedules would probe at least twice in each of 39 requests


def test_a_request_that_is_off_keeps_probing_while_others_of_its_draft_draft():
    schedule = ProbeSchedule(every=8)
    winning = SpeculationPolicy(k_max=4, probes=schedule)
    losing = SpeculationPolicy(k_max=4, probes=schedule)
    losing_ks = []
    for _ in range(80):  # interleaved steps of two requests sharing one probe schedule
        _run(winning, 1, accepted_of=lambda k: k, verify_s_of=lambda k: 5 * MS)
        losing_ks += _run(losing, 1, accepted_of=lambda k: 0, verify_s_of=lambda k: 5 * MS)
    assert 3 <= sum(k > 0 for k in losing_ks[-40:]) <= 6  # a probe every 8 steps off, no back-off


def test_a_step_that_drafts_on_its_merits_ends_the_probe_back_off():
    schedule = ProbeSchedule(every=4, max_interval=64)
    for _ in range(3):  # three probes that found nothing: 4 -> 8 -> 16 -> 32 steps apart
        schedule.record_probe(num_accepted=0)
    schedule.count_step_on()  # the draft wins somewhere
    assert [schedule.count_step_off() for _ in range(4)] == [False, False, False, True]


def test_a_request_that_starts_off_does_not_want_its_draft_opened():
    history = SpeculationHistory()
    _run(SpeculationPolicy(k_max=4, history=history), 30, accepted_of=lambda k: 0, verify_s_of=lambda k: 5 * MS)
    assert SpeculationPolicy(k_max=4).is_drafting  # optimistic: the draft is prefilled with the target
    assert not SpeculationPolicy(k_max=4, history=history, probes=history.probes).is_drafting


def test_speculation_comes_back_when_the_draft_starts_agreeing():
    policy = SpeculationPolicy(k_max=4, probes=ProbeSchedule(every=2))
    _run(policy, 12, accepted_of=lambda k: 0, verify_s_of=lambda k: 5 * MS)
    assert policy.next_k() in (0, 1)
    ks = _run(policy, 60, accepted_of=lambda k: k, verify_s_of=lambda k: 5 * MS)
    assert ks[-5:] == [4] * 5


def test_expensive_verifies_pick_the_k_with_the_most_tokens_per_second():
    def verify(k: int) -> float:  # a CPU: each verified token costs half a decode
        return (40 + 20 * k) * MS

    accept = {k: round(0.5 * k) for k in range(7)}  # about half of every proposal survives
    ks = _run(SpeculationPolicy(k_max=6), 60, accepted_of=accept.get, verify_s_of=verify,
              draft_s_per_token=5 * MS)
    def rate(k: int, a: float = 0.5) -> float:
        return (1 - a ** (k + 1)) / (1 - a) / (verify(k) + 5 * MS * k)
    best = max(range(7), key=rate)
    assert abs(ks[-1] - best) <= 1 and max(ks[-10:]) < 6


def _geometric(acceptance: float, seed: int = 0):
    """Accepted tokens of a draft whose every token is accepted with probability `acceptance`."""
    rng = random.Random(seed)

    def accepted_of(k: int) -> int:
        return next((i for i in range(k) if rng.random() >= acceptance), k)
    return accepted_of


def _cpu_verify_s(k: int) -> float:
    return (50 + 5 * k) * MS  # a CPU: a decode step costs ~50 ms, each extra verified token more


def test_a_request_without_history_starts_at_k1_measures_k0_once_then_goes_to_the_best_k():
    ks = _run(SpeculationPolicy(k_max=6), 30, accepted_of=lambda k: k, verify_s_of=lambda k: 5 * MS)
    assert ks[:2] == [1, 0]  # the baseline to beat
    assert ks[2] >= 4 and ks[-1] == 6  # then a jump, not one k at a time: verifies cost the same


def test_later_requests_do_not_measure_k0_again():
    history = SpeculationHistory()
    _run(SpeculationPolicy(k_max=4, history=history), 20, accepted_of=lambda k: k, verify_s_of=lambda k: 5 * MS)
    assert 0 not in _run(SpeculationPolicy(k_max=4, history=history), 20, accepted_of=lambda k: k,
                         verify_s_of=lambda k: 5 * MS)


def test_a_long_k_that_wins_is_found_where_a_line_through_the_short_ks_says_it_loses():
    # CPU-like verifies: the third verified token is dear (52 -> 70 ms), the next two cheap; a line
    # through k = 1 and 2 puts k = 4 at 106 ms, where it would lose
    verify_ms = {0: 50, 1: 52, 2: 70, 3: 73, 4: 76}
    for seed in range(5):
        ks = _run(SpeculationPolicy(k_max=4), 80, _geometric(0.8, seed), lambda k: verify_ms[k] * MS,
                  draft_s_per_token=4 * MS, overhead_s_of=lambda k: (4 if k else 2) * MS)
        assert Counter(ks[-40:]).most_common(1)[0][0] == 4  # 35 tokens/s against 30 at k = 1


def test_a_long_k_is_chosen_where_the_draft_costs_less_per_token_than_at_k1():
    def draft_s(k: int) -> float:  # a fixed part (the committed tokens, the call) and 2 ms a token
        return (12 + 2 * k) * MS if k else 0.0

    for seed in range(5):
        policy, ks = SpeculationPolicy(k_max=4), []
        accepted_of = _geometric(0.6, seed)
        for _ in range(80):
            k = policy.next_k()
            verify_s = (50 + 2 * k) * MS
            policy.record(k, accepted_of(k), verify_s, draft_s(k), verify_s + draft_s(k) + 4 * MS)
            ks.append(k)
        # 28 tokens/s at k = 4 against 23 at k = 1; 14 ms a token, as at k = 1, would say 20 at k = 4
        assert sum(k >= 3 for k in ks[-40:]) > 30


def test_a_k_measured_at_a_bad_moment_is_measured_again_once_forgotten():
    history = SpeculationHistory(forget_after=64)
    cheap = {"verify_s_of": lambda k: (50 + 2 * k) * MS, "draft_s_per_token": 5 * MS}
    _run(SpeculationPolicy(k_max=1, history=history), 30, accepted_of=lambda k: k, **cheap)
    hiccup = SpeculationPolicy(k_max=2, history=history)
    hiccup.record(2, 2, 900 * MS, 10 * MS, 920 * MS)  # the machine stalled in k = 2's first verify
    first_after = _run(SpeculationPolicy(k_max=2, history=history), 30, accepted_of=lambda k: k, **cheap)
    for _ in range(4):  # requests at k = 1 until k = 2's time is forgotten
        last = _run(SpeculationPolicy(k_max=2, history=history), 30, accepted_of=lambda k: k, **cheap)
    assert 2 not in first_after[-10:]
    assert last[-10:] == [2] * 10


# CPU-like forward times (ms) at speed 1: the third verified token is dear, the draft's time grows
# by ~7 ms a token; at acceptance 0.5, k = 1 wins by ~10 % (17.6 tokens/s against 15.8 at k = 2)
_CPU_VERIFY_MS = {0: 62, 1: 66, 2: 84, 3: 90, 4: 96}
_CPU_DRAFT_MS = {0: 0, 1: 15, 2: 23, 3: 30, 4: 37}


def _record_at_speed(policy: SpeculationPolicy, ks: list[int], speed: float, accepted_of) -> None:
    """Steps at `ks` on a machine running at `speed` times the times above (> 1: slower)."""
    for k in ks:
        verify_s, draft_s = speed * _CPU_VERIFY_MS[k] * MS, speed * _CPU_DRAFT_MS[k] * MS
        policy.record(k, accepted_of(k), verify_s, draft_s, verify_s + draft_s + (4 if k else 2) * MS)


def _every_other_accepted():
    """Accepted tokens of a draft whose tried positions are accepted and rejected in turn (0.5)."""
    num_tried = 0

    def accepted_of(k: int) -> int:
        nonlocal num_tried
        accepted = next((i for i in range(k) if (num_tried + i) % 2), k)
        num_tried += accepted + (accepted < k)
        return accepted
    return accepted_of


def test_a_k_not_run_lately_moves_with_the_machine_speed_instead_of_keeping_its_old_time():
    policy, accepted_of = SpeculationPolicy(k_max=4), _every_other_accepted()
    _record_at_speed(policy, [1, 2] * 10 + [0, 3, 4] * 2 + [1], 1.15, accepted_of)  # a slow minute
    _record_at_speed(policy, [2] * 10, 0.9, accepted_of)  # then a fast one, at k = 2
    assert policy.next_k() == 1  # k = 1's time from the slow minute would make k = 2 look better


def test_one_slow_step_does_not_move_a_request_off_its_k():
    policy, accepted_of = SpeculationPolicy(k_max=4), _every_other_accepted()
    _record_at_speed(policy, [1] * 4 + [0, 1, 2, 3, 4] + [1] * 12, 1.0, accepted_of)  # every k measured
    assert policy.next_k() == 1
    _record_at_speed(policy, [1], 2.5, accepted_of)  # the machine stalled in this step
    assert policy.next_k() == 1  # all k are slower for now, not k = 1 for the next several steps


def test_is_drafting_says_whether_the_next_step_drafts():
    policy = SpeculationPolicy(k_max=4, probes=ProbeSchedule(every=1000))
    for accepted_of in [lambda k: k] * 10 + [lambda k: 0] * 20:
        is_drafting = policy.is_drafting
        k = policy.next_k()
        assert (k > 0) == is_drafting
        policy.record(k, accepted_of(k), 5 * MS, k * MS, (6 + k) * MS)


def test_a_few_rejections_in_a_row_do_not_switch_a_good_draft_off():
    history = SpeculationHistory()
    for seed in range(3):  # earlier requests: accepted 55 % of the time, k = 1 wins clearly
        _run(SpeculationPolicy(k_max=4, history=history), 40, _geometric(0.55, seed), _cpu_verify_s,
             draft_s_per_token=5 * MS, overhead_s_of=lambda k: (4 if k else 1) * MS)
    policy = SpeculationPolicy(k_max=4, history=history)
    assert policy.is_drafting
    _run(policy, 3, accepted_of=lambda k: 0, verify_s_of=_cpu_verify_s, draft_s_per_token=5 * MS,
         overhead_s_of=lambda k: (4 if k else 1) * MS)  # bad luck
    assert policy.is_drafting


def _cpu_history(acceptance: float) -> SpeculationHistory:
    """A draft's history on CPU costs (break-even at ~0.40 acceptance): 60 steps at k = 1, accepted
    with `acceptance`, two at each longer k (a first request measures every k), and 20 at k = 0."""
    history = SpeculationHistory()
    policy = SpeculationPolicy(k_max=4, history=history)
    accepted_of = _geometric(acceptance, seed=1)
    for k in [1] * 60 + [2, 3, 4] * 2 + [0] * 20:
        verify_s, draft_s = _cpu_verify_s(k), 14 * MS * k
        policy.record(k, accepted_of(k), verify_s, draft_s, verify_s + draft_s + (4 if k else 2) * MS)
    return history


def test_a_request_drafts_its_first_step_where_its_draft_only_just_loses():
    cpu = {"verify_s_of": _cpu_verify_s, "draft_s_per_token": 14 * MS,
           "overhead_s_of": lambda k: (4 if k else 2) * MS}
    near = SpeculationPolicy(k_max=4, history=_cpu_history(0.33))
    assert near.is_drafting  # its prompt may suit the draft better than the average: find out
    _run(near, 1, accepted_of=lambda k: 0, **cpu)  # it does not
    assert not near.is_drafting
    assert not SpeculationPolicy(k_max=4, history=_cpu_history(0.1)).is_drafting  # far from break-even: off


def test_the_measured_overhead_of_drafting_steps_can_make_speculation_lose():
    def last_ks(drafting_overhead_s: float) -> list[int]:
        return _run(SpeculationPolicy(k_max=4), 120, _geometric(0.3), verify_s_of=lambda k: 50 * MS,
                    draft_s_per_token=2 * MS, overhead_s_of=lambda k: drafting_overhead_s if k else 0.0)[-30:]
    assert sum(k > 0 for k in last_ks(0.0)) > 25  # the forwards alone: 1.3 tokens in 52 ms beat 1 in 50
    assert sum(k > 0 for k in last_ks(20 * MS)) <= 3  # a round trip of 20 ms: off, a few probes aside


def test_the_catch_up_after_steps_off_is_not_counted_as_drafting_overhead():
    policy = SpeculationPolicy(k_max=1)
    policy.record(1, 1, 50 * MS, 5 * MS, 57 * MS)
    policy.record(0, 0, 50 * MS, 0.0, 51 * MS)
    policy.record(1, 1, 50 * MS, 5 * MS, 200 * MS)  # after a step off: the draft caught up first
    assert policy.is_drafting


def test_k_max_zero_never_speculates():
    assert _run(SpeculationPolicy(k_max=0), 5, accepted_of=lambda k: k, verify_s_of=lambda k: MS) == [0] * 5


def test_a_k_first_measured_at_a_fast_moment_is_left_after_a_few_steps():
    policy, accepted_of = SpeculationPolicy(k_max=2), _every_other_accepted()
    _record_at_speed(policy, [1] * 4 + [0, 1], 1.0, accepted_of)
    _record_at_speed(policy, [2], 0.6, accepted_of)  # its first step: the machine was fast just then
    ks = []
    for _ in range(12):
        ks.append(policy.next_k())
        _record_at_speed(policy, ks[-1:], 1.0, accepted_of)
    assert ks[0] == 2 and ks[-6:].count(1) >= 5  # its next steps tell its cost, not the machine's speed


def test_a_drafting_k_that_lost_on_one_slow_step_is_measured_again_and_wins():
    policy, accepted_of = SpeculationPolicy(k_max=4), _every_other_accepted()
    _record_at_speed(policy, [1], 1.4, accepted_of)  # k = 1's only step so far was slow
    _record_at_speed(policy, [0, 4, 3, 2, 1], 1.0, accepted_of)  # a cold request's first steps
    ks = []
    for _ in range(40):
        ks.append(policy.next_k())
        _record_at_speed(policy, ks[-1:], 1.0, accepted_of)
    assert ks[:4].count(1) <= 1 and ks[-10:].count(1) >= 8  # k = 1 wins by ~10 % once measured again


def test_a_k_mostly_measured_right_after_switching_to_it_is_valued_at_its_own_pace():
    # the 2-core CPU, traced: a step at another k than the step before takes ~15 % longer; k = 2 wins
    # at its own pace (28.9 tokens/s against 27.8 at k = 1, acceptance 0.64) but is measured mostly
    # when a request switches to it, where it would look like 25 tokens/s
    verify_ms, draft_ms = {0: 50, 1: 42, 2: 48, 3: 56, 4: 62}, {0: 0, 1: 13, 2: 19, 3: 27, 4: 32}
    best_counts = []
    for seed in range(6):
        policy, accepted_of, rng, last_k, ks = SpeculationPolicy(k_max=4), _geometric(0.64, seed), random.Random(seed), None, []
        for _ in range(300):
            k = policy.next_k()
            penalty = 1.15 if k != last_k else 1.0
            verify_s, draft_s = (penalty * rng.lognormvariate(0, 0.1) * ms * MS for ms in (verify_ms[k], draft_ms[k]))
            policy.record(k, accepted_of(k), verify_s, draft_s, verify_s + draft_s + (4 if k else 2) * MS)
            ks.append(last_k := k)
        best_counts.append(ks[-150:].count(2))
    assert sorted(best_counts)[1] > 75, best_counts  # k = 2 in most of the later steps, in all but one seed
