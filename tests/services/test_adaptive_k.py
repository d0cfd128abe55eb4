"""Adaptive k through the real trio: greedy outputs never change, speculation switches off with an
always-wrong draft, and a pinned k is used for every step. (That k grows to its cap with an
always-right draft is shown on the policy itself in tests/unit/test_speculation_policy.py: here
the tiny draft costs as much as the tiny target, so speculating gains nothing and the policy
rightly does not insist on it.)"""
from __future__ import annotations

import pytest

from harness import generate

PROMPT = "Speculative decoding is"


@pytest.mark.parametrize("drafter", ["identical", "perturbed", "unrelated", "ngram"])
def test_adaptive_k_keeps_greedy_output_identical_to_target_only(gateway_stub, drafter):
    tokens, _, final = generate(gateway_stub(drafter), prompt=PROMPT, max_new_tokens=48)  # k left to the policy
    assert tokens == generate(gateway_stub("none"), prompt=PROMPT, max_new_tokens=48)[0]
    assert sum(final.stats.num_steps_by_k) == final.stats.num_verify_steps
    assert len(final.stats.num_steps_by_k) <= 5  # never past the gateway's cap (k = 4)


def test_always_wrong_draft_switches_speculation_off(gateway_stub):
    _, _, final = generate(gateway_stub("unrelated"), prompt=PROMPT, max_new_tokens=96)
    by_k = list(final.stats.num_steps_by_k)
    assert by_k[0] > 0.6 * sum(by_k)  # mostly target-only steps, with a few probes and the first tries
    assert final.stats.acceptance_rate < 0.2


def test_pinned_k_is_used_for_every_step(gateway_stub):
    _, _, final = generate(gateway_stub("unrelated"), prompt=PROMPT, max_new_tokens=32, num_draft_tokens=2)
    by_k = list(final.stats.num_steps_by_k)
    assert len(by_k) == 3 and by_k[2] >= sum(by_k) - 2  # the last steps are cut short by max_new_tokens
