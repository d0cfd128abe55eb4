"""Greedy verification of draft tokens against the target's logits (a pure function).

Terms, used everywhere in specdec:
  accepted tokens  - the longest prefix of the draft that the target would have produced itself;
  recovered token  - the target's own token at the first position where the draft differs;
  bonus token      - the target's token after the last draft token, when every draft was accepted.
A verify commits the accepted tokens plus exactly one recovered-or-bonus token.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verification:
    num_accepted: int
    committed_ids: list[int]  # accepted draft tokens, then the recovered or bonus token


def verify_greedy(
    draft_ids: list[int],  # [k] proposed tokens
    target_ids: list[int],  # [k + 1] the target's argmax tokens; token i is its choice after draft i-1
) -> Verification:
    assert len(target_ids) == len(draft_ids) + 1, "need the target's k + 1 tokens for k drafts"
    num_accepted = next((i for i, (d, t) in enumerate(zip(draft_ids, target_ids)) if d != t), len(draft_ids))
    # the accepted drafts equal the target's own tokens; then one more of its own
    return Verification(num_accepted=num_accepted, committed_ids=target_ids[: num_accepted + 1])
