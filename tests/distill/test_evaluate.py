"""`python -m distill.evaluate`'s replay of greedy speculation: scenario checks on the pure function,
and the replay of a teacher-forced match mask against what the real trio reports for the same
greedy request at a pinned k."""
from __future__ import annotations

import pytest

from distill.evaluate import GreedyAcceptance, greedy_acceptance, match_masks
from engine.model_runner import ModelRunner, RuntimeConfig
from harness import generate


def test_a_draft_that_always_agrees_has_every_proposal_accepted():
    assert greedy_acceptance([[True] * 9], k=2) == GreedyAcceptance(2, 1.0, 3.0)


def test_a_draft_that_never_agrees_emits_one_token_per_step():
    assert greedy_acceptance([[False] * 5], k=3) == GreedyAcceptance(3, 0.0, 1.0)


def test_a_step_stops_at_the_first_mismatch_and_the_target_adds_its_token():
    # k = 2: positions 0-1 accepted, 2 recovered by the target; then 3 accepted and the answer ends
    result = greedy_acceptance([[True, True, False, True]], k=2)
    assert result == GreedyAcceptance(2, pytest.approx(3 / 3), pytest.approx(5 / 2))
    # k = 1 over the same mask: steps at 0, 2 (rejected), 3
    assert greedy_acceptance([[True, True, False, True]], k=1) == GreedyAcceptance(1, pytest.approx(2 / 3),
                                                                                 pytest.approx(5 / 3))


@pytest.mark.parametrize("k", [1, 3])
def test_the_replay_matches_the_trios_own_count_of_accepted_tokens(gateway_stub, model_dirs, tokenizer, k):
    prompt = "Speculative decoding is"
    tokens, _, final = generate(gateway_stub("perturbed"), prompt=prompt, max_new_tokens=40, num_draft_tokens=k)
    draft = ModelRunner(RuntimeConfig(model=str(model_dirs["perturbed"]), kv_cache_tokens=1024))
    (mask,) = match_masks(draft, [(list(tokenizer.encode(prompt)), tokens)])
    assert 0 < sum(mask) < len(mask)  # a partly agreeing draft: the test can tell a wrong replay
    replay = greedy_acceptance([mask], k)
    assert final.stats.num_accepted_tokens == round(replay.acceptance_rate * final.stats.num_draft_tokens)
    assert final.stats.num_verify_steps == round((len(tokens)) / replay.mean_accepted_len)
