"""Who leads: renew while leading, try to take over the moment the lease frees up.

Standbys watch the lease document through a change stream and try to acquire as soon as it
is released, and again at its expiry plus a small random delay; a poll every renew interval
is only the fallback (invariant 6, docs/ARCHITECTURE.md). Leading starts the dispatcher; a
failed or late renewal stops it at once. On shutdown the leader stops claiming, drains
in-flight publishes, then expires its lease so a standby takes over within milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog
from pymongo.errors import PyMongoError

from hascheduler.core.clock import Clock
from hascheduler.process import logs
from hascheduler.process.metrics import Metrics
from hascheduler.replica.term import LeadershipLost
from hascheduler.storage.lease import Lease, LeaseView
from hascheduler.storage.streams import open_change_stream

log = structlog.get_logger("hascheduler.leadership")

# Spread the standbys' attempts at expiry so they do not all hit the database at once.
TAKEOVER_SPREAD_S = 0.05


class Firing(Protocol):
    """What the elector drives while it leads (the dispatcher)."""

    @property
    def fired_through(self) -> dt.datetime | None: ...

    async def lead(self, view: LeaseView) -> None: ...

    def hand_over(self) -> None: ...

    async def drain(self) -> bool: ...

    async def settle(self, timeout_s: float) -> bool: ...


class Watchable(Protocol):
    """The lease collection, as far as waking on its changes goes."""

    def watch(self, *args: Any, **kwargs: Any) -> Any: ...


class Elector:
    def __init__(
        self,
        lease: Lease,
        dispatcher: Firing,
        leases: Watchable,
        unfit: Callable[[], str | None] = lambda: None,
        metrics: Metrics | None = None,
        clock: Clock = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.lease = lease
        self.metrics = metrics or Metrics()
        self._unfit = unfit
        self.unfit_reason: str | None = None  # why this replica may not lead now, if so
        self._clock = clock
        self.dispatcher = dispatcher
        self._leases = leases
        self._leading: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.view: LeaseView | None = None
        self._stopping = False
        self.attempts = 0  # acquire-or-renew turns taken, ready or not
        self._attempted_at = 0.0  # monotonic: when the last turn sent its request
        self._failing = False  # the last turn's request failed

    def stop(self) -> None:
        """Make ``run`` return at its next step (see Mirror.stop for why a flag)."""
        self._stopping = True
        self._changed.set()

    @property
    def is_leader(self) -> bool:
        return self._leading is not None and not self._leading.done() and self.lease.valid

    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch_lease())
        try:
            while not self._stopping:
                await self._attempt()
                if not self._stopping:
                    await self._pause()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _attempt(self) -> None:
        self.attempts += 1
        self._attempted_at = time.monotonic()
        reason = self._unfit()
        if reason != self.unfit_reason:
            if reason is None:
                log.info("fit_to_lead")
            else:
                log.warning("unfit_to_lead", reason=reason)
            self.unfit_reason = reason
        if reason is not None:
            # An out-of-sync mirror, or a clock not known well enough, must never lead:
            # hand over rather than fire from it.
            if self._leading is not None:
                await self._stop_leading(reason)
                if await self.dispatcher.settle(2.0):
                    with contextlib.suppress(PyMongoError, TimeoutError):
                        await asyncio.wait_for(self.lease.release(None), 2.0)
            return
        leading = self.is_leader
        timings = self.lease.timings
        # A lease taken later than the renew deadline after asking is of no use (it is
        # already past its validity), so that bounds an acquisition too.
        limit = self.lease.remaining() if leading else timings.renew_deadline
        sent = time.monotonic()
        try:
            view = await asyncio.wait_for(
                self.lease.acquire_or_renew(self.dispatcher.fired_through if leading else None),
                max(limit, 0.05),
            )
            self.metrics.renew_seconds.observe(time.monotonic() - sent)
        except (PyMongoError, TimeoutError) as exc:
            self.metrics.renew_failures.inc()
            if not leading:
                # Said once a streak: a standby that cannot reach the lease cannot take over.
                if not self._failing:
                    log.warning(
                        "acquire_failed",
                        error=repr(exc)[:300],
                        took_s=round(time.monotonic() - sent, 3),
                    )
                self._failing = True
            elif not self.lease.valid:
                await self._stop_leading(f"renewal failed past the deadline: {exc!r}")
            else:
                log.warning(
                    "renewal_failed",
                    error=repr(exc),
                    term=self.lease.term,
                    remaining_s=round(self.lease.remaining(), 3),
                )
            return
        self._failing = False
        if view is not None:
            self.view = view
            logs.set_term(view.term)
            if not leading:
                self._start_leading(view)
        elif leading or self._leading is not None:
            await self._stop_leading("the lease is held by another replica")
        else:
            with contextlib.suppress(PyMongoError):
                self.view = await self.lease.read()
                if self.view is not None:
                    logs.set_term(self.view.term)

    def _start_leading(self, view: LeaseView) -> None:
        log.info("became_leader", term=view.term)
        self._leading = asyncio.create_task(self._lead(view))

    async def _lead(self, view: LeaseView) -> None:
        try:
            await self.dispatcher.lead(view)
        except* LeadershipLost:
            log.warning("stopped_firing", term=view.term, reason="renew deadline passed")
        except* PyMongoError as group:
            log.warning("stopped_firing", term=view.term, reason=repr(group.exceptions[0]))
        self.lease.step_down()
        self._changed.set()

    async def _stop_leading(self, reason: str) -> None:
        self.lease.step_down()
        task, self._leading = self._leading, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=2.0)
            log.warning("lost_leadership", reason=reason)

    async def _pause(self) -> None:
        """Until the next attempt: when leading, a renew interval after the last renewal
        was sent; when standing by, until the lease changes, expires (plus a little), or
        the poll interval passes."""
        timings = self.lease.timings
        wait = timings.renew_interval
        if self._leading is not None and self._leading.done():
            await self._stop_leading("the dispatcher stopped")
            wait = 0.0
        elif self.is_leader:
            # Counted from the send, not the answer: counted from the answer, a renewal must
            # come back within deadline - interval - the previous round trip, and on a slow
            # link one that needs a new connection costs the lease (test_lease.py).
            wait = max(0.0, wait - (time.monotonic() - self._attempted_at))
        elif self.view is not None:
            left = (self.view.expires_at - self._clock()).total_seconds()
            wait = min(wait, max(0.0, left) + random.uniform(0, TAKEOVER_SPREAD_S))
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), wait)

    async def _watch_lease(self) -> None:
        """Wake the elector on every change to the lease document (a release above all)."""
        pipeline = [{"$match": {"documentKey._id": self.lease.name}}]
        while not self._stopping:
            try:
                stream = await open_change_stream(
                    self._leases, pipeline, full_document="updateLookup", max_await_time_ms=500
                )
                async with stream:
                    while not self._stopping:
                        event = await stream.try_next()
                        if event is not None:
                            doc = event.get("fullDocument")
                            if doc is not None:
                                self.view = LeaseView.from_document(doc)
                            self._changed.set()
            except PyMongoError as exc:
                log.debug("lease_watch_failed", error=repr(exc))
                await asyncio.sleep(0.5)

    async def shutdown(self) -> None:
        """Graceful handover: stop claiming, drain publishes, release the lease."""
        task, self._leading = self._leading, None
        if task is None:
            return
        watermark = self.dispatcher.fired_through
        self.dispatcher.hand_over()  # its publishes drain, ended lead or not
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
        if not await self.dispatcher.drain():
            # Released now, a write of the term still unanswered could land where the next
            # leader acts; lapsing, the lease leaves the margin for it.
            log.warning("release_skipped", reason="a write of the term is unanswered")
            return
        try:
            released = await asyncio.wait_for(self.lease.release(watermark), 2.0)
            log.info("released_lease", released=released)
        except (PyMongoError, TimeoutError) as exc:
            log.warning("release_failed", error=repr(exc))
