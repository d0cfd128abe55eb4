"""Greedy verification of draft tokens against the target's logits (a pure function).

Terms, used everywhere in specdec:
  accepted tokens  - the longest prefix of the draft that the target would have produced itself;
  recovered token  - the target's own token at the first position where the draft differs;
  bonus token      - the target's token after the last draft token, when every draft was accepted.
A verify commits the accepted tokens plus exactly one recovered-or-bonus token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verification:
    num_accepted: int
    committed_ids: list[int]  # accepted draft tokens, then the recovered or bonus token


def verify_greedy(
    draft_ids: torch.Tensor,  # [k] proposed tokens
    target_logits: torch.Tensor,  # [k + 1, vocab] target logits; row i predicts the token after draft i-1
) -> Verification:
    assert target_logits.shape[0] == draft_ids.shape[0] + 1, "need k + 1 logit rows for k drafts"
    target_ids = target_logits.argmax(dim=-1)  # [k + 1]
    mismatches = (draft_ids != target_ids[:-1]).nonzero()
    num_accepted = int(mismatches[0]) if mismatches.numel() else draft_ids.shape[0]
    committed = target_ids[: num_accepted + 1].tolist()  # equals the accepted drafts, then one more
    return Verification(num_accepted=num_accepted, committed_ids=committed)
