"""How the API's answers are shown in a terminal: tables, and JSON. A stored value is shown
with its control characters escaped: a newline in a note, or an escape sequence in a
schedule's name, never forges a row or reaches the terminal raw."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from hascheduler.core.health import ScheduleHealth
from hascheduler.core.models import Schedule, preview


def trigger_text(trigger: dict[str, Any]) -> str:
    if trigger["kind"] == "cron":
        return f"cron {trigger['cron']} {trigger.get('timezone', 'UTC')}"
    if trigger["kind"] == "interval":
        return f"every {trigger['every']:g}s"
    instants = trigger["at"]
    return f"at {instants[0]}" + (f" (+{len(instants) - 1})" if len(instants) > 1 else "")


# Characters that move the cursor, colour, rewrite or reorder what a terminal shows:
# C0 and C1 controls, DEL, and the bidirectional overrides.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(value: object) -> str:
    """``value`` as text a terminal shows as written: each control character escaped."""
    return _UNPRINTABLE.sub(lambda m: m[0].encode("unicode_escape").decode(), str(value))


def table(rows: list[list[str]], headers: list[str]) -> str:
    cells = [[printable(c) for c in row] for row in rows]
    widths = [max(len(c) for c in column) for column in zip(headers, *cells, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def schedules_table(
    items: list[Schedule],
    health: Mapping[str, ScheduleHealth] | None = None,
    now: dt.datetime | None = None,
    judged: bool = False,
) -> str:
    """Each schedule: its state (active, paused, completed), its next fire, its last (with
    ``health``), and a pause's note; HEALTH too when ``judged``."""
    now = now or dt.datetime.now(dt.UTC)
    health = health or {}

    def state(s: Schedule) -> str:
        return "completed" if s.completed else ("paused" if s.paused else "active")

    def following(s: Schedule) -> str:
        if s.paused or s.completed:
            return "-"
        times = preview(s, now, 1).times
        return _when(times[0].fire_at, now) if times else "-"

    def last(s: Schedule) -> str:
        fire = health[s.id].last_fire if s.id in health else None
        return f"{_when(fire.nominal_at, now)} {fire.state}" if fire else "-"

    rows = [
        [
            s.id,
            s.name,
            trigger_text(s.trigger.model_dump(mode="json")),
            state(s),
            following(s),
            last(s),
            s.target + (f" (per {s.fan_out.collection})" if s.fan_out else ""),
            (s.pause.note or "")[:40] if s.pause else "",
        ]
        for s in items
    ]
    headers = ["ID", "NAME", "TRIGGER", "STATE", "NEXT", "LAST", "TARGET", "NOTE"]
    if judged:
        for row, s in zip(rows, items, strict=True):
            row.append(health_word(health[s.id]) if s.id in health else "-")
        headers.append("HEALTH")
    return table(rows, headers)


def _when(moment: dt.datetime, now: dt.datetime) -> str:
    """An instant shown short: its time today, else its date and time (UTC)."""
    moment = moment.astimezone(dt.UTC)
    shown = "%H:%M:%S" if moment.date() == now.date() else "%Y-%m-%d %H:%M"
    return moment.strftime(shown)


def health_word(health: ScheduleHealth) -> str:
    if health.status == "failing":
        return f"failing ({health.consecutive_failures})"
    return health.status


def health_text(health: ScheduleHealth) -> str:
    def when(moment: dt.datetime | None) -> str:
        return moment.isoformat() if moment is not None else "never"

    fire = health.last_fire
    lines = [
        f"status                {health_word(health)}",
        "last fire             " + (f"{fire.fire_id} {fire.state}" if fire else "none"),
        f"last success          {when(health.last_success_at)}",
        f"consecutive failures  {health.consecutive_failures}",
        "late                  "
        + (f"since {health.overdue_since.isoformat()}" if health.overdue_since else "no"),
    ]
    if health.success_within is not None:
        lines.append(
            f"objective             a success every {health.success_within:g} s: "
            f"{'met' if health.objective_met else 'missed'} (until "
            f"{when(health.success_deadline)})"
        )
    return "\n".join(lines)


def shown(value: BaseModel | dict[str, Any]) -> str:
    data = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return json.dumps(data, indent=2)


def schedule_rows(
    items: list[Schedule], health: Mapping[str, ScheduleHealth] | None = None, judged: bool = False
) -> str:
    return schedules_table(items, health, judged=judged)


def audit_output(records: list[dict[str, Any]], as_json: bool) -> str:
    if as_json:
        return shown({"items": records})
    return table(
        [
            [
                r["at"],
                r["actor"],
                r["from"] or "-",
                r["action"],
                r["namespace"],
                r["schedule_id"],
                str(r["revision"] or "-"),
                ",".join(r["changed"]) or "-",
                r["reason"] or "",
            ]
            for r in records
        ],
        ["AT", "ACTOR", "FROM", "ACTION", "NAMESPACE", "SCHEDULE", "REV", "CHANGED", "REASON"],
    )


def runs_table(items: list[dict[str, Any]], names: Mapping[str, str] | None = None) -> str:
    """Each run, with its schedule's name (``names``: by schedule id) when known."""
    names = names or {}

    def seconds(value: Any) -> str:
        return f"{value:.3f}s" if isinstance(value, int | float) else "-"

    def note(run: dict[str, Any]) -> str:
        """A waiting run says what it waits for; the others their last error."""
        waiting_on = run.get("waiting_on") if run.get("state") == "waiting" else None
        if isinstance(waiting_on, dict) and waiting_on:
            kind, key = next(iter(waiting_on.items()))
            return f"waiting on {kind} {key}"[:60]
        return (run.get("last_error") or "")[:60]

    return table(
        [
            [
                r["id"],
                names.get(str(r.get("schedule_id")), str(r.get("schedule_id") or "-")),
                r["state"],
                str(r["attempts"]),
                r.get("worker_id") or "-",
                seconds(r.get("duration_s")),
                note(r),
            ]
            for r in items
        ],
        [
            "FIRE ID",
            "SCHEDULE",
            "STATE",
            "ATTEMPTS",
            "WORKER",
            "DURATION",
            "LAST ERROR / WAITING ON",
        ],
    )
