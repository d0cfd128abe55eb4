"""L2 prefetch of a product's weights before its PDL wait, for the Triton products of graph steps.

With programmatic dependent launch (engine/pdl.py) a kernel's programs are resident while its
predecessor still runs, each waiting at its first line (`gdc_wait`) before it touches any activation.
A product's weights are not written by any kernel of a step, so a program may ask for them before that
wait: here it asks L2 for the first lines of its strip of W (`prefetch.global.L2`, one instruction a
128-byte line), and its software pipeline then finds them there instead of in HBM while the predecessor
drains. A hint only: no value is read into a register, so every result keeps its bits.

`PREFETCH_KB` (SPECDEC_PREFETCH_KB): the bytes of W a program asks for, capped at its strip's own; 0 for
none. Only where PDL is on (the draft service's default); on CPU (the interpreter knows no PTX) never.
16 KB (a W8A8 program's first pipeline stages): on the H200 the trio's k = 4 proposal (W8A8 1B draft,
32k head) took 2.843 ms against 2.916 without, lower in each of three rotated rounds; 64 KB took 2.947
(unexplained; perhaps more than the pipeline's first loads crowds the predecessor's stream); the target with PDL and 64 KB
verified in 4.95 ms against 4.74 without either, so the target keeps PDL, and with it this, off
(`python bench/gpu_ab.py --draft-quantize w8a8 --draft-head-rows 32768 --variant base:SPECDEC_PREFETCH_KB=0
--variant pf16:SPECDEC_PREFETCH_KB=16 ...`, bench/results/gpu_ab_prefetch.json). Earlier trials of early work
lost at the graph replay (docs/benchmarks.md: a bf16 draft's linears prefetching 4 KB of each weight row,
the whole of most strips, 0.995 -> 1.198 ms a decode replay; a tile of W loaded before the wait; attention's
first keys): loads issued beside the predecessor slowed it more than they shortened the dependent. A small
share (here a quarter of a W8A8 qkv strip) is what gained; `python bench/gpu_draft_forward.py --variants
w8a8_32k_pdl_split4_qkvrope_pf0 w8a8_32k_pdl_split4_qkvrope_pf16 ...` is to confirm it at the replay.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

LINE_BYTES = 128  # what one prefetch asks L2 for


def from_env(default: int = 16) -> int:
    """SPECDEC_PREFETCH_KB if set (a whole number of KB, 0 for none), else `default`."""
    raw = os.environ.get("SPECDEC_PREFETCH_KB", str(default))
    if not raw.strip().isdigit():
        raise ValueError(f"SPECDEC_PREFETCH_KB must be a whole number of KB (0 for no prefetch), got {raw!r}")
    return int(raw)


PREFETCH_KB = from_env()


@triton.jit
def prefetch_strip(w_ptr, w_rows, row_ok, k_first, k_end, stride_wn, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """Asks L2 for the first LINES lines (LINE_ELEMS elements each) of W's rows `w_rows` from column
    `k_first` on, none past `k_end` or of a row not `row_ok` (those ask for W's first line instead)."""
    k = k_first + tl.arange(0, LINES) * LINE_ELEMS
    ok = row_ok[:, None] & (k < k_end)[None, :]
    lines = w_ptr + tl.where(ok, w_rows[:, None].to(tl.int64) * stride_wn + k[None, :], 0)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines],
                              dtype=tl.int32, is_pure=False, pack=1)


def prefetch_lines(block_n: int, k_range: int, element_size: int, use_pdl: bool) -> int:
    """Lines of each W row a program of `block_n` rows and a K range of `k_range` elements asks for:
    PREFETCH_KB's share a row, no more than the range holds, a power of two (0: no prefetch)."""
    if not use_pdl or PREFETCH_KB <= 0:
        return 0
    share = PREFETCH_KB * 1024 // (block_n * LINE_BYTES)
    held = triton.next_power_of_2(triton.cdiv(k_range * element_size, LINE_BYTES))
    lines = min(share, held)
    return 1 << (lines.bit_length() - 1) if lines >= 1 else 0


def prefetch_options(block_n: int, k_range: int, weight_element_size: int, use_pdl: bool) -> dict[str, int]:
    """A product kernel's prefetch arguments (PREFETCH_LINES, LINE_ELEMS) for its launch."""
    return {"PREFETCH_LINES": prefetch_lines(block_n, k_range, weight_element_size, use_pdl),
            "LINE_ELEMS": LINE_BYTES // weight_element_size}
