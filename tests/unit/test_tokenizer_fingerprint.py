"""A tokenizer's fingerprint is its vocabulary: special-token roles (read differently by transformers
versions from the same file) do not change it; another vocabulary does."""
from __future__ import annotations

from engine.tokenizer_info import tokenizer_fingerprint
from tiny_models import build_tokenizer


def test_other_special_token_roles_over_the_same_vocabulary_keep_the_fingerprint():
    a, b = build_tokenizer(), build_tokenizer()
    b.eos_token, b.pad_token = "<|im_start|>", None  # as transformers 5.17 reads SmolLM2's GGUF
    assert a.eos_token_id != b.eos_token_id
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)


def test_another_vocabulary_changes_the_fingerprint():
    assert tokenizer_fingerprint(build_tokenizer()) != tokenizer_fingerprint(build_tokenizer(vocab_size=330))
