"""A model service's side of a `Lane` stream: many requests' sequences on one stream.

Per request a `Sequence` stream costs gRPC messages in proportion to the requests: with 8 streams
decoding, every step of the trio moves 8 messages each way on each leg, and each message costs the
event loops of both ends tens of microseconds (bench/results/gpu_e2e_lanes*.json). A lane carries
the commands of many sequences in one message and their answers in one message per batched forward.

Each sequence of a lane runs through the service's own `Sequence` handler, fed from a queue, so a
sequence behaves exactly as on a stream of its own: the same command order, the same errors (sent
back as that sequence's `LaneError`, ending only it), and its state freed when it ends - by its
`close` command, its error, or the lane's end for any reason (cancelled, the gateway gone).

Answers are coalesced: the first sequence to answer yields to the event loop once before writing,
and every answer queued meanwhile goes into the same message. A batch's answers resolve together
and their sequences' tasks run in that turn (asyncio runs ready callbacks in order), so one batched
forward is answered by one message. A lane of one sequence writes at once.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import nullcontext

import grpc

from specdec.busy_poll import lane_sequence_hold
from specdec.errors import InvalidRequestError
from specdec.request_id import check_request_id, new_request_id, request_id_var
from specdec.serving import status_of
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

SequenceHandler = Callable[[AsyncIterator, grpc.aio.ServicerContext], AsyncIterator]
_CLOSE = object()


async def _commands(queue: asyncio.Queue) -> AsyncIterator:
    while (command := await queue.get()) is not _CLOSE:
        yield command


class _Lane:
    def __init__(self, name: str, handler: SequenceHandler, context: grpc.aio.ServicerContext,
                 response_type: type, answer_type: type) -> None:
        self._name = name
        self._handler = handler
        self._context = context
        self._response_type = response_type
        self._answer_type = answer_type
        self._queues: dict[int, asyncio.Queue] = {}
        self._tasks: dict[int, asyncio.Task] = {}
        self._answers: list = []
        self._flushing = False  # a sequence's task is writing the answers out

    async def serve(self, requests: AsyncIterator) -> None:
        """Routes each command to its sequence; at the client's half-close, lets every sequence
        finish the commands it has; at the lane's end, ends them all."""
        try:
            async for request in requests:
                for command in request.commands:
                    self._route(command)
            for queue in self._queues.values():
                queue.put_nowait(_CLOSE)
            while self._tasks:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        finally:  # normal end, error, cancellation or a dead client: every sequence's state goes back
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _route(self, command) -> None:
        queue = self._queues.get(command.sequence)
        if command.close:
            if queue is not None:
                queue.put_nowait(_CLOSE)
            return
        if queue is None:
            queue = self._queues[command.sequence] = asyncio.Queue()
            self._tasks[command.sequence] = asyncio.create_task(
                self._run(command.sequence, queue, command.request_id))
        queue.put_nowait(command.request)

    async def _run(self, sequence: int, queue: asyncio.Queue, request_id: str) -> None:
        request_id_var.set(request_id or new_request_id())
        log.debug("%s sequence %d started", self._name, sequence)
        hold = lane_sequence_hold.get()
        try:
            if request_id and (problem := check_request_id(request_id)) is not None:
                raise InvalidRequestError(f"request_id: {problem}")
            with hold() if hold is not None else nullcontext():
                async for response in self._handler(_commands(queue), self._context):
                    await self._send(self._answer_type(sequence=sequence, response=response))
        except Exception as e:  # noqa: BLE001 - ends this sequence only, as its own stream would end
            code, message = _status(e)
            await self._send(self._answer_type(sequence=sequence, error=common_pb2.LaneError(code=code.value[0],
                                                                                         message=message)))
        finally:
            log.debug("%s sequence %d ended", self._name, sequence)
            del self._queues[sequence], self._tasks[sequence]

    async def _send(self, answer) -> None:
        """Queues `answer`; the first sequence to answer writes out every answer queued meanwhile."""
        self._answers.append(answer)
        if self._flushing:
            return
        self._flushing = True
        try:
            if len(self._tasks) > 1:
                await asyncio.sleep(0)  # the other sequences answered by the same batch queue theirs
            while self._answers:
                answers, self._answers = self._answers, []
                await self._context.write(self._response_type(answers=answers))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self._answers.clear()  # the client is gone: the lane is ending
        finally:
            self._flushing = False


def _status(error: Exception) -> tuple[grpc.StatusCode, str]:
    status = status_of(error)
    if status is None:  # a bug: logged, the sequence ends INTERNAL, the lane and the service go on
        log.exception("unexpected error in a lane's sequence", exc_info=error)
        return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
    return status


async def serve_lane(name: str, handler: SequenceHandler, requests: AsyncIterator,
                     context: grpc.aio.ServicerContext, response_type: type, answer_type: type) -> None:
    """The body of a servicer's `Lane` (`name`, e.g. "/specdec.v1.TargetService/Lane", for the logs):
    runs each sequence through `handler` (the servicer's `Sequence`), writing answers with
    `context.write`."""
    await _Lane(name, handler, context, response_type, answer_type).serve(requests)
