"""Shared fixtures for the fast unit tests.

Makes tests/tiny_models.py importable and builds, once per session, two tiny tokenizers:
`tokenizer`, the byte-level BPE of tiny_models (GPT-2/SmolLM2 style), and `sp_tokenizer`, a
SentencePiece-style BPE with byte fallback and a leading-space-stripping decoder (Llama-2/Mistral
style): there, decoding a window that starts at "▁word" drops the space, and characters outside
its small alphabet become runs of <0xNN> byte tokens.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent.parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture(scope="session")
def tokenizer():
    from tiny_models import build_tokenizer

    return build_tokenizer()


def build_sp_tokenizer():
    from tiny_models import CORPUS
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([  # the decoder of Llama-2's tokenizer.json
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    alphabet = [chr(c) for c in range(33, 127)] + ["▁"]  # ASCII only: everything else falls back to bytes
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    tok.train_from_iterator([s.replace(" ", "▁") for s in CORPUS] * 4, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def sp_tokenizer():
    return build_sp_tokenizer()


@pytest.fixture(params=["byte_level", "sentencepiece"])
def any_tokenizer(request):
    return request.getfixturevalue({"byte_level": "tokenizer", "sentencepiece": "sp_tokenizer"}[request.param])
