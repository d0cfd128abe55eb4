"""Shared fixtures for the fast unit tests: makes tests/tiny_models.py importable and builds the
tiny byte-level BPE tokenizer once per session."""
from __future__ import annotations

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
