"""verify_greedy: accepted prefix, then exactly one recovered or bonus token."""
from __future__ import annotations

import pytest
import torch

from engine.verification import Verification, verify_greedy

VOCAB = 32


def make_logits(argmax_ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """[len(argmax_ids), vocab] random low logits with a high value at each row's chosen id."""
    gen = torch.Generator().manual_seed(sum(argmax_ids) + len(argmax_ids))
    logits = torch.randn(len(argmax_ids), vocab, generator=gen)
    for row, token_id in enumerate(argmax_ids):
        logits[row, token_id] = 100.0
    return logits


def drafts(ids: list[int]) -> list[int]:
    return list(ids)


def test_perfect_match():
    result = verify_greedy(drafts([3, 7, 1]), make_logits([3, 7, 1, 9]))
    assert result == Verification(num_accepted=3, committed_ids=[3, 7, 1, 9])  # 9 is the bonus token


def test_early_mismatch():
    result = verify_greedy(drafts([3, 7, 1]), make_logits([3, 5, 1, 9]))
    assert result.num_accepted == 1
    assert result.committed_ids == [3, 5]  # 5 is the recovered token; the matching 1 after it is ignored


def test_first_token_mismatch_all_rejected():
    result = verify_greedy(drafts([3, 7, 1]), make_logits([4, 7, 1, 9]))
    assert result.num_accepted == 0
    assert result.committed_ids == [4]


def test_all_rejected():
    result = verify_greedy(drafts([3, 7, 1]), make_logits([10, 11, 12, 13]))
    assert result == Verification(num_accepted=0, committed_ids=[10])


def test_last_token_mismatch():
    result = verify_greedy(drafts([3, 7, 1]), make_logits([3, 7, 2, 9]))
    assert result == Verification(num_accepted=2, committed_ids=[3, 7, 2])


def test_mismatch_after_match():
    result = verify_greedy(drafts([6, 6, 8, 2, 4]), make_logits([6, 6, 0, 2, 4, 5]))
    assert result.num_accepted == 2
    assert result.committed_ids == [6, 6, 0]


def test_k0_plain_decode():
    result = verify_greedy(drafts([]), make_logits([17]))
    assert result == Verification(num_accepted=0, committed_ids=[17])


def test_k1_accepted():
    result = verify_greedy(drafts([5]), make_logits([5, 22]))
    assert result == Verification(num_accepted=1, committed_ids=[5, 22])


def test_k1_rejected():
    result = verify_greedy(drafts([5]), make_logits([6, 22]))
    assert result == Verification(num_accepted=0, committed_ids=[6])


def test_committed_ids_are_python_ints():
    result = verify_greedy(drafts([3, 7]), make_logits([3, 7, 9]))
    assert isinstance(result.num_accepted, int)
    assert all(type(t) is int for t in result.committed_ids)


def test_committed_length_is_accepted_plus_one():
    torch.manual_seed(0)
    for k in range(0, 8):
        target = torch.randint(0, 4, (k + 1,)).tolist()
        draft = torch.randint(0, 4, (k,)).tolist()
        result = verify_greedy(drafts(draft), make_logits(target, vocab=4))
        expected = 0
        while expected < k and draft[expected] == target[expected]:
            expected += 1
        assert result.num_accepted == expected
        assert result.committed_ids == target[: expected + 1]
        assert result.committed_ids[:expected] == draft[:expected]


def test_wrong_number_of_logit_rows_asserts():
    with pytest.raises(AssertionError):
        verify_greedy(drafts([1, 2]), make_logits([1, 2]))
