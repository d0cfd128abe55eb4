"""A draft's LM head over a subset of the vocabulary.

A small draft spends most of its per-token time in the vocabulary-sized LM head (SmolLM2: 49 152 x
576, four times its two decoder layers). A distilled draft may keep only the rows of the tokens it can
usefully propose (the most frequent in the target's own answers): its logits elsewhere are -inf, so
it never proposes those tokens, its sampling distribution q is zero there, and verification stays
exact — the target alone decides what is emitted.
"""
from __future__ import annotations

import torch
from torch import nn


class SubsetLMHead(nn.Module):
    def __init__(self, full_weight: torch.Tensor, vocab_ids: torch.Tensor) -> None:
        """`full_weight`: [vocab, hidden], the LM head it is cut from; `vocab_ids`: the rows kept."""
        super().__init__()
        ids = vocab_ids.to(device=full_weight.device, dtype=torch.long)
        if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= full_weight.shape[0] or len(ids.unique()) != len(ids):
            raise ValueError(f"vocab_ids must be distinct token ids in [0, {full_weight.shape[0]})")
        self.vocab_size = full_weight.shape[0]
        self.register_buffer("vocab_ids", ids)
        self.rows = nn.Linear(full_weight.shape[1], len(ids), bias=False, device=full_weight.device,
                              dtype=full_weight.dtype)
        self.rows.weight = nn.Parameter(full_weight.detach()[ids].clone(), requires_grad=False)

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., len(vocab_ids)]
        return self.rows(hidden)

    def to_vocab(self, sub: torch.Tensor) -> torch.Tensor:  # [..., len(vocab_ids)] -> [..., vocab_size]
        """Subset logits placed at their token ids, -inf elsewhere."""
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, sub)

    def greedy_ids(self, sub: torch.Tensor) -> torch.Tensor:  # [..., len(vocab_ids)] -> [...] token ids
        """The argmax token of subset logits, without placing them into the vocabulary (a tie goes to
        the row kept first, which is the lowest token id when vocab_ids ascend, as argmax's would)."""
        return self.vocab_ids[sub.argmax(-1)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., vocab_size], -inf outside the subset
        return self.to_vocab(self.subset_logits(hidden))
