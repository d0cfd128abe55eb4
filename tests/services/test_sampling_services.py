"""Sampling through the real trio: seeded requests are reproducible whatever batch they land in,
and the whole speculative sampling path reduces to greedy decoding when only one token can win."""
from __future__ import annotations

import pytest

from harness import generate, seed_ending_at_eos

from specdec.v1 import gateway_pb2

PROMPTS = ["The quick brown fox", "Speculative decoding is", "Once upon a time", "1 2 3 4 5 6",
           "Hello, world", "A B C D", "tokens tokens tokens", "the the the"]


@pytest.mark.parametrize("drafter", ["perturbed", "unrelated", "ngram"])
def test_top_k_one_sampling_equals_greedy_decoding_with_any_draft(gateway_stub, drafter):
    for prompt in PROMPTS[:4]:
        greedy = generate(gateway_stub("none"), prompt=prompt, max_new_tokens=24)[0]
        sampled, _, final = generate(gateway_stub(drafter), prompt=prompt, max_new_tokens=24, temperature=0.9,
                                     top_k=1, seed=5, num_draft_tokens=3)
        assert sampled == greedy
        assert final.stats.num_draft_tokens > 0 or drafter == "ngram"


@pytest.mark.parametrize("drafter", ["perturbed", "ngram", "none"])
def test_seeded_request_gives_the_same_output_alone_and_in_a_crowd(gateway_stub, pool, drafter):
    request = dict(prompt="Once upon a time", max_new_tokens=32, temperature=0.8, top_p=0.95, seed=1234)
    alone = generate(gateway_stub(drafter), **request)[0]
    assert generate(gateway_stub(drafter), **request)[0] == alone
    crowd = [pool.submit(generate, gateway_stub(drafter), prompt=p, max_new_tokens=32, temperature=1.0, seed=i)
             for i, p in enumerate(PROMPTS)]
    together = pool.submit(generate, gateway_stub(drafter), **request)
    assert together.result(timeout=120)[0] == alone
    for future in crowd:
        future.result(timeout=120)


def test_other_seeds_sample_other_outputs(gateway_stub):
    outputs = {tuple(generate(gateway_stub("perturbed"), prompt="Hello, world", max_new_tokens=12, temperature=1.0,
                              seed=seed)[0]) for seed in range(8)}
    assert len(outputs) >= 4


def test_sampled_speculation_reports_acceptance(gateway_stub):
    # the identical draft draws from its top 8 candidates of the very same distribution, so a draft
    # token is accepted with probability = the mass of those 8: high for a peaked distribution (a low
    # temperature here; the tiny random model's own distribution is nearly flat over 400 tokens)
    _, _, peaked = generate(gateway_stub("identical"), prompt="A B C D", max_new_tokens=32, temperature=0.1, seed=3,
                            num_draft_tokens=4)
    _, _, flat = generate(gateway_stub("identical"), prompt="A B C D", max_new_tokens=32, temperature=1.0, seed=3,
                          num_draft_tokens=4)
    assert peaked.stats.acceptance_rate > 0.5 > flat.stats.acceptance_rate
    assert sum(peaked.stats.num_steps_by_k) == peaked.stats.num_verify_steps


def test_ignore_eos_generates_past_the_end_of_sequence_token_to_max_new_tokens(gateway_stub, tokenizer):
    # near-uniform draws (temperature 100) over the tiny model's 400 tokens
    request = dict(prompt="Once upon a time", max_new_tokens=48, temperature=100.0, num_draft_tokens=2)
    seed, ended = seed_ending_at_eos(gateway_stub("perturbed"), **request)
    assert len(ended) < request["max_new_tokens"]
    past, _, final = generate(gateway_stub("perturbed"), seed=seed, ignore_eos=True, **request)
    assert final.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert len(past) == final.stats.num_completion_tokens == request["max_new_tokens"]
    assert past[:len(ended) + 1] == ended + [tokenizer.eos_token_id]  # the same draws, on through the end token


def test_a_vanishing_temperature_decodes_greedily_with_a_draft(gateway_stub):
    greedy = generate(gateway_stub("none"), prompt="Once upon a time", max_new_tokens=16)[0]
    tiny, _, final = generate(gateway_stub("perturbed"), prompt="Once upon a time", max_new_tokens=16,
                              temperature=1e-38, seed=1, num_draft_tokens=2)
    assert tiny == greedy and final.stats.num_draft_tokens > 0
