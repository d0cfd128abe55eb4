"""engine/triton_prefetch.py: how much of its strip of W a product's program asks L2 for before its PDL
wait. (That the prefetches come before the wait in the compiled kernels: tests/engine/sm90_compile.py;
that they leave every logit's bits: tests/engine/test_cuda_graphs_gpu.py.)"""
from __future__ import annotations

import pytest

from engine import triton_prefetch
from engine.triton_prefetch import prefetch_lines


@pytest.fixture
def prefetch_kb(monkeypatch):
    def set_kb(kb: int) -> None:
        monkeypatch.setattr(triton_prefetch, "PREFETCH_KB", kb)
    return set_kb


def test_a_program_asks_for_its_share_of_the_bytes_in_whole_lines_a_row(prefetch_kb):
    prefetch_kb(16)
    assert prefetch_lines(block_n=32, k_range=2048, element_size=1, use_pdl=True) == 4  # 32 rows x 4 x 128 B = 16 KB
    assert prefetch_lines(block_n=16, k_range=4096, element_size=2, use_pdl=True) == 8
    prefetch_kb(48)  # 12 lines a row of 32: the power of two below
    assert prefetch_lines(block_n=32, k_range=8192, element_size=1, use_pdl=True) == 8


def test_a_short_strip_is_asked_for_whole_and_no_further(prefetch_kb):
    prefetch_kb(1024)
    assert prefetch_lines(block_n=32, k_range=2048, element_size=1, use_pdl=True) == 16  # 2 KB a row
    assert prefetch_lines(block_n=32, k_range=2000, element_size=2, use_pdl=True) == 32  # 4000 B: 32 lines, masked


def test_nothing_is_prefetched_when_off_without_pdl_or_with_less_than_a_line_a_row(prefetch_kb):
    prefetch_kb(0)
    assert prefetch_lines(block_n=32, k_range=2048, element_size=1, use_pdl=True) == 0
    prefetch_kb(64)
    assert prefetch_lines(block_n=32, k_range=2048, element_size=1, use_pdl=False) == 0
    prefetch_kb(1)  # 1 KB over 128 rows: under a line each
    assert prefetch_lines(block_n=128, k_range=2048, element_size=2, use_pdl=True) == 0


@pytest.mark.parametrize("raw", ["-1", "16k", "", "1.5"])
def test_a_malformed_setting_is_refused_saying_what_it_takes(monkeypatch, raw):
    monkeypatch.setenv("SPECDEC_PREFETCH_KB", raw)
    with pytest.raises(ValueError, match="whole number of KB"):
        triton_prefetch.from_env()


def test_the_setting_reads_from_the_environment_with_16_kb_as_default(monkeypatch):
    monkeypatch.delenv("SPECDEC_PREFETCH_KB", raising=False)
    assert triton_prefetch.from_env() == 16
    monkeypatch.setenv("SPECDEC_PREFETCH_KB", "0")
    assert triton_prefetch.from_env() == 0
