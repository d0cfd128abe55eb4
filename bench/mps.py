"""CUDA MPS for the benchmarks' services: one GPU context shared by every process on the GPU.

Without it, two processes on one GPU (the draft and the target services) each own a context, and the
GPU switches between them on every hand-over of a speculative step. Whether that costs a step anything
is not settled: a traced pair on two machine starts (bench/results/step_trace_w8a8_pinned{,_mps}.json)
showed a step 9.03 -> 8.49 ms with MPS, but pure Python sped up by as much there, and a full run under MPS
on a third start (gpu_e2e_mps_pinned.json) was slower than the headline (docs/benchmarks.md);
bench/gpu_ab.py measures it within one start.

`mps_daemon(directory)` starts `nvidia-cuda-mps-control -d` with its pipe and log directories under
`directory` (so it is this run's own daemon, not the host's) and sets CUDA_MPS_PIPE_DIRECTORY and
CUDA_MPS_LOG_DIRECTORY in this process's environment for the services spawned inside it (or only yields
them: bench/gpu_ab.py gives them to some variants' services); on exit it tells the daemon to quit (after
the services have stopped: it waits for its clients) and restores the environment, so what runs after
(the HF baseline) runs as it would on its own.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
ENV_NAMES = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def check_available() -> str | None:
    """Why MPS cannot run here (a message for the user), or None."""
    if shutil.which(CONTROL) is None:
        return f"{CONTROL} is not on PATH: CUDA MPS comes with the NVIDIA driver's compute utilities"
    return None


@contextmanager
def mps_daemon(directory: Path, set_environ: bool = True) -> Iterator[dict[str, str]]:
    """Yields the variables a process needs to be this daemon's client; with `set_environ`, sets them
    in this process's environment too (restored on exit), for the services spawned inside."""
    pipe, log = directory / "mps-pipe", directory / "mps-log"
    pipe.mkdir(parents=True, exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    client_env = dict(zip(ENV_NAMES, (str(pipe), str(log))))
    saved = {name: os.environ.get(name) for name in ENV_NAMES}
    if set_environ:
        os.environ.update(client_env)
    try:
        subprocess.run([CONTROL, "-d"], env={**os.environ, **client_env}, check=True, timeout=30)
        try:
            yield client_env
        finally:
            subprocess.run([CONTROL], input=b"quit\n", env={**os.environ, **client_env}, check=False, timeout=60)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def no_mps_env(directory: Path) -> dict[str, str]:
    """The variables that keep a process off any MPS daemon (a host-wide one included): a pipe directory
    no daemon listens on, so CUDA starts a context of its own."""
    (directory / "no-mps-pipe").mkdir(parents=True, exist_ok=True)
    return {"CUDA_MPS_PIPE_DIRECTORY": str(directory / "no-mps-pipe")}
