"""How long a model service takes from its process start to serving, with empty compile caches and then
again with the caches its first start filled: what compose's `compile-cache` volume (TRITON_CACHE_DIR,
TORCHINDUCTOR_CACHE_DIR) saves a restarted or added replica, and how large that volume grows.

bench/gpu_e2e.py's random-weight Llama-3.1-8B-shape target and Llama-3.2-1B-shape draft (bf16 on CUDA; tiny
models on the CPU with `--tiny`, which checks the script only), each started `--starts` times in turn with
the same cache directories (empty before the first), each start a fresh process stopped before the next.
Metrics: `target_start_s_cold`, `target_start_s_warm` (the median of the later starts), likewise `draft_*`,
and `compile_cache_mb` (both directories after all starts); every start's time in `details`.
Usage: python bench/service_start.py [--tiny] [--starts 2] [--draft-quantize none|int8|w8a8]
                                     [--draft-head-rows N] [--max-batch-size N] [--out PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from gpu_e2e import bench_models  # noqa: E402
from report import save_report  # noqa: E402

from specdec.launch import Trio, interrupt_on_sigterm  # noqa: E402


def timed_start(work: Path, name: str, module: str, args: list[str], env: dict[str, str]) -> float:
    """Seconds from spawning the service to its health check answering SERVING; the service is stopped after."""
    trio = Trio(work)
    try:
        started = time.perf_counter()
        trio.wait_ready(trio.spawn(name, module, args, env=env), 1800)
        return time.perf_counter() - started
    finally:
        trio.stop()


def directory_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the service
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--starts", type=int, default=2, help="starts of each service (the first with empty caches)")
    parser.add_argument("--draft-quantize", choices=["none", "int8", "w8a8"], default="none")
    parser.add_argument("--draft-head-rows", type=int, default=None)
    parser.add_argument("--max-batch-size", type=int, default=8, help="the graphs' largest batch bucket")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "service_start.json")
    args = parser.parse_args()
    if args.starts < 2:
        parser.error("--starts must be at least 2: one with empty caches, then with the filled ones")
    with tempfile.TemporaryDirectory(prefix="specdec-start-") as tmp:
        work = Path(tmp)
        models = bench_models(work, args.tiny, args.draft_head_rows, 1, 16, 16)
        cache = work / "compile-cache"
        env = {"TRITON_CACHE_DIR": str(cache / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
               "TQDM_DISABLE": "1"}
        common = [*models.service_flags, "--max-batch-size", str(args.max_batch_size)]
        services = {
            "target": ("target_service", ["--model", models.target, *common]),
            "draft": ("draft_service", ["--drafter", "model", "--model", models.draft, "--quantize",
                                        args.draft_quantize, *common]),
        }
        metrics: dict[str, float] = {}
        details: dict[str, list[float]] = {}
        for name, (module, service_args) in services.items():
            times = [timed_start(work, f"{name}{i}", module, service_args, env) for i in range(args.starts)]
            details[f"{name}_start_s"] = times
            metrics[f"{name}_start_s_cold"] = times[0]
            metrics[f"{name}_start_s_warm"] = statistics.median(times[1:])
            print(f"{name}: {', '.join(f'{t:.1f}' for t in times)} s", file=sys.stderr)
        metrics["compile_cache_mb"] = directory_mb(cache)
    save_report("service_start", metrics, args.out, details=details,
                note="the draft's starts follow the target's, sharing its cache directories (kernels both compile "
                     "are compiled once)")


if __name__ == "__main__":
    main()
