"""specdec.launch.interrupt_on_sigterm: a SIGTERM (a benchmark's `timeout`) unwinds through the
`finally` that stops the services, instead of killing the parent and leaving them running."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    {install}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    finally:
        child.terminate()
        child.wait()
        print("stopped", flush=True)
""")


def _run(install: str) -> tuple[int, list[str]]:
    script = SCRIPT.format(install=install)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout.split()


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_sigtermed_parent_stops_its_child_with_the_handler():
    code, out = _run("from specdec.launch import interrupt_on_sigterm; interrupt_on_sigterm()")
    assert out[1:] == ["stopped"] and code != 0  # KeyboardInterrupt after the finally
    assert not _alive(int(out[0]))


def test_without_it_the_child_outlives_the_parent():
    code, out = _run("")
    child = int(out[0])
    try:
        assert out[1:] == [] and code == -15
        assert _alive(child)
    finally:
        subprocess.run(["kill", str(child)], check=False)
