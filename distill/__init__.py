"""`python -m distill`: train a small draft model for a target by distilling the target's own greedy
output (sequence-level distillation). See docs/distill.md."""
