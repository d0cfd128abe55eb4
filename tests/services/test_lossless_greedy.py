"""Speculative greedy output == the target's own greedy output (HF generate), token for token."""
from __future__ import annotations

import pytest

from harness import generate

from specdec.v1 import common_pb2

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return",
    "Speculative decoding: a draft proposes, the target verifies, the output is the same. " * 2,
    "Große Straße 🙂",
    "x",
]
MAX_NEW_TOKENS = 24


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft", ["identical", "perturbed", "unrelated", "reduced_head", "int8", "w8a8", "ngram",
                                   "ahead"])
def test_concurrent_requests_match_target_greedy(draft, k, gateway_stub, tokenizer, hf_greedy, pool):
    stub = gateway_stub(draft)
    futures = [pool.submit(generate, stub, prompt=p, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=k)
               for p in PROMPTS]
    for prompt, future in zip(PROMPTS, futures):
        token_ids, text, final = future.result()
        expected = hf_greedy(tokenizer.encode(prompt), MAX_NEW_TOKENS)
        assert token_ids == expected, f"prompt {prompt!r}"
        assert final.stats.num_completion_tokens == len(expected)
        assert text == tokenizer.decode(expected, skip_special_tokens=True)


def test_identical_draft_accepts_everything(gateway_stub):
    _, _, final = generate(gateway_stub("identical"), prompt="The quick brown fox", max_new_tokens=20,
                           num_draft_tokens=3)
    stats = final.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.acceptance_rate == pytest.approx(1.0)


def test_perturbed_draft_is_partly_rejected(gateway_stub):
    """The rollback path runs: some but not all draft tokens survive."""
    totals = [0, 0]
    for prompt in PROMPTS:
        _, _, final = generate(gateway_stub("perturbed"), prompt=prompt, max_new_tokens=MAX_NEW_TOKENS,
                               num_draft_tokens=3)
        totals[0] += final.stats.num_accepted_tokens
        totals[1] += final.stats.num_draft_tokens
    assert 0 < totals[0] < totals[1]


def test_reduced_head_draft_is_accepted_exactly_where_its_rows_hold_the_targets_token(gateway_stub, tokenizer, hf_greedy):
    """The target itself with only the even LM-head rows: its token is the target's wherever that is even."""
    accepted = drafted = 0
    for prompt in PROMPTS:
        expected = hf_greedy(tokenizer.encode(prompt), MAX_NEW_TOKENS)
        tokens, _, final = generate(gateway_stub("reduced_head"), prompt=prompt, max_new_tokens=MAX_NEW_TOKENS,
                                    num_draft_tokens=1)
        assert tokens == expected
        assert final.stats.num_accepted_tokens <= sum(t % 2 == 0 for t in expected)
        accepted, drafted = accepted + final.stats.num_accepted_tokens, drafted + final.stats.num_draft_tokens
    assert 0 < accepted < drafted


@pytest.mark.parametrize("draft", ["int8", "w8a8"])
def test_an_int8_copy_of_the_target_as_draft_is_mostly_accepted_and_changes_nothing(draft, gateway_stub, tokenizer,
                                                                                      hf_greedy):
    accepted = drafted = 0
    for prompt in PROMPTS:
        tokens, _, final = generate(gateway_stub(draft), prompt=prompt, max_new_tokens=MAX_NEW_TOKENS,
                                    num_draft_tokens=3)
        assert tokens == hf_greedy(tokenizer.encode(prompt), MAX_NEW_TOKENS)
        accepted, drafted = accepted + final.stats.num_accepted_tokens, drafted + final.stats.num_draft_tokens
    assert accepted > 0.7 * drafted  # its proposals are the target's own, up to int8 rounding


def test_speculation_off_matches_target_greedy(gateway_stub, tokenizer, hf_greedy):
    token_ids, _, final = generate(gateway_stub("perturbed"), prompt="The quick brown fox",
                                   max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=0)
    assert token_ids == hf_greedy(tokenizer.encode("The quick brown fox"), MAX_NEW_TOKENS)
    assert final.stats.num_draft_tokens == 0


def test_gateway_without_draft_service_matches_target_greedy(gateway_stub, tokenizer, hf_greedy):
    token_ids, _, _ = generate(gateway_stub("none"), prompt="def add(a, b):", max_new_tokens=MAX_NEW_TOKENS)
    assert token_ids == hf_greedy(tokenizer.encode("def add(a, b):"), MAX_NEW_TOKENS)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_short_generations_stop_exactly_at_max_new_tokens(max_new_tokens, gateway_stub, tokenizer, hf_greedy):
    token_ids, _, _ = generate(gateway_stub("identical"), prompt="The quick brown fox",
                               max_new_tokens=max_new_tokens, num_draft_tokens=5)
    assert token_ids == hf_greedy(tokenizer.encode("The quick brown fox"), max_new_tokens)


def test_chat_request_uses_the_chat_template(gateway_stub, tokenizer, hf_greedy):
    from specdec.v1 import gateway_pb2

    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hello there")])
    token_ids, _, final = generate(gateway_stub("perturbed"), chat=chat, max_new_tokens=12, num_draft_tokens=2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                         tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    assert final.stats.num_prompt_tokens == len(prompt_ids)
    assert token_ids == hf_greedy(prompt_ids, 12)


@pytest.mark.parametrize("k", [0, 3])
def test_triton_attention_target_matches_target_greedy(k, triton_gateway_stub, tokenizer, hf_greedy, pool):
    futures = [pool.submit(generate, triton_gateway_stub, prompt=p, max_new_tokens=16, num_draft_tokens=k)
               for p in PROMPTS[:3]]
    for prompt, future in zip(PROMPTS[:3], futures):
        token_ids, _, _ = future.result()
        assert token_ids == hf_greedy(tokenizer.encode(prompt), 16), prompt


def test_a_draft_drafting_ahead_answers_some_proposals_from_its_chains(gateway_stub, draft_stub):
    """The "ahead" draft (the perturbed model, --draft-ahead) over gRPC: outputs above equal the
    target's; here its counters show chains both used and thrown away."""
    before = draft_stub("ahead").GetEngineStats(common_pb2.EngineStatsRequest())
    for prompt in PROMPTS:
        generate(gateway_stub("ahead"), prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=1)
    after = draft_stub("ahead").GetEngineStats(common_pb2.EngineStatsRequest())
    assert after.num_ahead_hits > before.num_ahead_hits
    assert after.num_ahead_misses > before.num_ahead_misses
