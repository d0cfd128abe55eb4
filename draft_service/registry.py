"""The drafts one draft service holds: loaded by name, one of them the default, swapped live.

Swap semantics: a sequence stays on the drafter it started on until its stream ends. Loading a
draft (or replacing one under the same name, or changing the default) only changes what *new*
sequences get, atomically: one dict assignment on the event loop. A replaced or unloaded drafter
is stopped, and its memory freed, when its last sequence ends.

Why in-flight sequences finish on the old model instead of re-prefilling on the new one: a
re-prefill would charge every in-flight request a forward over its whole context on the new
draft at the moment of the swap - a latency spike exactly when the operator is changing things -
and buys nothing for correctness, since the target alone decides the output. The cost is that
both models are resident until the old one's last request ends. Once it has, the old model's GPU memory goes
back to the device (not just to PyTorch's cache), between loads, since loads capture graphs.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engine.batching_loop import ForwardObserver, torch_thread
from engine.cuda_graphs import release_cached_gpu_memory
from engine.drafter import Drafter
from engine.model_drafter import ModelDrafter
from engine.model_runner import ModelRunner, RuntimeConfig
from engine.ngram_drafter import NgramDrafter
from specdec.errors import IncompatibleModelsError, InvalidRequestError, NotFoundError, SpecdecError

log = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
NGRAM = "ngram"  # the model spec of the weightless prompt-lookup drafter

LoadFn = Callable[[str], Awaitable[Drafter]]  # model spec -> a drafter, not yet started


def model_loader(base: RuntimeConfig, ahead: bool = False) -> LoadFn:
    """Loads drafts with the service's runtime settings (device, dtype, KV size, batch size), each on its
    own torch thread; `ahead`: they draft ahead while the target verifies (engine/model_drafter.py)."""

    async def load(model: str) -> Drafter:
        if model == NGRAM:
            return NgramDrafter()
        executor = torch_thread()

        def build() -> ModelDrafter:  # load and capture on its torch thread (on a CPU the one that runs it: batching_loop)
            runner = ModelRunner(dataclasses.replace(base, model=model))
            return ModelDrafter(runner, executor=executor, ahead=ahead)

        try:
            return await asyncio.wrap_future(executor.submit(build))
        except BaseException:
            executor.shutdown(wait=False)
            raise

    return load


@dataclass(eq=False)
class Lease:
    """A sequence's hold on the drafter it started on."""

    name: str
    drafter: Drafter
    _entry: _Entry


@dataclass(eq=False)
class _Entry:
    drafter: Drafter
    num_leases: int = 0
    retired: bool = False
    started: bool = False


@dataclass(frozen=True)
class DraftInfo:
    name: str
    drafter: Drafter
    is_default: bool


