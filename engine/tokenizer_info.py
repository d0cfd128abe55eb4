"""What identifies a tokenizer (a fingerprint) and how it travels (as its files)."""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over the vocabulary (token -> id): what a draft and a target must share, since they
    exchange token ids. Special-token roles (EOS, pad) are left out: they are the target's to decide,
    and transformers versions read them differently from the same file (SmolLM2's GGUF: EOS id 1 in
    5.17, id 2 in 5.24, with the same vocabulary)."""
    payload = {"vocab": sorted(tokenizer.get_vocab().items())}
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def tokenizer_files(tokenizer: PreTrainedTokenizerBase) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def tokenizer_from_files(files: dict[str, bytes]) -> PreTrainedTokenizerBase:
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / Path(name).name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, generation_eos: int | list[int] | None) -> list[int]:
    ids = set([generation_eos] if isinstance(generation_eos, int) else generation_eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
