"""BENCHMARK ONLY: runs a service module with timing probes on the calls a step goes through.

`SPECDEC_TRACE_RUN=MODULE SPECDEC_TRACE_DIR=DIR python -m bench.trace_probe [the module's args]`
runs MODULE (gateway, target_service, draft_service, bench.oracle_draft) as `python -m MODULE`
would, with these calls timed (host wall clock, time.perf_counter_ns: CLOCK_MONOTONIC, one
timeline for every process on the machine):
  gateway: gw.propose, gw.verify (a step's two round trips, as the speculative loop awaits them);
  target:  tgt.verify (engine call: the batching loop's hand-offs + the work), tgt.process (the
           engine step: inputs, forward, verification), runner.forward (the forward; with the greedy read back
           where the caller asks for it),
           tgt.readback (the argmax tokens' read back, so it ends once the GPU has);
  draft:   dft.propose, dft.process, dft.loop (as the target's), dft.readback (the proposals' read back);
  both:    gpu.replay (a CUDA graph's device time, from events around its replay; its start and end
           are the host times its replay was called and its events were seen done).
Each process appends `[name, start_ns, end_ns]` rows to DIR/ROLE-PID.jsonl (flushed every 256
rows and at exit). bench/step_trace.py merges them into the parts of a step.
"""
from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import runpy
import sys
import time
from pathlib import Path

FLUSH_EVERY = 256


class Recorder:
    def __init__(self, path: Path) -> None:
        self._file = path.open("a")
        self._rows: list[list] = []
        self._events: list[tuple[float, object, object]] = []  # replays whose device time is not known yet
        atexit.register(self.flush)

    def record(self, name: str, start_ns: int, end_ns: int) -> None:
        self._rows.append([name, start_ns, end_ns])
        if len(self._rows) >= FLUSH_EVERY:
            self.flush()

    def replayed(self, start_ns: int, begin, end) -> None:
        self._events.append((start_ns, begin, end))

    def resolve(self) -> None:
        """Records the replays whose events are done (called before each replay: cheap queries)."""
        waiting = []
        for start_ns, begin, end in self._events:
            if end.query():
                self.record("gpu.replay", start_ns, start_ns + int(begin.elapsed_time(end) * 1e6))
            else:
                waiting.append((start_ns, begin, end))
        self._events = waiting

    def flush(self) -> None:
        for row in self._rows:
            self._file.write(json.dumps(row) + "\n")
        self._rows = []
        self._file.flush()


def timed(recorder: Recorder, name: str, fn):
    if inspect.isgeneratorfunction(fn):  # an engine step (engine/gpu_work.py): timed until it returns
        @functools.wraps(fn)
        def generator_wrapper(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return (yield from fn(*args, **kwargs))
            finally:
                recorder.record(name, start, time.perf_counter_ns())
        return generator_wrapper

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def async_wrapper(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return await fn(*args, **kwargs)
            finally:
                recorder.record(name, start, time.perf_counter_ns())
        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            recorder.record(name, start, time.perf_counter_ns())
    return wrapper


def _patch(recorder: Recorder, owner, method: str, name: str) -> None:
    setattr(owner, method, timed(recorder, name, getattr(owner, method)))


def _patch_replays(recorder: Recorder) -> None:
    import torch

    if not torch.cuda.is_available():
        return
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(self):
        recorder.resolve()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter_ns()
        begin.record()
        replay(self)
        end.record()
        recorder.replayed(start, begin, end)

    torch.cuda.CUDAGraph.replay = timed_replay


def install(module: str, recorder: Recorder) -> None:
    if module == "gateway":
        from gateway.backends import DraftStream, TargetStream

        _patch(recorder, DraftStream, "propose", "gw.propose")
        _patch(recorder, TargetStream, "verify", "gw.verify")
        return
    from engine.model_runner import ModelRunner

    _patch(recorder, ModelRunner, "_forward", "runner.forward")  # forward and forward_greedy
    _patch_replays(recorder)
    if module == "target_service":
        import engine.target_engine

        _patch(recorder, engine.target_engine.TargetEngine, "verify", "tgt.verify")
        _patch(recorder, engine.target_engine.TargetEngine, "_process", "tgt.process")
        from engine.cuda_graphs import GreedyIds

        _patch(recorder, GreedyIds, "get", "tgt.readback")  # the argmax tokens' read back
    else:
        from engine.draft_loop import DraftLoop, _DeviceLoop
        from engine.model_drafter import ModelDrafter

        _patch(recorder, ModelDrafter, "propose", "dft.propose")
        _patch(recorder, ModelDrafter, "_process", "dft.process")
        _patch(recorder, DraftLoop, "propose_work", "dft.loop")  # what the drafter runs (propose runs it too)
        _patch(recorder, _DeviceLoop, "read", "dft.readback")


def main() -> None:
    module = os.environ["SPECDEC_TRACE_RUN"]
    directory = Path(os.environ["SPECDEC_TRACE_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    role = module.rsplit(".", 1)[-1]
    install(module, Recorder(directory / f"{role}-{os.getpid()}.jsonl"))
    sys.argv[0] = module
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
