"""A leadership term (replica/term.py): it acts only while it holds the lease, its reads
and writes are bounded by what remains of it, and the watermark it records."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
from pymongo.errors import AutoReconnect, DuplicateKeyError, ExecutionTimeout, NetworkTimeout

from hascheduler.core.entries import Entry
from hascheduler.core.triggers import Interval
from hascheduler.replica.term import LeadershipLost, Term
from tests.dispatching import T0, FixedLease, RenewedLease, at
from tests.waiting import still_pending, wait_until


async def test_a_databases_first_term_records_no_watermark_while_it_catches_up() -> None:
    """A term that took over no watermark (no term of the database had fired) has the
    lease record none while its catch-up runs: a next leader then catches each schedule up
    from its creation again, not from this term's start. One that took a watermark over
    has the lease keep it until then."""
    now = dt.datetime.now(dt.UTC)
    lease = FixedLease()
    async with Term(1, lease, {}) as term:
        term.advance(now)
        term.take_over(None)
        assert term.fired_through is None
        term.take_over(now - dt.timedelta(minutes=1))
        assert term.fired_through == now - dt.timedelta(minutes=1)
        term.caught_up()
        assert term.fired_through == now


async def test_a_term_acts_only_while_it_holds_the_lease() -> None:
    """The fence, asked of the term alone: a lapsed renew deadline or a newer term on the
    lease stops it, and leaving it empties its queue and cancels its waits."""
    entries = {"s": Entry(1, False, Interval(60.0, T0), 0.0, "all", 3600.0, "t")}
    lease = FixedLease(term=4)
    async with Term(4, lease, entries) as term:
        term.check()
        assert term.holds
        lease.term = 5  # re-elected: a new term, not this one
        assert not term.holds
        with pytest.raises(LeadershipLost):
            term.check()
        lease.term, lease.valid = 4, False  # the renew deadline passed
        with pytest.raises(LeadershipLost):
            term.check()
        list(term.queue.seed(at(0), {}, {}))
        assert list(term.queue.items())
        never = asyncio.Event()

        async def wait_for_ever() -> None:
            await never.wait()

        term.start_waiting(wait_for_ever())
        (waiting,) = term._waiting
    assert not term.active
    assert list(term.queue.items()) == []
    await asyncio.wait({waiting}, timeout=5)
    assert waiting.cancelled()


async def test_a_terms_write_outlives_its_cancelled_caller_and_settle_waits_for_it() -> None:
    """A write whose caller is cancelled (the handover stops the lead) goes on to its
    answer, and ``settle`` returns once it has it: the lease is released after the write
    was applied or refused, never while it may still land."""
    lease = FixedLease(term=1, remaining_s=5.0, ttl_s=2.0)
    answer = asyncio.Event()
    applied: list[str] = []

    async def claim() -> str:
        await answer.wait()
        applied.append("claim")
        return "claim"

    async with Term(1, lease, {}) as term:
        caller = asyncio.create_task(term.write(claim()))
        await wait_until(lambda: term._writes.tasks, 5, "the write in flight")
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        settling = asyncio.create_task(term.settle(5.0))
        await still_pending(settling, 0.2, "the settle with a write unanswered")
        assert not applied
        answer.set()
        assert await settling
        assert applied == ["claim"]
        assert await term.settle(0.0)  # nothing in flight


@pytest.mark.parametrize(
    ("error", "settled"),
    [
        (AutoReconnect("connection lost mid-write"), False),  # sent, fate unknown
        (NetworkTimeout("timed out waiting for the reply"), False),
        (DuplicateKeyError("E11000"), True),  # the server answered: refused
        (ExecutionTimeout("operation exceeded time limit", 50), True),
    ],
)
async def test_a_write_that_ended_unanswered_keeps_the_lease_from_being_released(
    error: Exception, settled: bool
) -> None:
    lease = FixedLease(term=1, remaining_s=5.0, ttl_s=60.0)

    async def failing() -> None:
        raise error

    async with Term(1, lease, {}) as term:
        with pytest.raises(type(error)):
            await term.write(failing())
        assert await term.settle(1.0) is settled


async def test_a_write_past_what_remains_of_the_term_ends_the_term() -> None:
    lease = FixedLease(remaining_s=0.05, ttl_s=60.0)
    async with Term(1, lease, {}) as term:
        with pytest.raises(LeadershipLost):
            await term.write(asyncio.Event().wait())
        # Still in flight once the term gave up on it: the release waits, then lapses.
        assert not await term.settle(0.05)
    # The same term led again (the dispatcher's next lead) answers for that write too.
    async with Term(1, lease, {}) as again:
        again.follows(term)
        assert not await again.settle(0.05)
        held = list(again._writes.tasks)
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        assert not again._writes.tasks
        assert not await again.settle(0.05)  # ended unanswered, within the ttl


async def test_a_terms_read_lasts_while_the_lease_is_renewed_and_ends_when_it_lapses() -> None:
    """A read that decides a write changes nothing: it goes on past what remained of the
    term when it began for as long as the lease is renewed (with that fixed budget, a pool
    the database held up stopped the fire loop), and is abandoned when the renewals stop,
    once the last one's time runs out and not before."""
    loop = asyncio.get_running_loop()
    lease = RenewedLease(0.2, ttl_s=10.0)
    answer = asyncio.Event()

    async def read() -> str:
        await answer.wait()
        return "read"

    async with Term(1, lease, {}) as term:
        reading = asyncio.create_task(term.read(read()))
        # The term looks again each time what remained runs out: four looks past its
        # first budget, the read goes on.
        await wait_until(lambda: lease.asks >= 5, 10, "four renewed budgets")
        assert not reading.done()
        answer.set()
        assert await asyncio.wait_for(reading, 5) == "read"

        answer.clear()
        reading = asyncio.create_task(term.read(read()))
        await wait_until(lambda: lease.asks >= 6, 5, "the second read's first ask")
        lease.renewed = False
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(reading, 5)
        # Not before the last renewal's time ran out (measured from that renewal, not from
        # when this test woke to stop renewing: its poll lags by up to an interval).
        assert loop.time() >= lease.until - 0.01


