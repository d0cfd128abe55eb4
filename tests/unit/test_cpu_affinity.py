"""--cpus: which CPUs a service's threads run on (specdec/cpu_affinity.py)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec.cli_args import add_server_args
from specdec.cpu_affinity import cpus_from_the_last, parse_cpus, pin_process
from specdec.launch import Trio

CPUS = sorted(os.sched_getaffinity(0))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser, "SPECDEC_TEST", default_port=1)
    return parser.parse_args(argv)


def test_cpu_lists_read_as_the_kernel_writes_them():
    first, last = CPUS[0], CPUS[-1]
    assert parse_cpus(str(first)) == {first}
    assert parse_cpus(f"{first}-{first}") == {first}
    if set(range(first, last + 1)) <= set(CPUS):
        assert parse_cpus(f"{first}-{last}") == set(range(first, last + 1))
    assert parse_cpus(f"{last}, {first}") == {first, last}


@pytest.mark.parametrize("text, message", [("", "not a CPU list"), ("a", "not a CPU list"), ("1-", "not a CPU list"),
                                           ("3-1", "runs backwards"), ("100000", "not available here")])
def test_a_bad_cpu_list_is_refused_with_what_is_wrong(text, message, capsys):
    with pytest.raises(ValueError, match=message):
        parse_cpus(text)
    with pytest.raises(SystemExit):
        _parse(["--cpus", text])
    assert message in capsys.readouterr().err  # the flag's error says it too, not only "invalid value"


def test_the_flag_and_its_env_var_choose_the_cpus(monkeypatch):
    assert _parse([]).cpus is None
    assert _parse(["--cpus", str(CPUS[-1])]).cpus == {CPUS[-1]}
    monkeypatch.setenv("SPECDEC_TEST_CPUS", str(CPUS[0]))
    assert _parse([]).cpus == {CPUS[0]}


def test_pinning_moves_every_thread_already_running_and_those_started_after():
    """sched_setaffinity moves one thread: the threads gRPC started before the pin must move too."""
    script = f"""
import os, threading
from specdec.cpu_affinity import pin_process
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
pin_process(frozenset({{{CPUS[-1]}}}))
after = threading.Thread(target=stop.wait); after.start()
print([sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")])
stop.set()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    affinities = json.loads(out)
    # the main thread, ours before and after, and any the imports started
    assert len(affinities) >= 3 and all(cpus == [CPUS[-1]] for cpus in affinities)


def test_services_take_cpus_from_the_last_down_and_share_once_they_run_out():
    cpus = cpus_from_the_last()
    assert [next(cpus) for _ in range(2 * len(CPUS))] == CPUS[::-1] * 2


def test_another_process_is_pinned_by_its_pid_and_freed_again():
    """How gpu_e2e --pin-ab pins services it started unpinned, then gives them every CPU back."""
    script = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        tasks = Path(f"/proc/{child.pid}/task")
        while len(list(tasks.iterdir())) < 2:
            time.sleep(0.01)
        pin_process(frozenset({CPUS[-1]}), child.pid)
        assert [os.sched_getaffinity(int(t.name)) for t in tasks.iterdir()] == [{CPUS[-1]}] * 2
        pin_process(frozenset(CPUS), child.pid)
        assert [os.sched_getaffinity(int(t.name)) for t in tasks.iterdir()] == [set(CPUS)] * 2
    finally:
        child.kill()
        child.wait()


def test_a_service_started_with_cpus_serves_from_those_alone(tmp_path):
    trio = Trio(tmp_path)
    service = trio.spawn("draft", "draft_service", ["--drafter", "ngram", "--cpus", str(CPUS[-1])])
    try:
        trio.wait_ready(service, 120)
        tasks = Path(f"/proc/{service.process.pid}/task")
        deadline = time.monotonic() + 10  # pinned just after the ready file is written
        while any(os.sched_getaffinity(int(t.name)) != {CPUS[-1]} for t in tasks.iterdir()):
            assert time.monotonic() < deadline, "the service's threads were not pinned"
            time.sleep(0.05)
        assert len(list(tasks.iterdir())) > 1  # gRPC's threads among them
    finally:
        trio.stop()
    assert service.process.returncode == 0
