"""Prompt-lookup drafting: ngram_lookup and the async NgramDrafter."""
from __future__ import annotations

import asyncio

import pytest

from engine.ngram_drafter import NgramDrafter, ngram_lookup
from specdec.errors import InvalidRequestError


def test_repeated_phrase_proposes_continuation():
    # "A B C D E ... A B" -> propose "C D E"
    history = [1, 2, 3, 4, 5, 9, 1, 2]
    assert ngram_lookup(history, 3) == [3, 4, 5]


def test_longest_ngram_preferred():
    # suffix [7, 8, 9]: the 1-gram [9] last occurred before 50, the 3-gram before 40
    history = [7, 8, 9, 40, 41, 0, 9, 50, 51, 7, 8, 9]
    assert ngram_lookup(history, 2, max_ngram=3) == [40, 41]
    assert ngram_lookup(history, 2, max_ngram=1) == [50, 51]


def test_falls_back_to_shorter_ngram():
    history = [5, 6, 1, 2, 3, 9, 9, 2, 3]  # [9, 2, 3] never occurred earlier, [2, 3] did
    assert ngram_lookup(history, 2) == [9, 9]


def test_latest_occurrence_preferred():
    history = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert ngram_lookup(history, 1) == [30]


def test_no_match_proposes_nothing():
    assert ngram_lookup([1, 2, 3, 4, 5], 4) == []


@pytest.mark.parametrize("history", [[], [7]])
def test_too_short_history_proposes_nothing(history):
    assert ngram_lookup(history, 4) == []


def test_proposal_truncated_at_end_of_history():
    history = [1, 2, 3, 1, 2]
    assert ngram_lookup(history, 10) == [3, 1, 2]


def test_overlapping_match():
    assert ngram_lookup([4, 4, 4, 4], 5) == [4]  # the suffix itself is never a match


def test_min_ngram_limits_fallback():
    history = [5, 1, 2, 9, 3, 1, 8, 2]  # only the 1-gram [2] recurs
    assert ngram_lookup(history, 1, min_ngram=1) == [9]
    assert ngram_lookup(history, 1, min_ngram=2) == []


def test_zero_draft_tokens_proposes_nothing():
    assert ngram_lookup([1, 2, 1, 2], 0) == []


def run(coro):
    return asyncio.run(coro)


def test_drafter_start_then_propose():
    drafter = NgramDrafter(max_draft_tokens=4)
    seq = run(drafter.start([1, 2, 3, 4, 5, 1, 2], max_new_tokens=8))
    draft_ids, timing = run(drafter.propose(seq, num_accepted=0, append_ids=[3], num_draft_tokens=2))
    assert draft_ids == [4, 5]  # after appending 3, [1, 2, 3] recurs
    assert timing.forward_ns == 0
    assert seq.token_ids == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]
    assert seq.num_proposed == 2


def test_drafter_propose_reconciles_before_lookup():
    drafter = NgramDrafter(max_draft_tokens=4)
    seq = run(drafter.start([1, 2, 3, 4, 5, 1, 2], max_new_tokens=8))
    run(drafter.propose(seq, 0, [3], 2))  # proposes [4, 5]
    # the target accepted only 4, then committed 7 instead of 5
    draft_ids, _ = run(drafter.propose(seq, num_accepted=1, append_ids=[7], num_draft_tokens=3))
    assert seq.token_ids[:9] == [1, 2, 3, 4, 5, 1, 2, 3, 4]
    assert seq.token_ids[9] == 7
    assert draft_ids == []  # [3, 4, 7] / [4, 7] / [7] never occurred before
    assert seq.num_proposed == 0


def test_drafter_all_accepted_then_bonus():
    drafter = NgramDrafter(max_draft_tokens=4)
    seq = run(drafter.start([1, 2, 3, 4, 5, 1, 2], max_new_tokens=8))
    run(drafter.propose(seq, 0, [3], 2))  # proposes [4, 5]
    draft_ids, _ = run(drafter.propose(seq, num_accepted=2, append_ids=[1], num_draft_tokens=2))
    assert seq.token_ids[:11] == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1]
    assert draft_ids == [2, 3]  # [4, 5, 1] recurs
    assert seq.token_ids[11:] == [2, 3]


@pytest.mark.parametrize("num_accepted", [-1, 3])
def test_drafter_invalid_num_accepted_raises(num_accepted):
    drafter = NgramDrafter()
    seq = run(drafter.start([1, 2, 1, 2], max_new_tokens=4))
    run(drafter.propose(seq, 0, [1], 2))  # proposes [2, 1]
    assert seq.num_proposed == 2
    with pytest.raises(InvalidRequestError):
        run(drafter.propose(seq, num_accepted, [5], 2))


def test_drafter_first_propose_with_nonzero_accepted_raises():
    drafter = NgramDrafter()
    seq = run(drafter.start([1, 2, 1, 2], max_new_tokens=4))
    with pytest.raises(InvalidRequestError):
        run(drafter.propose(seq, 1, [5], 2))


def test_drafter_empty_append_ids_raises():
    drafter = NgramDrafter()
    seq = run(drafter.start([1, 2, 1, 2], max_new_tokens=4))
    with pytest.raises(InvalidRequestError, match="append_ids"):
        run(drafter.propose(seq, 0, [], 2))


@pytest.mark.parametrize("num_draft_tokens", [0, 5])
def test_drafter_num_draft_tokens_out_of_range_raises(num_draft_tokens):
    drafter = NgramDrafter(max_draft_tokens=4)
    seq = run(drafter.start([1, 2, 1, 2], max_new_tokens=4))
    with pytest.raises(InvalidRequestError):
        run(drafter.propose(seq, 0, [1], num_draft_tokens))


def test_drafter_start_checks_request():
    drafter = NgramDrafter(max_model_len=8)
    with pytest.raises(InvalidRequestError):
        run(drafter.start([], max_new_tokens=4))
    with pytest.raises(InvalidRequestError):
        run(drafter.start([1, 2, 3, 4, 5], max_new_tokens=4))


def test_drafter_stats_track_sequences():
    drafter = NgramDrafter()
    a = run(drafter.start([1], 1))
    run(drafter.start([2], 1))
    drafter.release(a)
    assert drafter.stats() == {"num_active_sequences": 1, "num_sequences_started": 2}