async def test_a_terms_read_ends_when_a_newer_term_holds_the_lease_or_after_three_ttls() -> None:
    """Renewed or not, a read ends with LeadershipLost when the lease is another term's
    (re-elected meanwhile), and when it outlasts three lease ttls (a connection gone
    silent, which the driver would wait on for ever)."""
    loop = asyncio.get_running_loop()
    lease = RenewedLease(0.2, ttl_s=10.0)
    async with Term(1, lease, {}) as term:
        reading = asyncio.create_task(term.read(asyncio.Event().wait()))
        lease.term = 2
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(reading, 5)

    lease = RenewedLease(0.2, ttl_s=0.5)
    async with Term(1, lease, {}) as term:
        began = loop.time()
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(term.read(asyncio.Event().wait()), 10)
        assert loop.time() - began >= 3 * 0.5 - 0.05
        assert lease.asks > 3  # renewed all along: the bound, not the lease, ended it


async def test_a_deferrable_write_that_outlasts_the_term_is_put_off_while_the_term_holds() -> None:
    """``write_or_defer`` (the retry loop's periodic adoption): past what remains of the
    term, a write returns None while the term still holds the lease, so the lead goes on
    and makes it again next turn; the write is still one ``settle`` waits for. Once the
    term no longer holds, it raises LeadershipLost, as ``write`` does."""
    lease = FixedLease(term=1, remaining_s=0.2, ttl_s=2.0)
    answer = asyncio.Event()

    async def adopt() -> int:
        await answer.wait()
        return 3

    async with Term(1, lease, {}) as term:
        assert await asyncio.wait_for(term.write_or_defer(adopt()), 5) is None
        assert len(term._writes.tasks) == 1  # in flight: settle waits for it
        lease.valid = False
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(term.write_or_defer(adopt()), 5)
        answer.set()
        assert await term.settle(5)
        lease.valid = True
        assert await asyncio.wait_for(term.write_or_defer(adopt()), 5) == 3
