"""What a draft process's GPU memory holds across live swaps, seen from inside it: bench/gpu_e2e.py's 1B-shape draft
(bf16, CUDA; `--tiny`: the tiny one on the CPU, a check of the script) in a DraftRegistry built as the draft service
builds it, replaced `--swaps` times (each old draft stopped and its memory released, as after a LoadDraft with
replace), then every draft stopped. After each step: PyTorch's allocator counters (what live tensors hold, what the
process keeps from the device) and what nvidia-smi charges the process. With `--history`, the Python stacks that
allocated what stays allocated once every draft has stopped (torch.cuda.memory._record_memory_history), largest
first: a swap left about 1 GiB allocated on an H100 (docs/benchmarks.md), and this names what holds such memory.

Writes bench/results/draft_memory.json (metrics: steps [{step, allocated_mib, reserved_mib, smi_mib}],
leftover_allocated_mib, leftover_stacks).
Usage: python bench/draft_memory.py [--tiny] [--swaps 3] [--history] [--draft-quantize none|int8|w8a8]
                                    [--draft-head-rows N] [--stages kernels|compiled|eager] [--out PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import torch  # noqa: E402

from gpu_e2e import bench_models  # noqa: E402
from process_memory import gpu_mib  # noqa: E402
from report import save_report  # noqa: E402

from draft_service.registry import DraftRegistry, model_loader  # noqa: E402
from engine.model_runner import RuntimeConfig  # noqa: E402
from engine.model_source import DEFAULT_MODEL  # noqa: E402
from specdec.cli_args import add_runtime_args, runtime_config  # noqa: E402

MIB = 2**20
NAME = "default"


def draft_config(args: argparse.Namespace, model: str, service_flags: list[str]) -> RuntimeConfig:
    """The draft service's runtime settings for bench/gpu_e2e.py's flags (less its logging flag)."""
    flags = list(service_flags)
    del flags[flags.index("--log-level"):flags.index("--log-level") + 2]
    parser = argparse.ArgumentParser()
    add_runtime_args(parser, "SPECDEC_DRAFT", DEFAULT_MODEL)
    parsed = parser.parse_args(["--model", model, "--stages", args.stages, "--max-batch-size", "8", *flags])
    return replace(runtime_config(parsed), quantize=args.draft_quantize)


def memory(step: str) -> dict:
    cuda = torch.cuda.is_initialized()
    row = {"step": step,
           "allocated_mib": torch.cuda.memory_allocated() / MIB if cuda else 0.0,
           "reserved_mib": torch.cuda.memory_reserved() / MIB if cuda else 0.0,
           "smi_mib": gpu_mib(os.getpid())}
    print(row, flush=True)
    return row


def _kept(filename: str) -> bool:
    """A frame worth naming: ours, an installed package's (Python), or PyTorch's C++ (a cuBLAS workspace's is there)."""
    return str(ROOT) in filename or any(part in filename for part in ("-packages/", "/aten/", "/c10/"))


def leftover_stacks(snapshot: dict, top: int = 8) -> list[str]:
    """What a torch.cuda.memory._snapshot() holds allocated, grouped by the stack that allocated it (its frames that
    `_kept` keeps, innermost first, at most 6), largest first."""
    by_stack: collections.Counter[str] = collections.Counter()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in block.get("frames", [])
                      if _kept(f["filename"])][:6]
            by_stack[" <- ".join(frames) or "(no frames)"] += block["size"]
    return [f"{size / MIB:.1f} MiB: {stack}" for stack, size in by_stack.most_common(top)]


async def swap_and_stop(config: RuntimeConfig, model: str, swaps: int) -> list[dict]:
    drafts = DraftRegistry(model_loader(config))
    await drafts.load(NAME, model, make_default=True)
    drafts.start()
    steps = [memory("one draft")]
    for i in range(swaps):
        await drafts.load(NAME, model, make_default=True, replace=True)
        steps.append(memory(f"swap {i + 1}: both resident"))
        await drafts.retired()
        steps.append(memory(f"swap {i + 1}: old draft stopped and released"))
    await drafts.stop()
    steps.append(memory("every draft stopped"))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--swaps", type=int, default=3)
    parser.add_argument("--history", action="store_true", help="record allocation stacks (CUDA; slows the loads)")
    parser.add_argument("--draft-quantize", choices=["none", "int8", "w8a8"], default="none")
    parser.add_argument("--draft-head-rows", type=int, default=None)
    parser.add_argument("--stages", choices=["kernels", "compiled", "eager"], default="compiled")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "draft_memory.json")
    args = parser.parse_args()
    if args.history and torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=1000)  # live blocks keep their stacks; a short trace
    with tempfile.TemporaryDirectory(prefix="specdec-draft-memory-") as tmp:
        models = bench_models(Path(tmp), args.tiny, args.draft_head_rows, 8, 128, 128, with_target=False)
        steps = asyncio.run(swap_and_stop(draft_config(args, models.draft, models.service_flags), models.draft,
                                          args.swaps))
    history = args.history and torch.cuda.is_initialized()
    metrics = {"steps": steps, "swaps": args.swaps, "leftover_allocated_mib": steps[-1]["allocated_mib"],
               "leftover_stacks": leftover_stacks(torch.cuda.memory._snapshot()) if history else []}
    save_report("draft_memory", metrics, args.out)


if __name__ == "__main__":
    main()
