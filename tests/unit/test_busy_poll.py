"""Busy polling (specdec/busy_poll.py): when a service polls, and that its loop polls exactly while held."""
from __future__ import annotations

import asyncio

import pytest

from specdec import busy_poll
from specdec.busy_poll import MAX_STREAMS_ENV, BusyPoll, busy_poll_enabled


@pytest.mark.parametrize(("mode", "model_device", "num_cpus", "enabled"), [
    ("on", "cpu", 2, True),
    ("off", "cuda", 64, False),
    ("auto", "cuda", 16, True),  # the GPU host: a CUDA model, cores to spare
    ("auto", "cpu", 16, False),  # a CPU model's torch threads need every core
    ("auto", "", 16, False),  # a target older than ModelInfo.device: not known to be on a GPU
    ("auto", "cuda", 2, False),  # CI's two cores: none to spare
])
def test_the_mode_the_model_device_and_the_cores_decide(mode, model_device, num_cpus, enabled):
    assert busy_poll_enabled(mode, model_device, num_cpus) is enabled


def test_an_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="auto, on, off"):
        busy_poll_enabled("always", "cuda")


def test_the_loop_polls_while_exactly_one_holder_is_left():
    async def polls_during(poll: BusyPoll) -> int:
        before = poll.num_polls
        await asyncio.sleep(0.02)
        return poll.num_polls - before

    async def scenario() -> None:
        poll = BusyPoll()
        with poll.held():
            assert await polls_during(poll) > 10  # a sleeping loop would have run the task ~once
            with poll.held():  # a second stream: the loop is left to sleep
                await asyncio.sleep(0)  # the cancelled task ends
                assert not poll.is_polling and await polls_during(poll) == 0
            assert poll.num_holders == 1 and poll.is_polling
            assert await polls_during(poll) > 10
        await asyncio.sleep(0)
        assert (poll.num_holders, poll.is_polling, await polls_during(poll)) == (0, False, 0)

    asyncio.run(scenario())


def test_a_poll_allowed_more_streams_polls_until_one_more_is_open(monkeypatch):
    monkeypatch.setenv(MAX_STREAMS_ENV, "2")

    async def scenario() -> list[bool]:
        poll = BusyPoll()
        states = []
        with poll.held(), poll.held():
            states.append(poll.is_polling)
            with poll.held():
                states.append(poll.is_polling)
            states.append(poll.is_polling)
        states.append(poll.is_polling)
        return states

    assert asyncio.run(scenario()) == [True, False, True, False]


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_stream_limit_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(MAX_STREAMS_ENV, value)
    with pytest.raises(ValueError, match=MAX_STREAMS_ENV):
        BusyPoll()


def test_a_polling_loop_rehearses_now_and_then_and_only_while_it_polls():
    async def scenario() -> None:
        calls: list[float] = []
        poll = BusyPoll(rehearse=lambda: calls.append(asyncio.get_running_loop().time()))
        with poll.held():
            await asyncio.sleep(0.02)
        await asyncio.sleep(0)
        held = len(calls)
        await asyncio.sleep(0.01)
        # about one every REHEARSE_EVERY_S of the 20 ms, none once the stream is gone
        assert 5 <= held <= 0.02 / busy_poll.REHEARSE_EVERY_S + 1
        assert len(calls) == held == poll.num_rehearsals

    asyncio.run(scenario())


def test_a_rehearsal_that_fails_is_dropped_and_the_loop_keeps_polling(caplog):
    def broken() -> None:
        raise RuntimeError("scratch state gone")

    async def scenario() -> None:
        poll = BusyPoll(rehearse=broken)
        with poll.held():
            await asyncio.sleep(0.005)
            polls = poll.num_polls
            await asyncio.sleep(0.005)
            assert poll.num_polls > polls
        assert poll.rehearse is None and poll.num_rehearsals == 0

    asyncio.run(scenario())
    assert [r.message for r in caplog.records] == ["rehearsal failed; not rehearsing again"]


def test_keeping_warm_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv(busy_poll.KEEP_WARM_ENV, raising=False)
    assert not busy_poll.keep_warm_enabled()
    monkeypatch.setenv(busy_poll.KEEP_WARM_ENV, "1")
    assert busy_poll.keep_warm_enabled()
