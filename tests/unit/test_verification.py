"""verify_greedy: accepted prefix, then exactly one recovered or bonus token."""
from __future__ import annotations

import pytest
import torch

from engine.verification import Verification, verify_greedy


def drafts(ids: list[int]) -> list[int]:
    return list(ids)


def target(ids: list[int]) -> list[int]:
    """The target's argmax token at each of the k + 1 positions (its read back, as the engine passes it)."""
    return list(ids)


def test_perfect_match():
    result = verify_greedy(drafts([3, 7, 1]), target([3, 7, 1, 9]))
    assert result == Verification(num_accepted=3, committed_ids=[3, 7, 1, 9])  # 9 is the bonus token


def test_early_mismatch():
    result = verify_greedy(drafts([3, 7, 1]), target([3, 5, 1, 9]))
    assert result.num_accepted == 1
    assert result.committed_ids == [3, 5]  # 5 is the recovered token; the matching 1 after it is ignored


def test_first_token_mismatch_all_rejected():
    result = verify_greedy(drafts([3, 7, 1]), target([4, 7, 1, 9]))
    assert result.num_accepted == 0
    assert result.committed_ids == [4]


def test_all_rejected():
    result = verify_greedy(drafts([3, 7, 1]), target([10, 11, 12, 13]))
    assert result == Verification(num_accepted=0, committed_ids=[10])


def test_last_token_mismatch():
    result = verify_greedy(drafts([3, 7, 1]), target([3, 7, 2, 9]))
    assert result == Verification(num_accepted=2, committed_ids=[3, 7, 2])


def test_mismatch_after_match():
    result = verify_greedy(drafts([6, 6, 8, 2, 4]), target([6, 6, 0, 2, 4, 5]))
    assert result.num_accepted == 2
    assert result.committed_ids == [6, 6, 0]


def test_k0_plain_decode():
    result = verify_greedy(drafts([]), target([17]))
    assert result == Verification(num_accepted=0, committed_ids=[17])


def test_k1_accepted():
    result = verify_greedy(drafts([5]), target([5, 22]))
    assert result == Verification(num_accepted=1, committed_ids=[5, 22])


def test_k1_rejected():
    result = verify_greedy(drafts([5]), target([6, 22]))
    assert result == Verification(num_accepted=0, committed_ids=[6])


def test_committed_length_is_accepted_plus_one():
    torch.manual_seed(0)
    for k in range(0, 8):
        target_ids = torch.randint(0, 4, (k + 1,)).tolist()
        draft = torch.randint(0, 4, (k,)).tolist()
        result = verify_greedy(drafts(draft), target_ids)
        expected = 0
        while expected < k and draft[expected] == target_ids[expected]:
            expected += 1
        assert result.num_accepted == expected
        assert result.committed_ids == target_ids[: expected + 1]
        assert result.committed_ids[:expected] == draft[:expected]


def test_wrong_number_of_target_tokens_asserts():
    with pytest.raises(AssertionError):
        verify_greedy(drafts([1, 2]), target([1, 2]))
