"""The chaos soak's auditor: what was due, by plain arithmetic on the schedules the soak
created, against what the broker stream holds.

It shares no code with the scheduler (no trigger library, no mirror, no ledger), so a bug
in the scheduler's own idea of "due" cannot hide itself here. The schedule kinds the soak
uses are the ones whose fire times are simple to compute by hand: a seconds step within
the minute (6-field cron in UTC), a fixed interval from an anchor, and one-off instants;
a fan-out schedule's fires are audited per tenant, each as a schedule of its own. A pause
until an instant makes the instants it covers optional (the pause takes effect when the
leader learns of it) and every one from its end on due again; a schedule whose overlap
policy may hold a fire back has each instant either in the stream once or recorded skipped
in the ledger, never both and never neither; a backfill's instants are each in the stream
once, and its record says so.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

UTC = dt.UTC
Key = tuple[str, dt.datetime]  # (schedule id, nominal time)
Window = tuple[dt.datetime, dt.datetime]
TENANTS = "soak_tenants"  # the collection the fan-out schedules select from


@dataclass(frozen=True)
class SoakSchedule:
    id: str
    kind: Literal["second_step", "interval", "at"]
    step_s: int = 1  # second_step: the seconds of each minute divisible by step_s
    every_s: int = 0  # interval: anchor + k * every_s, k >= 0
    anchor: dt.datetime | None = None
    instants: tuple[dt.datetime, ...] = ()
    jitter_s: float = 0.0
    tenants: tuple[str, ...] = ()  # fans out over these documents of TENANTS
    # Its stored creation time, for one created while the faults run: what fell due by
    # then was never due.
    created: dt.datetime | None = None
    overlap: str | None = None  # an overlap policy that may hold a fire back or skip it
    pauses: tuple[Window, ...] = ()  # [at, until) of each pause made on it, as stored

    def paused_at(self, nominal: dt.datetime) -> bool:
        return any(start <= nominal < end for start, end in self.pauses)

    @property
    def audit_ids(self) -> list[str]:
        """The ids its fires are audited under: its own, or one per tenant."""
        return [f"{self.id}/{t}" for t in self.tenants] if self.tenants else [self.id]

    def api_body(self, target: str) -> dict[str, Any]:
        """The POST /schedules body that asks the scheduler for these fire times."""
        trigger: dict[str, Any]
        if self.kind == "second_step":
            seconds = "*" if self.step_s == 1 else f"*/{self.step_s}"
            trigger = {"kind": "cron", "cron": f"{seconds} * * * * *", "timezone": "UTC"}
        elif self.kind == "interval":
            assert self.anchor is not None
            trigger = {
                "kind": "interval",
                "every": self.every_s,
                "start_at": self.anchor.isoformat(),
            }
        else:
            trigger = {"kind": "at", "at": [t.isoformat() for t in self.instants]}
        body = {
            "id": self.id,
            "name": f"chaos {self.kind} {self.id}",
            "trigger": trigger,
            "jitter": self.jitter_s,
            "catchup": "all",
            "target": target,
            "payload": {"soak": True},
        }
        if self.tenants:
            body["fan_out"] = {
                "collection": TENANTS,
                "filter": {"_id": {"$in": list(self.tenants)}},
            }
        if self.overlap is not None:
            body["overlap"] = self.overlap
        return body

    def nominal_times(self, since: dt.datetime, until: dt.datetime) -> list[dt.datetime]:
        """Nominal times t with since <= t <= until, and after its creation."""
        if self.created is not None:
            since = max(since, self.created + dt.timedelta(microseconds=1))
        if self.kind == "at":
            return [t for t in self.instants if since <= t <= until]
        if self.kind == "interval":
            assert self.anchor is not None
            first = max(0, math.ceil((since - self.anchor).total_seconds() / self.every_s))
            times = []
            t = self.anchor + dt.timedelta(seconds=first * self.every_s)
            while t <= until:
                times.append(t)
                t += dt.timedelta(seconds=self.every_s)
            return times
        t = since.replace(microsecond=0)
        if t < since:
            t += dt.timedelta(seconds=1)
        times = []
        while t <= until:
            if t.second % self.step_s == 0:
                times.append(t)
            t += dt.timedelta(seconds=1)
        return times


@dataclass(frozen=True)
class StreamedFire:
    """One message of the stream, as the auditor reads it."""

    schedule_id: str
    nominal: dt.datetime
    term: int
    stored_at: dt.datetime  # JetStream's store time


def streamed_fire(event: dict[str, Any], stored_at: dt.datetime) -> StreamedFire | None:
    """The fire a CloudEvent names, or None when it is not one (checked, not trusted)."""
    data = event.get("data")
    if not isinstance(data, dict):
        return None
    sid, nominal, term = data.get("schedule_id"), data.get("nominal_at"), data.get("term")
    if not isinstance(sid, str) or not isinstance(nominal, str) or type(term) is not int:
        return None
    try:
        when = dt.datetime.fromisoformat(nominal.replace("Z", "+00:00"))
    except ValueError:
        return None
    tenant = data.get("tenant")
    if tenant is not None:  # a fan-out fire: audited per tenant
        if not isinstance(tenant, str) or event.get("id") != f"{sid}@{nominal}/{tenant}":
            return None
        sid = f"{sid}/{tenant}"
    elif event.get("id") != f"{sid}@{nominal}":
        return None
    if when.tzinfo is None:
        return None
    return StreamedFire(sid, when.astimezone(UTC), term, stored_at.astimezone(UTC))


@dataclass
class SoakAudit:
    since: dt.datetime
    until: dt.datetime
    late_bound_s: float
    expected: int = 0
    delivered: int = 0
    tenant_fires: int = 0  # of those delivered, fan-out fires (one per tenant)
    missing: list[Key] = field(default_factory=list)
    fired_and_skipped: list[Key] = field(default_factory=list)  # in the stream, and skipped
    paused_optional: int = 0  # instants a pause covered (fired or not: either is right)
    skipped_accounted: int = 0  # instants not fired, each recorded skipped in the ledger
    duplicated: list[tuple[Key, int]] = field(default_factory=list)
    unexpected: list[Key] = field(default_factory=list)
    early: list[Key] = field(default_factory=list)  # stored before its nominal time
    malformed: int = 0
    lateness_clear: list[float] = field(default_factory=list)  # outside fault windows
    lateness_faulted: list[float] = field(default_factory=list)
    over_bound: list[tuple[Key, float]] = field(default_factory=list)  # outside windows

    @property
    def exactly_once(self) -> bool:
        return not (
            self.missing
            or self.duplicated
            or self.unexpected
            or self.early
            or self.fired_and_skipped
        )

    @property
    def ok(self) -> bool:
        return self.exactly_once and not self.over_bound and not self.malformed


def overlaps(first: dt.datetime, last: dt.datetime, windows: list[Window]) -> bool:
    """Whether [first, last] meets any of the windows."""
    return any(start <= last and first <= end for start, end in windows)


def audit(
    schedules: list[SoakSchedule],
    messages: list[tuple[dict[str, Any], dt.datetime]],
    since: dt.datetime,
    until: dt.datetime,
    fault_windows: list[Window],
    late_bound_s: float,
    skipped: frozenset[Key] = frozenset(),
) -> SoakAudit:
    """Each (schedule, nominal time) in [since, until] must be in the stream exactly once,
    never before its nominal time, and outside fault windows within ``late_bound_s`` of
    its due time (nominal plus at most the schedule's jitter). One a pause covers may be
    in the stream at most once; one of a schedule with an overlap policy may instead be
    among ``skipped`` (the ledger's record), never in both."""
    report = SoakAudit(since, until, late_bound_s)
    by_id = {audit_id: s for s in schedules for audit_id in s.audit_ids}
    ours = {s.id for s in schedules}
    due = {
        (audit_id, t, s.paused_at(t))
        for s in schedules
        for t in s.nominal_times(since, until)
        for audit_id in s.audit_ids
    }
    expected = {(audit_id, t) for audit_id, t, _ in due}
    required = {(audit_id, t) for audit_id, t, paused in due if not paused}
    report.expected = len(required)
    report.paused_optional = len(expected) - len(required)
    first_stored: dict[Key, dt.datetime] = {}
    counts: Counter[Key] = Counter()
    for event, stored_at in messages:
        fire = streamed_fire(event, stored_at)
        if fire is None:
            report.malformed += 1
            continue
        if fire.schedule_id.partition("/")[0] not in ours or not since <= fire.nominal <= until:
            continue  # another schedule's, or outside the window
        key = (fire.schedule_id, fire.nominal)
        counts[key] += 1
        first_stored[key] = min(first_stored.get(key, fire.stored_at), fire.stored_at)
    for key, count in counts.items():
        if key not in expected:
            report.unexpected.append(key)
            continue
        report.delivered += 1
        report.tenant_fires += key[0] != by_id[key[0]].id
        if count > 1:
            report.duplicated.append((key, count))
        if key in skipped:
            report.fired_and_skipped.append(key)
        stored, nominal = first_stored[key], key[1]
        if stored < nominal:
            report.early.append(key)
        schedule = by_id[key[0]]
        if schedule.overlap is not None or schedule.paused_at(nominal):
            continue  # held back by its policy, or fired as a pause began: late by design
        jitter = schedule.jitter_s
        # A jittered fire's due time is somewhere in [nominal, nominal + jitter): judge it
        # against the latest, and keep it out of the figures (its exact offset is unknown).
        late = (stored - nominal).total_seconds() - jitter
        faulted = overlaps(nominal, nominal + dt.timedelta(seconds=jitter), fault_windows)
        if faulted:
            if not jitter:
                report.lateness_faulted.append(late)
        else:
            if not jitter:
                report.lateness_clear.append(late)
            if late > late_bound_s:
                report.over_bound.append((key, late))
    unfired = [k for k in required if k not in counts]
    accounted = {k for k in unfired if k in skipped and by_id[k[0]].overlap is not None}
    report.skipped_accounted = len(accounted)
    report.missing = sorted(k for k in unfired if k not in accounted)
    return report


@dataclass(frozen=True)
class SoakBackfill:
    """A backfill the soak asked for over whole seconds [start, end) of an every-second
    schedule; ``id`` None when its request's answer was lost (it may exist)."""

    schedule_id: str
    start: dt.datetime
    end: dt.datetime
    id: str | None = None

    def instants(self) -> list[Key]:
        count = int((self.end - self.start).total_seconds())
        return [(self.schedule_id, self.start + dt.timedelta(seconds=k)) for k in range(count)]


@dataclass
class BackfillAudit:
    asked: int = 0
    answered: int = 0  # of those asked, the ones whose request had its 202
    expected: int = 0  # instants of the backfills whose request was answered
    delivered: int = 0
    missing: list[Key] = field(default_factory=list)
    duplicated: list[tuple[Key, int]] = field(default_factory=list)
    # Backfills whose record, once done, does not say every instant fired exactly.
    miscounted: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.miscounted)


def audit_backfills(
    backfills: list[SoakBackfill],
    messages: list[tuple[dict[str, Any], dt.datetime]],
    records: dict[str, dict[str, Any]],
) -> BackfillAudit:
    """Each instant of an answered backfill in the stream exactly once, and its record
    ``done`` with ``fired`` its total and nothing skipped or withdrawn (each range is the
    soak's own: no other fire is there); an unanswered one's at most once."""
    report = BackfillAudit(asked=len(backfills))
    wanted = {k: b for b in backfills for k in b.instants()}
    counts: Counter[Key] = Counter()
    for event, stored_at in messages:
        fire = streamed_fire(event, stored_at)
        if fire is not None and (fire.schedule_id, fire.nominal) in wanted:
            counts[(fire.schedule_id, fire.nominal)] += 1
    for key, backfill in wanted.items():
        count = counts[key]
        if count > 1:
            report.duplicated.append((key, count))
        if backfill.id is None:
            continue
        report.expected += 1
        report.delivered += count > 0
        if count == 0:
            report.missing.append(key)
    for backfill in backfills:
        if backfill.id is None:
            continue
        report.answered += 1
        record = records.get(backfill.id) or {}
        total = len(backfill.instants())
        if (
            record.get("state"),
            record.get("fired"),
            record.get("skipped"),
            record.get("withdrawn"),
        ) != ("done", total, 0, 0):
            report.miscounted.append((backfill.id, record))
    report.missing.sort()
    return report


@dataclass
class RunsAudit:
    """Every fire in the stream against the runs ledger and the handler's side effects."""

    fires: int = 0
    succeeded: int = 0
    dead: int = 0
    lost: list[str] = field(default_factory=list)  # in the stream, no final run
    unsettled: list[str] = field(default_factory=list)  # still running or retrying
    wrongly_dead: list[str] = field(default_factory=list)  # dead, not doomed, or no error
    wrongly_alive: list[str] = field(default_factory=list)  # doomed, yet succeeded
    not_done: list[str] = field(default_factory=list)  # succeeded, no side effect done
    repeated: list[tuple[str, int]] = field(default_factory=list)  # done more than once
    unexplained: list[str] = field(default_factory=list)  # ... by no interrupted worker
    attempts: Counter[int] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.unsettled
            or self.wrongly_dead
            or self.wrongly_alive
            or self.not_done
            or self.unexplained
        )


