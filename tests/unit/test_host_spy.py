"""bench/host_spy.py's summary of py-spy's collapsed stacks: shares of own and inclusive samples, the event
loop's share, and lines that a frame name with a line break split (the H200 run stopped on one)."""
from __future__ import annotations

import pytest
from harness import bench_module

LOOP = "BaseEventLoop.run_forever (/usr/lib/python3.12/asyncio/base_events.py:607)"


@pytest.fixture(scope="module")
def host_spy():
    yield from bench_module("host_spy")


def test_samples_are_shared_out_by_function_and_thread(host_spy, tmp_path):
    raw = tmp_path / "target.txt"
    raw.write_text("\n".join([
        f"main (/srv/target_service/cli.py:30);{LOOP};verify_greedy (/srv/engine/verification.py:27) 6",
        f"main (/srv/target_service/cli.py:30);{LOOP};verify_greedy (/srv/engine/verification.py:28) 2",
        "Thread.run (/usr/lib/python3.12/threading.py:1010);_worker (/usr/lib/python3.12/concurrent/futures/thread.py:90) 2",
        "__package__ (__doc__:-241);Handle.__init__ (asyncio/events.py:44) 1",  # a frame name with a line
        "break in it, py-spy's line split in two",
    ]) + "\n")
    summary = host_spy.summarize(raw, seconds=1, rate=100)
    assert summary["samples"] == 11
    assert summary["busy_fraction"] == pytest.approx(0.11)
    assert summary["loop_fraction"] == pytest.approx(8 / 11)
    # lines of one function count together, named by their last two path parts
    assert summary["self"]["verify_greedy (engine/verification.py)"] == pytest.approx(8 / 11, abs=1e-4)
    assert summary["inclusive"]["main (target_service/cli.py)"] == pytest.approx(8 / 11, abs=1e-4)
    assert summary["self"]["_worker (futures/thread.py)"] == pytest.approx(2 / 11, abs=1e-4)
