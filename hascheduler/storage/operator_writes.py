"""An operator's writes to the runs ledger (storage/runs.py): cancel a run, and replay a
dead one through the broker. A room of ``RunLedger``."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any, Protocol

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from hascheduler.core.errors import BrokerRefused, RunConflict, RunNotFound
from hascheduler.core.events import FireMessage
from hascheduler.core.run_states import CANCELLED, DEAD, PENDING, RETRYING, RUNNING, WAITING
from hascheduler.storage.audit_log import recording, with_record
from hascheduler.storage.run_reads import RunReads
from hascheduler.storage.run_records import PARKED_FIELDS, Document, FireRef, new_run

REPLAY_PUBLISH_TIMEOUT_S = 10.0


class Publishes(Protocol):
    """The broker, as an operator's replay publishes through it (brokers.base.Broker)."""

    async def publish(
        self, messages: Sequence[FireMessage], timeout_s: float
    ) -> list[BaseException | None]: ...


def _stored_event(raw: Any) -> dict[str, Any] | None:
    """The CloudEvent a dead run kept, or None when it kept none that reads as one."""
    try:
        event = json.loads(raw) if isinstance(raw, bytes) else None
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(event, dict) or not isinstance(event.get("data"), dict):
        return None
    return event


class OperatorWrites(RunReads):
    async def cancel(
        self,
        fire_id: str,
        now: dt.datetime,
        by: str,
        fire: FireRef | None = None,
        record: Document | None = None,
    ) -> tuple[Document, bool]:
        """Cancel a run: a pending, retrying or waiting one (or, given ``fire``, one no worker has
        claimed yet) ends ``cancelled`` at once; a running one is marked for its worker to
        stop. Returns the run and whether it ended now.

        Raises RunNotFound (no run, and no ``fire``) or RunConflict (it had already ended).
        ``record``: the audit trail's, written with whichever write cancels it.
        """

        def audited(update: Document) -> Document:
            return update if record is None else recording(update, record)

        ended = {"state": CANCELLED, "finished_at": now, "recorded_at": now, "cancelled_by": by}
        doc: Document | None = await self.runs.find_one_and_update(
            {"_id": fire_id, "state": {"$in": [PENDING, RETRYING, WAITING]}},
            audited(
                {
                    "$set": {**ended, "last_error": f"cancelled by {by}"},
                    "$unset": {"next_attempt_at": "", "open_key": "", **PARKED_FIELDS},
                }
            ),
            return_document=ReturnDocument.AFTER,
        )
        if doc is not None:
            return doc, True
        doc = await self.runs.find_one_and_update(
            {"_id": fire_id, "state": RUNNING},
            audited({"$set": {"cancel_requested": True, "cancelled_by": by, "recorded_at": now}}),
            return_document=ReturnDocument.AFTER,
        )
        if doc is not None:
            return doc, False
        current = await self.get(fire_id)
        if current is not None:
            raise RunConflict(f"run {fire_id!r} has already ended ({current['state']})")
        if fire is None:
            raise RunNotFound(fire_id)
        try:  # published, never claimed: the worker that receives it finds it cancelled
            doc = {
                **new_run(fire, ended, now),
                "attempts": 0,
                "first_started_at": None,
                "last_error": f"cancelled by {by}",
            }
            await self.runs.insert_one(doc if record is None else with_record(doc, record))
            return doc, True
        except DuplicateKeyError:  # claimed meanwhile: cancel that
            return await self.cancel(fire_id, now, by, record=record)

    async def replay(
        self, fire_id: str, now: dt.datetime, key: str | None = None, record: Document | None = None
    ) -> Document | None:
        """Move a dead run back to ``retrying`` with a fresh attempt budget; the run as it
        is now, or None when it is not dead (or not there). With the ``key`` of a
        schedule's overlap policy (open_key), the replayed run is open under it, and
        RunConflict is raised while another run of the key is open."""
        update: Document = {
            "state": RETRYING,
            "attempts": 0,
            "next_attempt_at": now,
            "recorded_at": now,
        }
        if key is not None:
            update["open_key"] = key
        change: Document = {"$set": update, "$inc": {"replays": 1}}
        try:
            doc: Document | None = await self.runs.find_one_and_update(
                {"_id": fire_id, "state": DEAD},
                change if record is None else recording(change, record),
                return_document=ReturnDocument.AFTER,
            )
        except DuplicateKeyError:
            assert key is not None  # only open_key is unique besides _id
            holder = (await self.open_runs([key])).get(key, "")
            raise RunConflict(
                f"run {fire_id!r} is held back by its schedule's overlap "
                f"policy: the run of fire {holder!r} is open; replay it once "
                "that run has ended"
            ) from None
        return doc

    async def replay_dead(
        self,
        fire_id: str,
        now: dt.datetime,
        broker: Publishes,
        key: str | None = None,
        record: Document | None = None,
    ) -> Document:
        """Replay a dead run: back to ``retrying`` with a fresh attempt budget, and its fire
        published again under a new broker message id (the original one is still inside
        the broker's duplicate window, and would be dropped). If the message cannot be
        sent, the run is dead again, saying why. Returns the run as replayed.

        Raises RunNotFound, RunConflict (not dead, it kept no event to replay, or its
        overlap ``key`` has another run open) or BrokerRefused.
        """
        doc = await self.replay(fire_id, now, key, record)
        if doc is None:
            current = await self.get(fire_id)
            if current is None:
                raise RunNotFound(fire_id)
            raise RunConflict(
                f"run {fire_id!r} is {current['state']}; only a {DEAD} run can be retried"
            )
        replays = int(doc["replays"])
        event = _stored_event(doc.get("event"))
        if event is None:  # written by something other than a worker
            await self.unreplay(fire_id, replays, "no event kept to replay", now)
            raise RunConflict(f"run {fire_id!r} keeps no event to replay")
        event["data"] = {**event["data"], "replay": replays}
        message = FireMessage(
            fire_id=f"{fire_id}#replay-{replays}",
            target=doc["target"],
            term=int(event["data"].get("term", 0)),
            body=json.dumps(event, separators=(",", ":")).encode(),
        )
        [error] = await broker.publish([message], REPLAY_PUBLISH_TIMEOUT_S)
        if error is not None:
            await self.unreplay(fire_id, replays, f"replay not published: {error!r}", now)
            raise BrokerRefused(f"the broker did not take the replay of {fire_id!r}: {error}")
        return doc

    async def unreplay(self, fire_id: str, replays: int, error: str, now: dt.datetime) -> None:
        """Undo ``replay`` whose message could not be sent: dead again, saying why."""
        await self.runs.update_one(
            {"_id": fire_id, "state": RETRYING, "attempts": 0, "replays": replays},
            {
                "$set": {"state": DEAD, "last_error": error, "recorded_at": now},
                "$unset": {"next_attempt_at": "", "open_key": ""},
            },
        )