def audit_runs(
    fire_ids: set[str],
    runs: dict[str, dict[str, Any]],
    side_effects: list[tuple[str, str, int, str]],
    doomed: Any,
    interrupted: set[str],
) -> RunsAudit:
    """``runs``: the runs ledger by fire id; ``side_effects``: (fire id, worker, attempt,
    start|done) lines; ``doomed(fire_id)``: the handler raises PermanentFailure for it;
    ``interrupted``: the workers the soak killed or stopped.

    A side effect done twice is explained only when one of its attempts ran on an
    interrupted worker: killed between the handler's side effect and the ledger's record,
    or stalled past its run lease (the windows docs/RELIABILITY.md states)."""
    report = RunsAudit(fires=len(fire_ids))
    done = Counter(f for f, _, _, what in side_effects if what == "done")
    done_by: dict[str, set[str]] = {}
    for f, worker, _, what in side_effects:
        if what == "done":
            done_by.setdefault(f, set()).add(worker)
    for fire_id in sorted(fire_ids):
        run = runs.get(fire_id)
        if run is None:
            report.lost.append(fire_id)
            continue
        report.attempts[int(run.get("attempts", 0))] += 1
        state = run.get("state")
        if state == "succeeded":
            report.succeeded += 1
            if doomed(fire_id):
                report.wrongly_alive.append(fire_id)
            if done[fire_id] == 0:
                report.not_done.append(fire_id)
            if done[fire_id] > 1:
                report.repeated.append((fire_id, done[fire_id]))
                if not done_by[fire_id] & interrupted:
                    report.unexplained.append(fire_id)
        elif state == "dead":
            report.dead += 1
            if not doomed(fire_id) or not run.get("last_error"):
                report.wrongly_dead.append(fire_id)
        else:
            report.unsettled.append(fire_id)
    return report
