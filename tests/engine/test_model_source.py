"""Model specs: random weights at a config's shape, clear errors for paths that do not exist, and the GGUF
conversions' cache keyed by the file's bytes."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine import model_source
from engine.model_source import (DEFAULT_MODEL, converted_gguf_dir, default_cache_dir, gguf_content_key,
                                 load_pretrained, resolve_path)
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


def test_gguf_key_follows_the_bytes_not_the_path(tmp_path):
    cache = tmp_path / "cache"
    first, copy, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((first, b"GGUF one"), (copy, b"GGUF one"), (other, b"GGUF two")):
        path.parent.mkdir()
        path.write_bytes(data)
    key = gguf_content_key(first, cache)
    assert gguf_content_key(copy, cache) == key  # a reinstall elsewhere finds the conversion
    assert gguf_content_key(other, cache) != key
    os.utime(copy, ns=(1, 1))  # a new modification time: hashed again, the same bytes the same key
    assert gguf_content_key(copy, cache) == key
    assert len(list((cache / "gguf" / "keys").iterdir())) == 4  # each path, size and time hashed once
    copy.write_bytes(b"GGUF changed")
    assert gguf_content_key(copy, cache) not in (key, gguf_content_key(other, cache))


def test_gguf_key_in_a_read_only_cache_is_hashed_each_time(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF one")
    key = gguf_content_key(gguf, tmp_path / "writable")

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(model_source.tempfile, "mkstemp", read_only)  # as root, chmod would not stop us
    cache = tmp_path / "read-only"
    assert gguf_content_key(gguf, cache) == gguf_content_key(gguf, cache) == key
    assert not list((cache / "gguf" / "keys").iterdir())


@pytest.mark.slow
def test_default_model_reinstalled_elsewhere_reuses_its_conversion(tmp_path):
    # a fresh virtualenv or clone installs the same GGUF at another path: no second ~0.5 GB conversion
    original = resolve_path(DEFAULT_MODEL)
    converted = converted_gguf_dir(original, default_cache_dir())  # converts here if no test has yet
    before = converted.stat().st_mtime_ns
    reinstalled = tmp_path / "site-packages" / original.name
    reinstalled.parent.mkdir()
    shutil.copy(original, reinstalled)  # a new path and modification time
    keys = default_cache_dir() / "gguf" / "keys"
    known = set(keys.iterdir())
    try:
        assert converted_gguf_dir(reinstalled, default_cache_dir()) == converted
        assert converted.stat().st_mtime_ns == before
    finally:
        for key in set(keys.iterdir()) - known:  # the temporary path's key: the cache keeps no trace of it
            key.unlink()
