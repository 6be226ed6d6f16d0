"""The API's read models: how ledger documents are shown (a fire, a fan-out fire's counts)
and the dashboard's one read (``read_dashboard``). Shaping is pure (``schedule_row``,
``fire_rows``), so what the dashboard shows is tested without a server; the reads are
the ledgers' own queries, handed in."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hascheduler.api.run_view import public_view
from hascheduler.core import fields, models, timeline
from hascheduler.core.instants import as_utc
from hascheduler.core.run_states import DEAD, STATES
from hascheduler.core.triggers import fire_id
from hascheduler.storage.audit_log import OUTBOX, PENDING
from hascheduler.storage.fire_records import STATES as FIRE_STATES
from hascheduler.storage.fires import Ledger
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore

DASHBOARD_SCHEDULES = 200
DASHBOARD_FIRES = 50
DASHBOARD_FIRES_WINDOW_S = 900
DASHBOARD_DEAD_RUNS = 20


def shown_time(value: Any) -> Any:
    """An instant as the API shows it (ISO 8601, UTC); anything else as it is."""
    value = as_utc(value)
    return value.isoformat() if isinstance(value, dt.datetime) else value


def fire_view(doc: dict[str, Any]) -> dict[str, Any]:
    """A fire ledger entry as the API shows it (its audit record is the trail's)."""
    return {k: shown_time(v) for k, v in doc.items() if k not in _NOT_SHOWN} | {"id": doc["_id"]}


_NOT_SHOWN = frozenset({"_id", OUTBOX, PENDING})


async def fire_groups(
    ledger: Ledger,
    runs: RunLedger,
    schedule_id: str,
    nominals: list[dt.datetime],
    namespace: str | None = None,
) -> list[dict[str, Any]]:
    """Each fire of a schedule at ``nominals`` as counts: its ledger entries by state (a
    fan-out fire has one per tenant) and its runs by state (of ``namespace``, if given)."""
    fires = await ledger.counts(schedule_id, nominals, namespace)
    run_counts = await runs.counts(schedule_id, nominals, namespace)

    def tally(counts: dict[str, int], states: tuple[str, ...]) -> dict[str, int]:
        return {**{state: counts.get(state, 0) for state in states}, "total": sum(counts.values())}

    return [
        {
            "fire": fire_id(schedule_id, nominal),
            "schedule_id": schedule_id,
            "nominal_at": nominal.isoformat(),
            "fires": tally(fires.get(nominal, {}), FIRE_STATES),
            "runs": tally(run_counts.get(nominal, {}), STATES),
        }
        for nominal in map(as_utc, nominals)
    ]


async def fan_out_fire(ledger: Ledger, runs: RunLedger, fire: str) -> dict[str, Any] | None:
    """A fan-out fire (``<schedule id>@<nominal>``, or ``@manual-<instant>`` for one run
    now) as counts of its tenants' entries and runs; None if the ledger has none."""
    schedule_id, _, when = fire.rpartition("@")
    try:
        nominal = fields.parse_instant(when.removeprefix("manual-"))
    except ValueError:
        return None
    if not schedule_id:
        return None
    [group] = await fire_groups(ledger, runs, schedule_id, [nominal])
    if group["fires"]["total"] == 0:
        return None
    return {
        "id": fire,
        "schedule_id": schedule_id,
        "nominal_at": group["nominal_at"],
        "fan_out": {"fires": group["fires"], "runs": group["runs"]},
    }


def schedule_row(schedule: models.Schedule, now: dt.datetime) -> dict[str, Any]:
    """A schedule as a dashboard row, with its next fire time after ``now``."""
    upcoming = models.preview(schedule, now, 1).times
    return {
        "id": schedule.id,
        "namespace": schedule.namespace,
        "name": schedule.name,
        "target": schedule.target,
        "fan_out": schedule.fan_out.model_dump() if schedule.fan_out else None,
        "trigger": schedule.trigger.model_dump(mode="json"),
        "paused": schedule.paused,
        "pause": schedule.pause.model_dump(mode="json") if schedule.pause else None,
        "overlap": schedule.overlap,
        "completed": schedule.completed,
        "revision": schedule.revision,
        "next_fire_at": upcoming[0].fire_at.isoformat() if upcoming else None,
    }


def kept_in(doc: dict[str, Any], namespaces: set[str], schedule_ids: set[str]) -> bool:
    """Whether a fire or run is one of ``namespaces``': by the namespace kept with it, or,
    written before one was, by its schedule's (one of ``schedule_ids``)."""
    kept = doc.get("namespace")
    return kept in namespaces if isinstance(kept, str) else doc["schedule_id"] in schedule_ids


def fan_out_fires(recent: Sequence[dict[str, Any]]) -> dict[str, list[dt.datetime]]:
    """The fan-out fires among ledger entries (one entry per tenant): each schedule's
    nominal times, once each, in the order first seen."""
    fanned: dict[str, list[dt.datetime]] = {}
    for doc in recent:
        if "tenant" in doc and doc["nominal_at"] not in fanned.get(doc["schedule_id"], []):
            fanned.setdefault(doc["schedule_id"], []).append(doc["nominal_at"])
    return fanned


def fire_rows(
    recent: Sequence[dict[str, Any]],
    runs: dict[str, dict[str, Any]],
    groups: Sequence[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The dashboard's fires: each plain fire with its lateness and its run, each fan-out
    fire as one row of counts (``groups``); latest nominal time first."""
    rows = []
    for doc in recent:
        if "tenant" in doc:
            continue  # counted in its fan-out fire's row
        row = fire_view(doc)
        published, due = doc.get("published_at"), doc.get("due_at")
        row["lateness_s"] = (
            (as_utc(published) - as_utc(due)).total_seconds()
            if isinstance(published, dt.datetime) and isinstance(due, dt.datetime)
            else None
        )
        run = runs.get(row["id"])
        row["run"] = (
            None
            if run is None
            else {k: run.get(k) for k in ("state", "attempts", "duration_s", "worker_id")}
        )
        rows.append(row)
    rows += [
        {
            "id": g["fire"],
            "schedule_id": g["schedule_id"],
            "nominal_at": g["nominal_at"],
            "fan_out": {"fires": g["fires"], "runs": g["runs"]},
        }
        for g in groups
    ]
    rows.sort(key=lambda f: (f["nominal_at"], f["id"]), reverse=True)
    return rows


@dataclass(frozen=True, slots=True)
class Dashboard:
    """What /ui shows besides the cluster's members and leader."""

    schedules: list[dict[str, Any]]
    more_schedules: bool
    fires: list[dict[str, Any]]
    dead_runs: list[dict[str, Any]]
    more_dead_runs: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "schedules": self.schedules,
            "more_schedules": self.more_schedules,
            "fires": self.fires,
            "fires_window_s": DASHBOARD_FIRES_WINDOW_S,
            "dead_runs": self.dead_runs,
            "more_dead_runs": self.more_dead_runs,
        }


async def read_dashboard(
    store: ScheduleStore,
    ledger: Ledger,
    runs: RunLedger,
    now: dt.datetime,
    namespaces: list[str] | None = None,
) -> Dashboard:
    """The schedules with their next fire time, the latest fires recorded in the last
    DASHBOARD_FIRES_WINDOW_S each with its run, and the latest dead runs; of the schedules
    in ``namespaces`` only, when given."""
    page, after = await store.list(
        labels={}, paused=None, after=None, limit=DASHBOARD_SCHEDULES, namespaces=namespaces
    )
    recent = await ledger.recent(
        now - dt.timedelta(seconds=DASHBOARD_FIRES_WINDOW_S), DASHBOARD_FIRES
    )
    ids = None if namespaces is None else await store.ids_in(namespaces)
    if ids is not None and namespaces is not None:
        shown, readable = set(ids), set(namespaces)
        recent = [doc for doc in recent if kept_in(doc, readable, shown)]
    groups = [
        group
        for schedule_id, nominals in fan_out_fires(recent).items()
        for group in await fire_groups(ledger, runs, schedule_id, nominals)
    ]
    plain = [str(doc["_id"]) for doc in recent if "tenant" not in doc]
    fire_runs = await runs.for_fires(plain) if plain else {}
    dead, more_dead = await runs.page(DEAD, None, DASHBOARD_DEAD_RUNS, ids, namespaces)
    return Dashboard(
        [schedule_row(s, now) for s in page],
        after is not None,
        fire_rows(recent, fire_runs, groups),
        [public_view(d) for d in dead],
        more_dead is not None,
    )


TIMELINE_SCHEDULES = 20
TIMELINE_MARKS = 600  # ledger entries per schedule (a fan-out's tenants count each)
TIMELINE_BUCKETS = 60
TIMELINE_IN_FLIGHT = 20
TIMELINE_MAX_HOURS = 24.0


async def read_timeline(
    store: ScheduleStore,
    ledger: Ledger,
    runs: RunLedger,
    now: dt.datetime,
    hours: float,
    namespaces: list[str] | None,
    schedule_id: str | None = None,
) -> dict[str, Any]:
    """Each schedule's fires over the last ``hours`` as marks (core/timeline.py), the
    lateness of their published fires over the window, and the runs in flight: of one
    schedule, or of the first TIMELINE_SCHEDULES (by id) in ``namespaces``."""
    since = now - dt.timedelta(hours=hours)
    if schedule_id is not None:
        schedules = [await store.get(schedule_id)]
    else:
        schedules, _ = await store.list(
            labels={}, paused=None, after=None, limit=TIMELINE_SCHEDULES, namespaces=namespaces
        )
    entries = {
        s.id: await ledger.window(s.id, since, TIMELINE_MARKS, s.namespace) for s in schedules
    }
    fire_runs = await runs.for_fires([d["_id"] for docs in entries.values() for d in docs])
    samples: list[tuple[dt.datetime, float]] = []
    rows = []
    for schedule in schedules:
        by_nominal: dict[dt.datetime, list[tuple[str, dict[str, Any], float | None]]] = {}
        for doc in entries[schedule.id]:
            due, published = as_utc(doc.get("due_at")), as_utc(doc.get("published_at"))
            late = (published - due).total_seconds() if published and due else None
            if late is not None:
                samples.append((due, late))
            run = fire_runs.get(doc["_id"])
            kind = timeline.kind_of(doc["state"], late, run.get("state") if run else None)
            by_nominal.setdefault(as_utc(doc["nominal_at"]), []).append((kind, doc, late))
        marks = []
        for nominal, found in sorted(by_nominal.items()):
            kind = timeline.worst(k for k, _, _ in found)
            first = found[0][1]
            lates = [late for _, _, late in found if late is not None]
            marks.append(
                {
                    "at": nominal.isoformat(),
                    "kind": kind,
                    "fire_id": first["_id"] if len(found) == 1 else fire_id(schedule.id, nominal),
                    "tenants": len(found) if "tenant" in first else None,
                    "lateness_s": round(max(lates), 4) if lates else None,
                    "manual": bool(first.get("manual")),
                    "reason": first.get("reason"),
                }
            )
        rows.append(
            {
                "id": schedule.id,
                "namespace": schedule.namespace,
                "name": schedule.name,
                "paused": schedule.paused,
                "marks": marks,
                "truncated": len(entries[schedule.id]) >= TIMELINE_MARKS,
            }
        )
    ids = (
        [s.id for s in schedules]
        if schedule_id is not None
        else (None if namespaces is None else await store.ids_in(namespaces))
    )
    in_flight, more = await runs.page("running", None, TIMELINE_IN_FLIGHT, ids)
    waiting, more_waiting = await runs.page("waiting", None, TIMELINE_IN_FLIGHT, ids)
    return {
        "since": since.isoformat(),
        "until": now.isoformat(),
        "hours": hours,
        "late_mark_s": timeline.LATE_MARK_S,
        "schedules": rows,
        "lateness": [
            {
                "start": b.start.isoformat(),
                "count": b.count,
                "p50_s": b.p50_s,
                "p99_s": b.p99_s,
                "max_s": b.max_s,
            }
            for b in timeline.lateness_buckets(samples, since, now, TIMELINE_BUCKETS)
        ],
        "in_flight": [public_view(d) for d in in_flight],
        "more_in_flight": more is not None,
        "waiting": [public_view(d) for d in waiting],
        "more_waiting": more_waiting is not None,
    }
