"""Webhooks, delivered by the leader (docs/OPERATIONS.md, "Webhooks").

Every replica runs the service (its HTTP client and the attempts in flight); its leader's
half (``WebhookDuty``) is a service of the term, started and stopped with it. Two steps,
apart from firing (a webhook endpoint that is down or slow never delays a fire: nothing
here is awaited by the firing path, and a delivery's attempts run as their own tasks):

- finding, every FIND_EVERY_S: the events since the last look, from where each is already
  recorded: fires the leader marked when it recorded them skipped or failed (the mark is in
  the ledger entry's own write: storage/fires.py ``noticed``), runs recorded dead since a
  cursor, schedules paused since a cursor, and schedules the health round found late or
  past their objective. Each event is made a pending delivery for each webhook that
  receives it, keyed by both (the same event found twice is delivered once) before the
  mark is cleared or the cursor moved: an event found is delivered at least once, across
  leaders too.
- delivering, every DELIVER_EVERY_S: pending deliveries due are POSTed (at most
  MAX_IN_FLIGHT at once, each attempt bounded by ATTEMPT_TIMEOUT_S), signed; a 2xx ends
  one, anything else retries it with backoff (core/webhooks.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
import structlog
from pymongo.errors import PyMongoError

from hascheduler.core.clock import Clock
from hascheduler.core.egress import EgressPolicy, EgressRefused
from hascheduler.core.entries import Entry
from hascheduler.core.fields import DEFAULT_NAMESPACE
from hascheduler.core.health import ScheduleHealth
from hascheduler.core.triggers import iso_utc
from hascheduler.core.webhooks import (
    ATTEMPT_TIMEOUT_S,
    CONTENT_TYPE,
    DELIVERY_HEADER,
    FIRE_FAILED,
    FIRE_SKIPPED,
    RUN_DEAD,
    SCHEDULE_LATE,
    SCHEDULE_PAUSED,
    SIGNATURE_HEADER,
    WEBHOOK_HEADER,
    Event,
    Subscription,
    sign,
)
from hascheduler.process.egress import egress_session
from hascheduler.replica.term import Term
from hascheduler.storage.fire_records import FAILED, SKIPPED
from hascheduler.storage.fires import Ledger
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore
from hascheduler.storage.webhooks import Deliveries, WebhookStore

log = structlog.get_logger("hascheduler.webhooks")

FIND_EVERY_S = 1.0
DELIVER_EVERY_S = 0.2
MAX_IN_FLIGHT = 32
FOUND_AT_ONCE = 500  # events read from one source per look
# What a failed attempt says: never an answer's body, nor which way a connection failed.
REFUSED = "refused by the egress policy (serve --egress-allow)"
NO_ANSWER = "no HTTP answer (no connection, or it closed or timed out)"
# Sources read by time look back this far before their cursor: a record written late
# (a worker's outcome write retried through a failover) is still found; a duplicate is
# dropped by its delivery's key.
LOOK_BACK_S = 60.0


class WebhookService:
    def __init__(
        self,
        store: WebhookStore,
        deliveries: Deliveries,
        ledger: Ledger,
        runs: RunLedger,
        schedules: ScheduleStore,
        entries: Mapping[str, Entry],
        clock: Clock,
        egress: EgressPolicy,
    ) -> None:
        self.store = store
        self.deliveries = deliveries
        self.ledger = ledger
        self.runs = runs
        self.schedules = schedules
        self.entries = entries
        self.clock = clock
        self.egress = egress
        self.leading = False  # while the duty of a term of this replica runs
        self._stopping = asyncio.Event()
        self._judged: list[Event] = []  # from the health round, for the next look
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._hooks: dict[str, dict[str, Any]] = {}
        self._http: aiohttp.ClientSession | None = None

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        """Until stopped: then the attempts in flight are cancelled (tried again once due,
        by whichever replica leads) and the HTTP client closed."""
        try:
            await self._stopping.wait()
        finally:
            for task in self._in_flight.values():
                task.cancel()
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)
            if self._http is not None:
                await self._http.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = egress_session(self.egress, ATTEMPT_TIMEOUT_S, MAX_IN_FLIGHT)
        return self._http

    def stepped_down(self) -> None:
        """The term whose duty ran ended: no more marks, no verdicts kept for it."""
        self.leading = False
        self.ledger.notices.wanted = frozenset()
        self._judged.clear()

    async def guarded(self, what: str, step: Callable[[], Any]) -> None:
        try:
            await step()
        except PyMongoError as exc:
            log.warning(what, error=repr(exc)[:300])
        except Exception as exc:  # a defect here must never end the replica's service
            log.exception(what, error=repr(exc)[:300])

    def judged(self, healths: Sequence[ScheduleHealth]) -> None:
        """The health round's verdicts: a schedule late against its trigger, or past its
        objective, is a ``schedule.late`` event (one per late fire, one per missed
        deadline)."""
        if not self.leading:
            return
        for h in healths:
            if h.late and h.overdue_since is not None:
                self._judged.append(
                    Event(
                        f"{SCHEDULE_LATE}:{h.schedule_id}:{iso_utc(h.overdue_since)}",
                        SCHEDULE_LATE,
                        h.namespace,
                        h.schedule_id,
                        h.checked_at,
                        {"status": "late", "overdue_since": iso_utc(h.overdue_since)},
                    )
                )
            elif h.objective_met is False and h.success_deadline is not None:
                self._judged.append(
                    Event(
                        f"{SCHEDULE_LATE}:{h.schedule_id}:objective:{iso_utc(h.success_deadline)}",
                        SCHEDULE_LATE,
                        h.namespace,
                        h.schedule_id,
                        h.checked_at,
                        {
                            "status": "objective_missed",
                            "success_deadline": iso_utc(h.success_deadline),
                            "success_within_s": h.success_within,
                            "last_success_at": iso_utc(h.last_success_at)
                            if h.last_success_at is not None
                            else None,
                        },
                    )
                )

    # -- finding --------------------------------------------------------------------------

    async def find(self) -> None:
        # Taken first: if this look fails, the next health round (10 s) judges them again.
        judged, self._judged = self._judged, []
        subscriptions, self._hooks = await self.store.subscriptions()
        wanted = {t for s in subscriptions for t in s.events}
        self.ledger.notices.wanted = frozenset(
            state
            for state, kind in ((SKIPPED, FIRE_SKIPPED), (FAILED, FIRE_FAILED))
            if kind in wanted
        )
        now = self.clock()
        entries = await self.ledger.noticed_entries(FOUND_AT_ONCE)
        if entries:
            events = [self._fire_event(d, now) for d in entries]
            await self._record([e for e in events if e.type in wanted], subscriptions, now)
            await self.ledger.clear_notices([d["_id"] for d in entries])
        await self._from_cursor(RUN_DEAD, wanted, subscriptions, now)
        await self._from_cursor(SCHEDULE_PAUSED, wanted, subscriptions, now)
        await self._record([e for e in judged if e.type in wanted], subscriptions, now)

    async def _record(
        self, events: list[Event], subscriptions: list[Subscription], now: dt.datetime
    ) -> None:
        if events:
            made = await self.deliveries.add(events, subscriptions, now)
            if made:
                log.info("webhook_events", events=len(events), deliveries=made)

    def _namespace(self, doc: dict[str, Any]) -> str:
        """The namespace a fire or run was made in (kept with it: its schedule may be gone);
        for one written before it was kept, its schedule's."""
        kept = doc.get("namespace")
        if isinstance(kept, str):
            return kept
        entry = self.entries.get(str(doc["schedule_id"]))
        return entry.namespace if entry is not None else DEFAULT_NAMESPACE

    def _fire_event(self, doc: dict[str, Any], now: dt.datetime) -> Event:
        schedule_id = str(doc["schedule_id"])
        failed = doc.get("state") == FAILED
        data: dict[str, Any] = {"fire_id": doc["_id"], "nominal_at": iso_utc(doc["nominal_at"])}
        if failed:
            data |= {"attempts": doc.get("attempts"), "error": doc.get("last_error")}
        else:
            data["reason"] = doc.get("reason")
            for field in ("open_run", "count", "tenant"):
                if doc.get(field) is not None:
                    data[field] = doc[field]
            if doc.get("last_nominal_at") is not None:
                data["last_nominal_at"] = iso_utc(doc["last_nominal_at"])
        kind = FIRE_FAILED if failed else FIRE_SKIPPED
        return Event(f"{kind}:{doc['_id']}", kind, self._namespace(doc), schedule_id, now, data)

    async def _from_cursor(
        self, kind: str, wanted: set[str], subscriptions: list[Subscription], now: dt.datetime
    ) -> None:
        """Events of a source read by time: from its cursor (first look: now), minus the
        look-back; the cursor moves once their deliveries are recorded."""
        if kind not in wanted:
            return
        cursor = await self.deliveries.cursor(kind, now)
        since = cursor - dt.timedelta(seconds=LOOK_BACK_S)
        if kind == RUN_DEAD:
            docs = await self.runs.dead_since(since, FOUND_AT_ONCE)
            events = [self._dead_event(d) for d in docs]
            times = [d["recorded_at"] for d in docs]
        else:
            docs = await self.schedules.paused_since(since, FOUND_AT_ONCE)
            events = [self._paused_event(d) for d in docs]
            times = [d["pause"]["at"] for d in docs]
        await self._record(events, subscriptions, now)
        # A full page: read on from its last; else everything up to now was seen.
        following = max(times) if len(docs) >= FOUND_AT_ONCE else now
        if following.tzinfo is None:
            following = following.replace(tzinfo=dt.UTC)
        await self.deliveries.advance(kind, max(cursor, following))

    def _dead_event(self, doc: dict[str, Any]) -> Event:
        schedule_id = str(doc["schedule_id"])
        replays = int(doc.get("replays", 0))
        return Event(
            f"{RUN_DEAD}:{doc['_id']}:{replays}",
            RUN_DEAD,
            self._namespace(doc),
            schedule_id,
            doc["recorded_at"],
            {
                "fire_id": doc["_id"],
                "target": doc.get("target"),
                "nominal_at": iso_utc(doc["nominal_at"]),
                "attempts": doc.get("attempts"),
                "error": doc.get("last_error"),
                "worker_id": doc.get("worker_id"),
                "replays": replays,
                **({"tenant": doc["tenant"]} if doc.get("tenant") else {}),
            },
        )

    def _paused_event(self, doc: dict[str, Any]) -> Event:
        pause = doc["pause"]
        at = pause["at"]
        return Event(
            f"{SCHEDULE_PAUSED}:{doc['_id']}:{iso_utc(at)}",
            SCHEDULE_PAUSED,
            str(doc.get("namespace") or DEFAULT_NAMESPACE),
            str(doc["_id"]),
            at,
            {
                "by": pause.get("by"),
                "note": pause.get("note"),
                "until": iso_utc(pause["until"]) if pause.get("until") else None,
            },
        )

    # -- delivering -----------------------------------------------------------------------

    async def deliver(self) -> None:
        room = MAX_IN_FLIGHT - len(self._in_flight)
        if room <= 0:
            return
        for doc in await self.deliveries.due(self.clock(), room, set(self._in_flight)):
            hook = self._hooks.get(doc["webhook_id"])
            if hook is None:  # deleted since (its deliveries go with it) or not read yet
                continue
            self._in_flight[doc["_id"]] = asyncio.create_task(self._attempt(doc, hook))

    def _done(self, key: str) -> None:
        self._in_flight.pop(key, None)

    async def _attempt(self, doc: dict[str, Any], hook: dict[str, Any]) -> None:
        try:
            await self._post(doc, hook)
        finally:  # in flight until its attempt is recorded: never sent twice at once
            self._done(doc["_id"])

    async def _post(self, doc: dict[str, Any], hook: dict[str, Any]) -> None:
        body: bytes = doc["body"]
        timestamp = int(time.time())
        headers = {
            "Content-Type": CONTENT_TYPE,
            DELIVERY_HEADER: doc["_id"],
            WEBHOOK_HEADER: hook["_id"],
            SIGNATURE_HEADER: sign(hook["secret"], timestamp, body),
        }
        status: int | None = None
        error = self.egress.url_refusal(hook["url"]) and REFUSED
        began = time.monotonic()
        try:
            if error is None:
                async with self._client().post(
                    hook["url"], data=body, headers=headers, allow_redirects=False
                ) as answer:
                    status = answer.status
                    # Its status, never its body: a reader of the namespace sees the error.
                    error = None if 200 <= status < 300 else f"answered {status}"
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as exc:
            # One error for every failure to get an answer: an open port and a closed one
            # look alike to whoever reads the deliveries.
            error = REFUSED if _refused(exc) else NO_ANSWER
        duration = time.monotonic() - began
        try:
            state = await self.deliveries.attempted(doc, self.clock(), status, error, duration)
        except PyMongoError as exc:  # tried again once due: at least once
            log.warning("webhook_attempt_unrecorded", delivery=doc["_id"], error=repr(exc)[:300])
            return
        if error is not None:
            log.info(
                "webhook_attempt_failed",
                delivery=doc["_id"],
                webhook=hook["_id"],
                attempt=int(doc["attempts"]) + 1,
                error=error,
                state=state,
            )


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is the egress policy's refusal."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, EgressRefused) or isinstance(
            getattr(seen, "os_error", None), EgressRefused
        ):
            return True
        seen = seen.__cause__
    return False


class WebhookDuty:
    """The leader's half of webhooks, a service of its term: every FIND_EVERY_S the events
    since the last look become deliveries, every DELIVER_EVERY_S the deliveries due are
    sent, while the term holds."""

    def __init__(self, webhooks: WebhookService) -> None:
        self.webhooks = webhooks

    async def run(self, term: Term) -> None:
        webhooks = self.webhooks
        webhooks.leading = True
        try:
            last_find = 0.0
            while True:
                term.check()
                if time.monotonic() - last_find >= FIND_EVERY_S:
                    last_find = time.monotonic()
                    await webhooks.guarded("webhook_find_failed", webhooks.find)
                await webhooks.guarded("webhook_delivery_failed", webhooks.deliver)
                await asyncio.sleep(DELIVER_EVERY_S)
        finally:
            webhooks.stepped_down()
