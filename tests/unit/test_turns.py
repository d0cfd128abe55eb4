"""specdec/turns.py and the gateway's admission on it: a bounded number hold a turn, the others wait in arrival
order and are counted; the gateway refuses a request once its slots are taken and its queue is full."""
from __future__ import annotations

import asyncio

import pytest

from gateway.admission import RequestAdmission
from specdec.errors import CapacityError
from specdec.turns import Turns


def test_waiters_get_their_turns_in_arrival_order_and_are_counted_while_they_wait():
    async def main() -> tuple[list[str], list[int]]:
        turns, order, waiting = Turns(1), [], []
        release = asyncio.Event()

        async def holder(name: str) -> None:
            async with turns.turn():
                order.append(name)
                await release.wait()

        tasks = [asyncio.create_task(holder(name)) for name in ("first", "second", "third")]
        await asyncio.sleep(0)
        waiting.append(turns.num_waiting)
        assert turns.are_all_taken() and order == ["first"]
        release.set()
        await asyncio.gather(*tasks)
        waiting.append(turns.num_waiting)
        assert not turns.are_all_taken()
        return order, waiting

    assert asyncio.run(main()) == (["first", "second", "third"], [2, 0])


def test_a_waiter_cancelled_before_its_turn_is_no_longer_counted_and_takes_no_turn():
    async def main() -> tuple[int, bool]:
        turns = Turns(1)
        async with turns.turn():
            waiter = asyncio.create_task(turns.turn().__aenter__())
            await asyncio.sleep(0)
            assert turns.num_waiting == 1
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
        return turns.num_waiting, turns.are_all_taken()

    assert asyncio.run(main()) == (0, False)


def test_the_gateway_refuses_a_request_once_its_slots_are_taken_and_its_queue_is_full():
    async def main() -> str:
        admission, release = RequestAdmission(max_running=1, max_waiting=1), asyncio.Event()

        async def request() -> None:
            async with admission.slot():
                await release.wait()

        running, queued = asyncio.create_task(request()), asyncio.create_task(request())
        await asyncio.sleep(0)
        assert not admission.can_admit()
        with pytest.raises(CapacityError) as refused:
            async with admission.slot():
                pass
        release.set()
        await asyncio.gather(running, queued)
        assert admission.can_admit()
        return str(refused.value)

    assert "at capacity (1 requests generating, 1 waiting)" in asyncio.run(main())
