"""Speculative sampling keeps the target's distribution exactly; transforms and seeded draws behave."""
from __future__ import annotations

import math

import pytest
import torch

from engine import sampling
from engine.sampling import SamplingParams, probabilities, sample_draft, sample_token, verify_sampled
from specdec.errors import InvalidRequestError

VOCAB = 6
T = SamplingParams(temperature=1.0, seed=7)


def _logits(seed: int, rows: int = 1, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


# --- named verifier scenarios --------------------------------------------------------------------

def test_perfect_match_draft_distribution_equal_to_the_target_accepts_everything():
    logits = _logits(0, rows=4)
    p = probabilities(logits, T)
    draft_ids = [int(p[i].argmin()) for i in range(3)]  # even unlikely tokens: p == q accepts always
    q = [(list(range(VOCAB)), p[i].tolist()) for i in range(3)]
    for position in range(50):
        result = verify_sampled(draft_ids, q, logits, T, position)
        assert result.num_accepted == 3 and result.committed_ids[:3] == draft_ids


def test_token_the_target_never_samples_is_rejected_and_never_recovered():
    logits = _logits(1, rows=3)
    logits[0, 2] = -math.inf  # p(2) = 0 at the first position
    for position in range(50):
        result = verify_sampled([2, 1], [([2], [1.0]), ([1], [1.0])], logits, T, position)
        assert result.num_accepted == 0 and len(result.committed_ids) == 1 and result.committed_ids[0] != 2


def test_early_mismatch_commits_the_accepted_prefix_then_one_recovered_token():
    logits = _logits(2, rows=4)
    logits[1, 4] = -math.inf  # the second draft token can never be accepted
    results = [verify_sampled([0, 4, 1], [([0], [1.0]), ([4], [1.0]), ([1], [1.0])], logits, T, pos)
               for pos in range(200)]
    assert {r.num_accepted for r in results} == {0, 1}
    for r in results:
        assert len(r.committed_ids) == r.num_accepted + 1 and 4 not in r.committed_ids[1:2]


def test_k_equal_one_bonus_token_follows_an_accepted_draft():
    logits = _logits(3, rows=2)
    p = probabilities(logits, T)
    result = verify_sampled([1], [(list(range(VOCAB)), p[0].tolist())], logits, T, 5)
    assert result.num_accepted == 1 and len(result.committed_ids) == 2


def test_same_seed_same_draws_and_other_seeds_differ():
    logits = _logits(4, rows=3)
    q = [([0, 3], [0.5, 0.5]), ([1, 2], [0.5, 0.5])]
    same = {tuple(verify_sampled([0, 1], q, logits, T, 9).committed_ids) for _ in range(5)}
    assert len(same) == 1
    many = {tuple(verify_sampled([0, 1], q, logits, SamplingParams(1.0, seed=s), 9).committed_ids) for s in range(40)}
    assert len(many) > 3


# --- the statistical test: speculation samples the target's distribution ---------------------------

def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny random 'model': logits for token 1, and for token 2 given token 1."""
    return _logits(seed, rows=1, scale=1.5)[0], _logits(seed + 1, rows=VOCAB, scale=1.5)


def _speculative_pairs(num_samples: int, verify=verify_sampled) -> torch.Tensor:
    """Counts of (token 1, token 2) sampled with a mismatched draft proposing both tokens (k = 2)."""
    target1, target2 = _tables(10)
    draft1, draft2 = _tables(20)  # an unrelated draft
    counts = torch.zeros(VOCAB, VOCAB)
    for seed in range(num_samples):
        params = SamplingParams(temperature=1.0, seed=seed)
        s = torch.tensor([seed])
        x1, ids1, q1 = sample_draft(draft1[None], *_row(params), s, torch.tensor([0]), VOCAB)
        x2, ids2, q2 = sample_draft(draft2[int(x1)][None], *_row(params), s, torch.tensor([1]), VOCAB)
        logits = torch.stack([target1, target2[int(x1)], torch.zeros(VOCAB)])
        q = [(ids1[0].tolist(), q1[0].tolist()), (ids2[0].tolist(), q2[0].tolist())]
        committed = verify([int(x1), int(x2)], q, logits, params, 0).committed_ids
        if len(committed) == 1:  # rejected at the first token: sample the second from the target itself
            committed.append(sample_token(target2[committed[0]], params, 1))
        counts[committed[0], committed[1]] += 1
    return counts


def _row(params: SamplingParams) -> tuple[torch.Tensor, ...]:
    return (torch.tensor([params.temperature]), torch.tensor([params.top_p]), torch.tensor([params.top_k]),
            torch.tensor([params.min_p]))


def _target_pairs() -> torch.Tensor:
    target1, target2 = _tables(10)
    p1 = target1.softmax(-1)
    return p1[:, None] * target2.softmax(-1)


NUM_SAMPLES = 6000
# Total variation between the empirical and the true 36-cell distribution: 0.018 measured with the
# right rule at this sample size; 0.06 keeps the test stable. The wrong rules below land at 0.19 and 0.82.
TV_BOUND = 0.06


def test_speculative_sampling_matches_the_targets_joint_distribution():
    empirical = _speculative_pairs(NUM_SAMPLES) / NUM_SAMPLES
    assert 0.5 * (empirical - _target_pairs()).abs().sum() < TV_BOUND


def _accept_every_draft(draft_ids, draft_probs, target_logits, params, position):
    """A deliberately wrong rule: trusts the draft (as if p == q)."""
    return sampling.Verification(len(draft_ids), [*draft_ids, sample_token(target_logits[-1], params, position + 2)])


def _resample_from_p_on_rejection(draft_ids, draft_probs, target_logits, params, position):
    """A deliberately wrong rule: right acceptance test, but the recovered token comes from p, not p - q."""
    result = verify_sampled(draft_ids, draft_probs, target_logits, params, position)
    if result.num_accepted < len(draft_ids):
        fixed = sample_token(target_logits[result.num_accepted], params, position + result.num_accepted)
        return sampling.Verification(result.num_accepted, result.committed_ids[:-1] + [fixed])
    return result


@pytest.mark.parametrize("wrong_rule", [_accept_every_draft, _resample_from_p_on_rejection])
def test_the_statistical_test_catches_a_wrong_acceptance_rule(wrong_rule):
    empirical = _speculative_pairs(NUM_SAMPLES, wrong_rule) / NUM_SAMPLES
    assert 0.5 * (empirical - _target_pairs()).abs().sum() > TV_BOUND


# --- transforms and checks ------------------------------------------------------------------------

def test_transforms_truncate_as_documented():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.06, 0.04, 0.0 + 1e-9]]))
    keep = lambda **kw: (probabilities(logits, SamplingParams(1.0, **kw))[0] > 0).tolist()  # noqa: E731
    assert keep(top_k=2) == [True, True, False, False, False, False]
    assert keep(top_p=0.7) == [True, True, False, False, False, False]  # 0.5 + 0.25 reaches 0.7
    assert keep(top_p=0.01) == [True, False, False, False, False, False]  # the top token always stays
    assert keep(min_p=0.2) == [True, True, True, False, False, False]  # >= 0.2 * 0.5
    torch.testing.assert_close(probabilities(logits, SamplingParams(1.0, top_k=2))[0, :2], torch.tensor([2 / 3, 1 / 3]))


def test_draft_sampler_greedy_rows_take_the_argmax_with_a_one_hot_q():
    logits = _logits(5, rows=2)
    tokens, ids, q = sample_draft(logits, torch.tensor([0.0, 1.0]), torch.ones(2), torch.zeros(2, dtype=torch.long),
                                  torch.zeros(2), torch.tensor([1, 2]), torch.tensor([3, 3]), 4)
    assert int(tokens[0]) == int(logits[0].argmax()) and q[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(q[1].sum(), torch.tensor(1.0))
    assert int(tokens[1]) in ids[1].tolist()


@pytest.mark.parametrize("fields, message", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"), (dict(temperature=1.0, top_p=math.inf), "top_p"),
    (dict(temperature=1.0, top_k=-1), "top_k"), (dict(temperature=1.0, min_p=1.0), "min_p"),
])
def test_bad_sampling_parameters_name_the_field(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**fields).check()


@pytest.mark.parametrize("draft_probs, message", [
    ([([1], [1.0])], "2 draft tokens but 1"),
    ([([1], [1.0]), ([9], [1.0])], "outside the vocabulary"),
    ([([1], [1.0]), ([2, 3], [0.5, 0.6])], "sum to 1"),
    ([([1], [1.0]), ([3], [1.0])], "no probability in its own"),
    ([([1], [1.0]), ([2, 2], [0.5, 0.5])], "names a token twice"),
])
def test_bad_draft_distributions_are_refused(draft_probs, message):
    with pytest.raises(InvalidRequestError, match=message):
        sampling.check_draft_probs([1, 2], draft_probs, VOCAB)


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 9e-6])
def test_a_temperature_too_small_to_divide_by_decodes_greedily(temperature):
    """logits / 1e-38 overflow float32 (NaN probabilities); below MIN_TEMPERATURE decoding is greedy, as vLLM's."""
    params = SamplingParams(temperature=temperature, seed=1).check()
    assert params.is_greedy and params.temperature == 0.0
    assert not SamplingParams(temperature=sampling.MIN_TEMPERATURE).is_greedy