class DraftRegistry:
    def __init__(self, load: LoadFn | None = None) -> None:
        """`load`: how LoadDraft builds a drafter from a model spec; None refuses loads."""
        self._load = load
        self._entries: dict[str, _Entry] = {}
        self._default = ""
        self._loading = asyncio.Lock()
        self._started = False
        self._observer: ForwardObserver | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    @classmethod
    def of(cls, drafter: Drafter, name: str = "default", load: LoadFn | None = None) -> DraftRegistry:
        """A registry serving `drafter` as its default (started by `start`)."""
        registry = cls(load)
        registry.add(name, drafter, make_default=True)
        return registry

    def add(self, name: str, drafter: Drafter, make_default: bool = False) -> None:
        """Serves an already-built drafter under a new name (started with the registry)."""
        if name in self._entries:
            raise InvalidRequestError(f"a draft named {name!r} is loaded")
        entry = _Entry(drafter)
        if self._started:
            self._start(entry)
        self._entries[name] = entry
        if make_default or not self._default:
            self._default = name

    def start(self) -> None:
        """Starts the drafters' batching loops; later loads start theirs as they come."""
        self._started = True
        for entry in self._entries.values():
            self._start(entry)

    @property
    def default(self) -> Drafter:
        return self._entries[self._default].drafter

    def list(self) -> list[DraftInfo]:
        return [DraftInfo(name, e.drafter, name == self._default) for name, e in self._entries.items()]

    def stats(self) -> dict[str, int]:
        """Every loaded draft's engine counters summed (each has its own KV pool); the block size is the default's."""
        total: collections.Counter[str] = collections.Counter()
        for name, entry in self._entries.items():
            stats = entry.drafter.stats()
            total.update(stats)
            if name == self._default:
                block_size = stats.get("kv_block_size", 0)
        total["kv_block_size"] = block_size
        return dict(total)

    def acquire(self, name: str) -> Lease:
        """The drafter a new sequence runs on: `name`, or the default for ""."""
        name = name or self._default
        entry = self._entries.get(name)
        if entry is None:
            raise self._not_loaded(name)
        entry.num_leases += 1
        return Lease(name, entry.drafter, entry)

    def release(self, lease: Lease) -> None:
        entry = lease._entry
        entry.num_leases -= 1
        if entry.retired and entry.num_leases == 0:
            self._stop_later(entry.drafter)

    async def load(self, name: str, model: str, make_default: bool = False, expected_fingerprint: str = "",
                   replace: bool = False) -> tuple[DraftInfo, float]:
        """Loads `model` as `name`; returns it and the seconds it took. The old state serves until then."""
        if not NAME_PATTERN.fullmatch(name):
            raise InvalidRequestError(f"draft name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
        if not model:
            raise InvalidRequestError("model is empty; give a hub id, a directory, a .gguf file or 'ngram'")
        if self._load is None:
            raise InvalidRequestError("this draft service cannot load models (started without a loader)")
        async with self._loading:  # one load at a time: each holds a whole model in memory
            if name in self._entries and not replace:
                raise InvalidRequestError(f"a draft named {name!r} is loaded; set replace to swap it")
            started = asyncio.get_running_loop().time()
            try:
                drafter = await self._built(model)
            except SpecdecError:
                raise
            except Exception as e:  # bad path, unreachable hub, corrupt file: the old state keeps serving
                raise InvalidRequestError(f"cannot load draft model {model!r}: {type(e).__name__}: {e}") from e
            try:
                self._check_tokenizer(drafter, expected_fingerprint)
            except IncompatibleModelsError:
                self._stop_later(drafter)
                raise
            old, new = self._entries.get(name), _Entry(drafter)
            if self._started:
                self._start(new)
            self._entries[name] = new  # the switch: new sequences get the new drafter
            if make_default or not self._default:
                self._default = name
            if old is not None:
                self._retire(old)
            seconds = asyncio.get_running_loop().time() - started
        log.info("draft %r loaded from %s in %.1f s%s", name, model, seconds, " (default)" if name == self._default else "")
        return DraftInfo(name, drafter, name == self._default), seconds

    def set_default(self, name: str) -> None:
        """Makes the loaded draft `name` the default: new sequences without a name get it (running ones stay on
        theirs). A load with make_default that lands later takes the default from it, as loads order themselves."""
        if not name:
            raise InvalidRequestError(f"name is empty; give a loaded draft's: {', '.join(sorted(self._entries))}")
        if name not in self._entries:
            raise self._not_loaded(name)
        self._default = name
        log.info("draft %r is the default", name)

    def unload(self, name: str) -> None:
        if name not in self._entries:
            raise self._not_loaded(name)
        if name == self._default:
            raise InvalidRequestError(f"{name!r} is the default draft; make another draft the default first")
        self._retire(self._entries.pop(name))
        log.info("draft %r unloaded", name)

    async def stop(self) -> None:
        for entry in self._entries.values():
            await entry.drafter.stop()
        self._entries.clear()
        await self.retired()

    async def retired(self) -> None:
        """Waits until the replaced and unloaded drafts whose sequences have ended are stopped and their memory
        released."""
        await asyncio.gather(*self._stopping, return_exceptions=True)

    def _not_loaded(self, name: str) -> NotFoundError:
        return NotFoundError(f"no draft model named {name!r} is loaded; loaded: {', '.join(sorted(self._entries))}")

    def _check_tokenizer(self, drafter: Drafter, expected: str) -> None:
        new = drafter.description
        if not new.tokenizer_fingerprint:  # tokenizer-free (n-gram): works with any target
            return
        references = [("the expected tokenizer", expected)] if expected else [
            (f"draft {name!r} ({e.drafter.description.model_id}, vocab {e.drafter.description.vocab_size})",
             e.drafter.description.tokenizer_fingerprint)
            for name, e in self._entries.items() if e.drafter.description.tokenizer_fingerprint]
        for what, fingerprint in references:
            if fingerprint != new.tokenizer_fingerprint:
                raise IncompatibleModelsError(
                    f"draft model {new.model_id!r} (vocab {new.vocab_size}, tokenizer {new.tokenizer_fingerprint[:12]}) "
                    f"has a different tokenizer than {what} (tokenizer {fingerprint[:12]}); a draft must use the "
                    "target's tokenizer")

    def observe_forwards(self, observer: ForwardObserver) -> None:
        """Every model drafter, loaded now or later, reports its batched steps to `observer`."""
        self._observer = observer

    def _start(self, entry: _Entry) -> None:
        if self._observer is not None and hasattr(entry.drafter, "observe_forwards"):
            entry.drafter.observe_forwards(self._observer)
        if not entry.started:
            entry.drafter.start_background()
            entry.started = True

    def _retire(self, entry: _Entry) -> None:
        entry.retired = True
        if entry.num_leases == 0:
            self._stop_later(entry.drafter)

    async def _built(self, model: str) -> Drafter:
        """`self._load(model)`. A caller cancelled meanwhile (its client gave up: a deadline) still waits for the build,
        which runs on its thread either way, so loads stay one at a time; what it made is stopped once made, and the
        state it would have changed keeps serving, as after any failed load."""
        loading = asyncio.ensure_future(self._load(model))
        try:
            return await asyncio.shield(loading)
        except asyncio.CancelledError:
            loading.add_done_callback(self._stop_abandoned)
            await asyncio.wait({loading})
            raise

    def _stop_abandoned(self, loading: asyncio.Future[Drafter]) -> None:
        if not loading.cancelled() and loading.exception() is None:
            log.info("a load its caller gave up on finished; its draft is stopped, nothing was switched")
            self._stop_later(loading.result())

    def _stop_later(self, drafter: Drafter) -> None:
        task = asyncio.get_running_loop().create_task(self._stop_and_free(drafter))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _stop_and_free(self, drafter: Drafter) -> None:
        """Stops `drafter` and, once nothing holds it, returns its GPU memory to the device: a swap does not leave the
        service holding two models' memory. Between loads: emptying the cache frees device memory, which a graph
        capture on another thread must not see."""
        await drafter.stop()
        del drafter  # the last reference: its tensors go back to the cache here
        async with self._loading:
            await asyncio.to_thread(release_cached_gpu_memory)
