"""A worker's side of concurrency and rate limits (docs/WORKERS.md, "Flow control").

A fetched run whose handler or schedule declares a concurrency key takes a slot of that
key (storage/flow.py) before its claim, and one with a rate key a start from its budget.
One that finds no slot free, or no start left, is *parked*: its run is recorded
``waiting`` with its event and the broker's message acknowledged, so it holds no worker
slot, no broker delivery and no timer. A parked run is woken by taking what it waits for
on its behalf and publishing its event again (message id ``<fire id>#wake-<n>``), which
any worker then claims: for a concurrency key, by whoever frees a slot of it; for a rate
key, by any worker's rate waker at the instant the key's next start is due. The run woken
is the key's highest priority, then longest waiting. A slot whose holder's lease lapsed
(its worker died) is freed and handed on by any worker's sweep. Parking, not a delayed
redelivery: a redelivery's backoff is either a spin or a wait past the moment the slot
frees, it cannot honour priorities, and a key with 10,000 runs would hold the broker's
deliveries while keys with one run wait behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog
from pymongo.errors import PyMongoError

from hascheduler.core.clock import Clock
from hascheduler.core.events import FireMessage
from hascheduler.core.flow import MissingKeyField, Paced, Wanted, paced, wanted
from hascheduler.core.run_states import PARKED
from hascheduler.storage.flow import RateStore, SlotStore
from hascheduler.storage.run_records import CONCURRENCY, RATE, FireRef
from hascheduler.storage.runs import RunLedger
from hascheduler.worker.app import Route
from hascheduler.worker.delivery import Delivery

log = structlog.get_logger()

LAPSED_SWEEP_S = 1.0  # how often a worker looks for slots whose holder's lease lapsed
RATE_LOOK_S = 1.0  # the longest a rate waker sleeps before looking again
MAX_WAKES = 64  # runs one release may wake (a raised limit frees several slots at once)
WAKE_PUBLISH_TIMEOUT_S = 5.0


class WakePublisher(Protocol):
    async def start(self) -> None: ...
    async def publish(
        self, messages: Sequence[FireMessage], timeout_s: float
    ) -> list[BaseException | None]: ...
    async def close(self) -> None: ...


def run_fields(delivery: Delivery) -> dict[str, Any]:
    fire = delivery.fire
    return {
        "target": fire.target,
        "schedule_id": fire.schedule_id,
        "tenant": delivery.tenant,
        "payload": delivery.payload,
    }


def slot_wanted(delivery: Delivery, route: Route) -> Wanted | str | None:
    """The slot a run needs (its schedule's limit, else its handler's), None for none, or
    why its key cannot be rendered (the run then ends dead: the error says which field)."""
    limit = delivery.concurrency or route.concurrency
    if limit is None:
        return None
    try:
        return wanted(limit, run_fields(delivery))
    except MissingKeyField as exc:
        return f"concurrency key {limit.template.text!r}: {exc}"


def start_paced(delivery: Delivery, route: Route) -> Paced | str | None:
    """The rate budget a run starts from (its schedule's, else its handler's), None for
    none (or granted already by its waker), or why its key cannot be rendered."""
    limit = delivery.rate or route.rate
    if limit is None or delivery.rate_granted:
        return None
    try:
        return paced(limit, run_fields(delivery))
    except MissingKeyField as exc:
        return f"rate key {limit.template.text!r}: {exc}"


def woken_event(stored: bytes, rate_granted: bool = False) -> bytes:
    """A parked run's event, marked woken (never judged stale: delivery.StaleFilter), and
    whether its waker took its start from the rate budget."""
    event = json.loads(stored)
    event["data"]["woken"] = True
    event["data"].pop("rate_granted", None)
    if rate_granted:
        event["data"]["rate_granted"] = True
    return json.dumps(event, separators=(",", ":")).encode()


class FlowGate:
    def __init__(
        self,
        slots: SlotStore,
        rates: RateStore,
        runs: RunLedger,
        publisher: Callable[[], WakePublisher],
        lease_s: float,
        clock: Clock,
    ) -> None:
        self.slots = slots
        self.rates = rates
        self.runs = runs
        self.rate_parked = asyncio.Event()  # this worker parked a run on a rate key
        self._make_publisher = publisher
        self._publisher: WakePublisher | None = None
        self.lease_s = lease_s
        self.clock = clock

    async def close(self) -> None:
        if self._publisher is not None:
            with contextlib.suppress(Exception):
                await self._publisher.close()

    async def take(self, wants: dict[str, Wanted]) -> set[str]:
        return await self.slots.take(list(wants.items()), self.clock(), self.lease_s)

    async def park(
        self, parking: list[tuple[FireRef, Wanted | Paced, int]]
    ) -> dict[str, tuple[str, bool]]:
        """Park the runs (each with what it waits for, and its priority); by fire id,
        the claim's outcome and whether what it waits for was taken for it after all. A
        slot freed between the failed take and the park found nobody to wake: the take
        after the park (and the key marked contended) sees it."""
        claims = await self.runs.park(parking, self.clock())
        parked = [(f, on) for f, on, _ in parking if claims[f.fire_id].outcome == PARKED]
        for key in {on.key for _, on in parked if isinstance(on, Paced)}:
            await self.rates.contend(key)
            self.rate_parked.set()  # the rate waker starts them at their key's next start
        slots = {f.fire_id: on for f, on in parked if isinstance(on, Wanted)}
        for key in {on.key for on in slots.values()}:
            await self.slots.contend(key)
        got = (
            await self.slots.take(list(slots.items()), self.clock(), self.lease_s)
            if slots
            else set()
        )
        return {fire_id: (claim.outcome, fire_id in got) for fire_id, claim in claims.items()}

    async def pace(self, paced: Paced, now: dt.datetime) -> bool:
        """Start a run of the key now if its budget allows."""
        return await self.rates.take(paced, now) == 0.0

    async def renew(self, held: dict[str, Wanted]) -> None:
        await self.slots.renew(
            {f: w.key for f, w in held.items()}, self.clock() + dt.timedelta(seconds=self.lease_s)
        )

    async def release(self, freed: dict[str, Wanted]) -> None:
        """Free the slots of these runs (ended, given back, or never claimed) and wake
        the runs parked on their keys, under the limit the key's latest take declared
        (so a raised limit wakes as many more)."""
        if not freed:
            return
        contended = await self.slots.release({f: w.key for f, w in freed.items()}, self.clock())
        for key, limit in contended.items():
            await self.wake(key, limit)

    async def wake(self, key: str, limit: int | None = None) -> int:
        """Wake up to MAX_WAKES runs parked on ``key``, one per slot free under ``limit``
        (else under the limit each waiting run declared); how many."""
        woken = 0
        while woken < MAX_WAKES:
            now = self.clock()
            doc = await self.runs.next_waiting(CONCURRENCY, key, now, self.lease_s)
            if doc is None:
                # Nobody left: releases stop looking, unless a run parked meanwhile.
                await self.slots.uncontend(key)
                if await self.runs.still_waiting(CONCURRENCY, key):
                    await self.slots.contend(key)
                    continue
                break
            want = Wanted(
                key, limit or int(doc.get("wait_limit") or 1), str(doc.get("wait_template") or "")
            )
            if doc["_id"] not in await self.slots.take([(doc["_id"], want)], now, self.lease_s):
                await self.runs.unwake(doc["_id"])
                break
            if not await self._send(doc):
                break  # its slot lapses and the sweep wakes it again
            woken += 1
        return woken

    async def wake_paced(self) -> float:
        """Start the next parked run of the rate key due soonest, if it is due; the
        seconds until one might be (at most RATE_LOOK_S)."""
        due = await self.rates.next_due()
        now = self.clock()
        if due is None:
            return RATE_LOOK_S
        key, tat = due
        if tat > now:
            return min(RATE_LOOK_S, (tat - now).total_seconds())
        doc = await self.runs.next_waiting(RATE, key, now, self.lease_s)
        if doc is None:
            await self.rates.uncontend(key)
            if await self.runs.still_waiting(RATE, key):
                await self.rates.contend(key)
            return 0.0
        wait = await self.rates.take(
            Paced(
                key, float(doc.get("wait_interval_s") or 1.0), str(doc.get("wait_template") or "")
            ),
            now,
        )
        if wait:  # another worker's waker started one first
            await self.runs.unwake(doc["_id"])
            return min(RATE_LOOK_S, wait)
        await self._send(doc, rate_granted=True)
        return 0.0

    async def _send(self, doc: dict[str, Any], rate_granted: bool = False) -> bool:
        try:
            body = woken_event(doc["event"], rate_granted)
            if self._publisher is None:
                publisher = self._make_publisher()
                await publisher.start()
                self._publisher = publisher
            term = int(json.loads(body)["data"].get("term", 0))
            [error] = await self._publisher.publish(
                [
                    FireMessage(
                        f"{doc['_id']}#wake-{uuid.uuid4().hex[:8]}", doc["target"], term, body
                    )
                ],
                WAKE_PUBLISH_TIMEOUT_S,
            )
        except (KeyError, TypeError, ValueError) as exc:
            error = exc
        if error is not None:
            log.warning("run_wake_failed", fire_id=doc["_id"], error=repr(error)[:300])
            return False
        log.info("run_woken", fire_id=doc["_id"])
        return True

    async def sweep(self) -> None:
        """Hand on the slots whose holder's lease lapsed, of keys with parked runs."""
        for key, name, lease in await self.slots.lapsed(self.clock()):
            if await self.slots.free_lapsed(key, name, lease):
                log.warning("slot_lapsed", key=key, holder=name)
                await self.wake(key)


class RateWaker:
    """Starts parked rate-limited runs as their keys' budgets allow: sleeps until the
    next is due (or a run is parked here), starts it, again (a lifecycle service)."""

    def __init__(self, flow: FlowGate) -> None:
        self.flow = flow
        self._stopping = False

    async def run(self) -> None:
        while not self._stopping:
            try:
                wait = await self.flow.wake_paced()
            except PyMongoError as exc:
                log.warning("rate_wake_failed", error=repr(exc)[:300])
                wait = RATE_LOOK_S
            if wait > 0:
                self.flow.rate_parked.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.flow.rate_parked.wait(), wait)

    def stop(self) -> None:
        self._stopping = True
        self.flow.rate_parked.set()
