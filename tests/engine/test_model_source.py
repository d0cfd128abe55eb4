"""Model specs: random weights at a config's shape, and clear errors for paths that do not exist."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model_source import load_pretrained
from specdec.errors import UnsupportedModelError


def _load(spec: str):
    return load_pretrained(spec, torch.float32, torch.device("cpu"), Path("/nonexistent-cache"))


def test_random_spec_builds_the_configs_shape_with_seeded_random_weights(model_dirs):
    saved = _load(str(model_dirs["unrelated"])).hf_model
    first, second = _load(f"random:{model_dirs['unrelated']}"), _load(f"random:{model_dirs['unrelated']}")
    assert first.model_id == f"random:{model_dirs['unrelated']}"
    assert first.hf_model.config.num_hidden_layers == saved.config.num_hidden_layers
    assert first.tokenizer.get_vocab() == _load(str(model_dirs["unrelated"])).tokenizer.get_vocab()
    for (name, a), b, c in zip(first.hf_model.named_parameters(), second.hf_model.parameters(), saved.parameters()):
        assert a.shape == c.shape and torch.equal(a, b), name  # same seed, same weights
    assert not torch.equal(first.hf_model.model.embed_tokens.weight, saved.model.embed_tokens.weight)  # saved: seed 2


@pytest.mark.parametrize("spec", ["/no/such/dir", "./missing", "missing.gguf", "random:/no/such/dir"])
def test_missing_local_model_is_a_clear_error(spec):
    with pytest.raises(UnsupportedModelError, match="cannot load model"):
        _load(spec)
