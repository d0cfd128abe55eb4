"""The gateway's side of `Lane` streams: many requests' sequences on a few streams per service.

A lane is one bidi `Lane` stream to one replica (gRPC's round-robin picks it when the lane opens).
Each request's sequence on it is a `LaneCall`, which offers what the per-request streams offer the
gateway (`write` a command, `read` its answer, `cancel`), so the speculative loop does not know
which it talks over. Commands written before the lane's writer runs go out in one message: the
requests answered by one message (one batched forward) resume together and their next commands
share the next message (specdec/lane_server.py coalesces the answers the same way).

A lane that breaks (its replica gone, the connection lost) fails every sequence on it with the
lane's status, exactly as their own streams would have failed, and the requests move on (a lost
draft ends drafting, a lost target re-prefills elsewhere). The pool opens a new lane for the next
sequence. Lanes take new sequences for `max_age_s` only and close once their last sequence ends, so
the pool follows the replicas gRPC finds when it re-resolves the service's name.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Callable

import grpc

log = logging.getLogger(__name__)

_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
_END = object()  # the lane ended: read raises the lane's failure


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class LaneCall:
    """One request's sequence on a lane: the write/read/cancel of a grpc.aio.StreamStreamCall."""

    def __init__(self, lane: Lane, sequence: int, request_id: str, timeout_s: float | None) -> None:
        self._lane = lane
        self._sequence = sequence
        self._request_id = request_id  # sent with the first command
        self._answers: asyncio.Queue = asyncio.Queue()
        self._deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        self._ended = False

    async def write(self, request) -> None:
        if self._lane.failure is not None:
            raise self._lane.failure
        self._lane.send(self._lane.command_type(sequence=self._sequence, request=request,
                                                request_id=self._request_id))
        self._request_id = ""

    async def read(self):
        try:
            async with asyncio.timeout_at(self._deadline):
                answer = await self._answers.get()
        except TimeoutError:
            self.cancel()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if answer is _END:
            self._ended = True
            raise self._lane.failure
        if answer.HasField("error"):  # the service ended the sequence
            self._ended = True
            self._lane.forget(self._sequence)
            raise rpc_error(_STATUS_BY_VALUE.get(answer.error.code, grpc.StatusCode.UNKNOWN), answer.error.message)
        return answer.response

    def deliver(self, answer) -> None:
        self._answers.put_nowait(answer)

    def cancel(self) -> None:
        """Ends the sequence; the service frees its state."""
        if not self._ended:
            self._ended = True
            self._lane.close_sequence(self._sequence)


class Lane:
    """One `Lane` stream and the sequences on it."""

    def __init__(self, call: grpc.aio.StreamStreamCall, request_type: type, command_type: type,
                 on_empty: Callable[[Lane], None]) -> None:
        self._call = call
        self._request_type = request_type
        self.command_type = command_type
        self._on_empty = on_empty  # told when a sequence ends and none is left
        self._ids = itertools.count()
        self._sequences: dict[int, LaneCall] = {}
        self._commands: list = []  # for the next message
        self._writer: asyncio.Task | None = None
        self.failure: grpc.aio.AioRpcError | None = None
        self.opened_at = asyncio.get_running_loop().time()
        self._reader = asyncio.create_task(self._read())

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def open(self, request_id: str, timeout_s: float | None) -> LaneCall:
        sequence = next(self._ids)
        call = self._sequences[sequence] = LaneCall(self, sequence, request_id, timeout_s)
        return call

    def send(self, command) -> None:
        """Queues `command` for the lane's next message. The message is written by a task of its own,
        which runs after the tasks already resumed (so the commands of the requests answered by the
        same message go out together), and which no request's cancellation can cancel: gRPC ends
        the whole call when a write is cancelled."""
        self._commands.append(command)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_all())

    async def _write_all(self) -> None:
        try:
            while self._commands:
                commands, self._commands = self._commands, []
                await self._call.write(self._request_type(commands=commands))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self._commands.clear()  # the call ended: the reader fails the sequences with its status

    def close_sequence(self, sequence: int) -> None:
        if self.failure is None:
            self.send(self.command_type(sequence=sequence, close=True))
        self.forget(sequence)

    def forget(self, sequence: int) -> None:
        if self._sequences.pop(sequence, None) is not None and not self._sequences:
            self._on_empty(self)

    async def _read(self) -> None:
        try:
            while (response := await self._call.read()) is not grpc.aio.EOF:
                for answer in response.answers:
                    if (call := self._sequences.get(answer.sequence)) is not None:
                        call.deliver(answer)
            failure = rpc_error(grpc.StatusCode.UNAVAILABLE, "the service ended the lane")
        except grpc.aio.AioRpcError as e:
            failure = e
        except asyncio.CancelledError:  # the lane closed, or gRPC's call cancelled (it raises this then)
            self._fail(rpc_error(grpc.StatusCode.CANCELLED, "the lane was cancelled"))
            raise
        self._fail(failure)

    def _fail(self, failure: grpc.aio.AioRpcError) -> None:
        if self.failure is not None:
            return
        self.failure = failure
        self._commands.clear()
        for call in self._sequences.values():
            call.deliver(_END)
        self._sequences.clear()

    def close(self) -> None:
        """Ends the stream (the service frees its sequences' state)."""
        self._fail(rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the lane"))
        self._call.cancel()
        self._reader.cancel()
        if self._writer is not None:
            self._writer.cancel()

    async def wait_closed(self) -> None:
        await asyncio.gather(self._reader, *[self._writer] if self._writer else [], return_exceptions=True)


class LanePool:
    """The lanes to one service pool: `size()` lanes take new sequences, each the least loaded."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall], request_type: type,
                 command_type: type, size: Callable[[], int], max_age_s: float = 60.0) -> None:
        self._open_call = open_call
        self._request_type = request_type
        self._command_type = command_type
        self._size = size
        self._max_age_s = max_age_s
        self._lanes: list[Lane] = []  # taking new sequences
        self._retired: set[Lane] = set()  # too old: closed when their last sequence ends

    def open(self, request_id: str, timeout_s: float | None) -> LaneCall:
        now = asyncio.get_running_loop().time()
        for lane in [lane for lane in self._lanes if lane.failure is not None or now - lane.opened_at > self._max_age_s]:
            self._lanes.remove(lane)
            self._retire(lane)
        if len(self._lanes) < self._size():
            self._lanes.append(Lane(self._open_call(), self._request_type, self._command_type, self._on_empty))
        return min(self._lanes, key=lambda lane: lane.num_sequences).open(request_id, timeout_s)

    def _retire(self, lane: Lane) -> None:
        if lane.num_sequences:
            self._retired.add(lane)
        else:
            lane.close()

    def _on_empty(self, lane: Lane) -> None:
        if lane in self._retired:
            self._retired.discard(lane)
            lane.close()

    async def close(self) -> None:
        lanes = [*self._lanes, *self._retired]
        self._lanes, self._retired = [], set()
        for lane in lanes:
            lane.close()
        for lane in lanes:
            await lane.wait_closed()


def count_replicas(address: str) -> int:
    """How many addresses a gRPC target names: an `ipv4:`/`ipv6:` list's entries, a DNS name's
    addresses (blocking: a lookup), 1 for anything else (a unix socket, an unresolvable name)."""
    scheme, _, rest = address.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return len(rest.split(","))
    if scheme == "unix" or scheme == "unix-abstract":
        return 1
    if scheme == "dns":
        address = rest.lstrip("/").split("/", 1)[-1] if rest.startswith("//") else rest
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return 1
    return max(1, len({info[4][:2] for info in infos}))
