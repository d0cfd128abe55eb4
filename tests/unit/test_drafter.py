"""DraftSequence.reconcile and the request checks shared by every drafter."""
from __future__ import annotations

import pytest

from engine.drafter import DraftSequence, check_propose
from engine.limits import check_new_sequence
from specdec.errors import InvalidRequestError


MAX_LEN = 64


def proposed(committed: list[int], proposal: list[int]) -> DraftSequence:
    return DraftSequence(token_ids=committed + proposal, num_proposed=len(proposal), max_len=MAX_LEN)


def test_partial_accept_keeps_accepted_drops_rest():
    seq = proposed([1, 2, 3], [10, 11, 12])
    num_kept = seq.reconcile(1, [20], 4)
    assert num_kept == 4  # 3 committed + 1 accepted
    assert seq.token_ids == [1, 2, 3, 10, 20]
    assert seq.num_proposed == 0


def test_all_accepted():
    seq = proposed([1, 2], [10, 11, 12])
    num_kept = seq.reconcile(3, [13], 4)  # the bonus token follows the whole proposal
    assert num_kept == 5
    assert seq.token_ids == [1, 2, 10, 11, 12, 13]
    assert seq.num_proposed == 0


def test_none_accepted():
    seq = proposed([1, 2], [10, 11])
    num_kept = seq.reconcile(0, [30], 4)
    assert num_kept == 2
    assert seq.token_ids == [1, 2, 30]


def test_no_open_proposal():
    seq = DraftSequence(token_ids=[1, 2, 3], max_len=MAX_LEN)
    assert seq.reconcile(0, [4, 5], 4) == 3
    assert seq.token_ids == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("num_accepted", [-1, 3])
def test_num_accepted_out_of_range_raises(num_accepted):
    seq = proposed([1], [10, 11])
    with pytest.raises(InvalidRequestError, match="num_accepted_draft_tokens"):
        seq.reconcile(num_accepted, [5], 4)
    assert seq.token_ids == [1, 10, 11]  # unchanged
    assert seq.num_proposed == 2


def test_a_proposal_past_the_sequence_limit_raises_and_changes_nothing():
    seq = DraftSequence(token_ids=[1, 2, 10, 11], num_proposed=2, max_len=7)
    assert seq.reconcile(2, [12], 2) == 4  # 5 committed + 2 proposed fit 7
    seq = DraftSequence(token_ids=[1, 2, 10, 11], num_proposed=2, max_len=7)
    with pytest.raises(InvalidRequestError, match="proposing 3 tokens after 5 committed would pass the sequence's limit of 7"):
        seq.reconcile(2, [12], 3)
    assert seq.token_ids == [1, 2, 10, 11]
    assert seq.num_proposed == 2


def test_empty_append_ids_raises():
    seq = proposed([1], [10, 11])
    with pytest.raises(InvalidRequestError, match="append_ids"):
        seq.reconcile(1, [], 4)
    assert seq.token_ids == [1, 10, 11]
    assert seq.num_proposed == 2


def test_check_new_sequence_accepts_fitting_request():
    check_new_sequence([1, 2, 3], 5, max_model_len=8)


@pytest.mark.parametrize("prompt_ids, max_new_tokens, match", [
    ([], 4, "prompt_ids is empty"),
    ([1], 0, "max_new_tokens"),
    ([1, 2, 3], 6, "exceeds"),
])
def test_check_new_sequence_rejects(prompt_ids, max_new_tokens, match):
    with pytest.raises(InvalidRequestError, match=match):
        check_new_sequence(prompt_ids, max_new_tokens, max_model_len=8)


@pytest.mark.parametrize("num_draft_tokens", [1, 4])
def test_check_propose_in_range(num_draft_tokens):
    check_propose(num_draft_tokens, max_draft_tokens=4)


@pytest.mark.parametrize("num_draft_tokens", [0, -1, 5])
def test_check_propose_out_of_range(num_draft_tokens):
    with pytest.raises(InvalidRequestError, match=r"\[1, 4\]"):
        check_propose(num_draft_tokens, max_draft_tokens=4)
