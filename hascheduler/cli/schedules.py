"""``hascheduler schedules ...`` and ``hascheduler runs ...``: the HTTP API from a
terminal, as tables or JSON.

The API is the one ``--api`` (or HASCHEDULER_API) names; without either, a ready replica
of the ``hascheduler dev`` cluster running from this directory (its state directory:
HASCHEDULER_DEV_STATE_DIR, default .hascheduler-dev).

Exit codes: 0 done; 2 the input was refused (locally, or by the API with a 4xx naming the
field); 1 the API could not be reached or failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from hascheduler.cli import local_cluster
from hascheduler.client import AsyncClient, HaschedulerError, calls
from hascheduler.core.constants import MAX_PAGE
from hascheduler.core.health import ScheduleHealth
from hascheduler.core.models import WEBHOOK_EVENTS
from hascheduler.core.overlap import POLICIES
from hascheduler.core.run_states import STATES as RUN_STATES

EXIT_REFUSED = 2
EXIT_UNAVAILABLE = 1


class Refused(Exception):
    """Input refused before or by the API; the message says which field and why."""


class Unavailable(Exception):
    """The API could not be reached, or answered with a server error."""


def _common(after_action: bool) -> argparse.ArgumentParser:
    """The options of every command, before its action or (SUPPRESS: a value given before
    is not reset) after it."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if after_action else value

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--api",
        default=default(os.environ.get("HASCHEDULER_API")),
        help="base URL of a replica's API (env HASCHEDULER_API; default: "
        "the local `hascheduler dev` cluster)",
    )
    common.add_argument(
        "--token",
        default=default(os.environ.get("HASCHEDULER_TOKEN")),
        help="API token, needed when the replicas have tokens configured "
        "(env HASCHEDULER_TOKEN; the environment keeps it out of `ps`)",
    )
    common.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON instead of a table"
    )
    common.add_argument(
        "--namespace",
        default=default(os.environ.get("HASCHEDULER_NAMESPACE")),
        help="the namespace to list, or to create in (env "
        "HASCHEDULER_NAMESPACE; default: every one the token reaches, "
        "and 'default' for a new schedule)",
    )
    common.add_argument(
        "--reason", default=default(None), help="why: recorded in the audit trail with the change"
    )
    return common


class _Actions:
    """A command's actions, each taking the common options after it too."""

    def __init__(self, command: Any) -> None:
        self.actions = command.add_subparsers(dest="action", required=True)
        self.after = _common(after_action=True)

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        return self.actions.add_parser(name, parents=[self.after], **kwargs)


def add_parser(sub: Any) -> None:  # noqa: PLR0915 (the subcommands' table, one statement per flag)
    common = _common(after_action=False)
    _add_runs_parser(sub, common)
    _add_webhooks_parser(sub, common)
    sc = sub.add_parser(
        "schedules",
        parents=[common],
        help="add, list, change and preview schedules over the HTTP API",
    )
    sc.set_defaults(run=_run_sync)
    cmd = _Actions(sc)

    add = cmd.add_parser("add", help="create a schedule")
    add.add_argument("--file", help="a schedule as JSON (- for standard input)")
    add.add_argument("--id")
    add.add_argument("--name")
    add.add_argument("--target", help="broker subject suffix or routing key")
    kind = add.add_mutually_exclusive_group()
    kind.add_argument("--cron", help="5 or 6 fields, crontab syntax")
    kind.add_argument("--every", help="seconds or an ISO-8601 duration (PT30S)")
    kind.add_argument("--at", action="append", help="an instant (ISO-8601); repeat for more")
    add.add_argument("--timezone", help="IANA zone for --cron (default UTC)")
    add.add_argument("--start-at", help="anchor of an --every grid")
    add.add_argument("--end-at", help="last possible time of an --every schedule")
    add.add_argument("--jitter", type=float)
    add.add_argument("--payload", help="a JSON object")
    add.add_argument(
        "--fan-out",
        help='one run per tenant, as JSON: {"collection": '
        '"tenants", "filter": {"active": true}, "key": "_id"}',
    )
    add.add_argument("--label", action="append", default=[], help="key=value; repeatable")
    add.add_argument("--paused", action="store_true")
    add.add_argument("--catchup", choices=["latest", "all", "none"])
    add.add_argument("--catchup-window", type=float)
    add.add_argument(
        "--overlap",
        choices=POLICIES,
        help="what a fire does while the previous run is open (default allow)",
    )
    add.add_argument(
        "--pause-on-failure", type=int, metavar="N", help="pause after N consecutive dead runs"
    )
    add.add_argument(
        "--success-within",
        metavar="DURATION",
        help="its objective: a run succeeds at least this often (ISO-8601, "
        "such as PT2H); its health and metrics judge it",
    )

    ls = cmd.add_parser("list", help="list schedules")
    ls.add_argument("--label", action="append", default=[], help="key=value; repeat to AND")
    ls.add_argument("--paused", choices=["true", "false"])
    ls.add_argument("--limit", type=int, default=100)
    ls.add_argument(
        "--health",
        action="store_true",
        help="a HEALTH column: ok, late, objective_missed, failing (with the "
        "count), paused or completed",
    )

    hl = cmd.add_parser(
        "health",
        help="a schedule's last fire, last success, consecutive failures, lateness and objective",
    )
    hl.add_argument("id")

    for name, text in (
        ("get", "show one schedule"),
        ("delete", "delete a schedule"),
        ("pause", "pause a schedule"),
        ("resume", "resume a schedule"),
    ):
        p = cmd.add_parser(name, help=text)
        p.add_argument("id")
        if name != "get":
            p.add_argument("--if-match", type=int, help="expected revision")
        if name == "pause":
            p.add_argument("--note", help="why (shown with the schedule)")
            p.add_argument("--until", help="resume by itself at this instant (RFC 3339)")

    up = cmd.add_parser(
        "update", help="change a schedule: --set applies a JSON merge patch, --file replaces it"
    )
    up.add_argument("id")
    change = up.add_mutually_exclusive_group(required=True)
    change.add_argument("--set", dest="patch", help="JSON merge patch, e.g. '{\"jitter\": 5}'")
    change.add_argument("--file", help="the whole schedule as JSON (- for standard input)")
    up.add_argument("--if-match", type=int, help="expected revision")

    tr = cmd.add_parser("trigger", help="run a schedule now (a fire outside its trigger)")
    tr.add_argument("id")
    tr.add_argument(
        "--payload", help="this fire's payload (a JSON object) instead of the schedule's"
    )
    tr.add_argument("--overlap", choices=POLICIES, help="this fire's overlap policy")
    tr.add_argument("--force", action="store_true", help="run a paused schedule too")
    tr.add_argument("--idempotency-key", help="a retry with the same key fires nothing new")
    tr.add_argument(
        "--priority",
        type=int,
        choices=range(10),
        metavar="0-9",
        help="this fire's priority (higher first, under contention)",
    )

    bf = cmd.add_parser(
        "backfill", help="fire the schedule's times in [--start, --end) that were never fired"
    )
    bf.add_argument("id")
    bf.add_argument("--start", required=True, help="RFC 3339, inclusive")
    bf.add_argument("--end", required=True, help="RFC 3339, exclusive, not in the future")
    bf.add_argument("--overlap", choices=POLICIES, help="the backfilled fires' policy")

    nx = cmd.add_parser("next", help="preview the next fire times")
    nx.add_argument("id")
    nx.add_argument("--count", type=int, default=5)

    hi = cmd.add_parser("history", help="a schedule's audit records, newest first")
    hi.add_argument("id")
    hi.add_argument("--limit", type=int, default=20)

    rs = cmd.add_parser(
        "restore", help="put back the fields a schedule had at an earlier revision of its history"
    )
    rs.add_argument("id")
    rs.add_argument("--revision", type=int, required=True)
    rs.add_argument("--if-match", type=int, help="expected revision")

    al = sub.add_parser(
        "audit-log",
        parents=[common],
        help="the audit trail: every change to a schedule or its runs",
    )
    al.set_defaults(run=_run_sync, action="list")
    al.add_argument("--schedule", help="one schedule's records")
    al.add_argument("--actor", help="one token's (or JWT subject's) records")
    al.add_argument("--since", help="records from this instant on (RFC 3339)")
    al.add_argument("--limit", type=int, default=50)


def _add_runs_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    rn = sub.add_parser(
        "runs",
        parents=[common],
        help="what the workers made of the fires: list, show, retry dead runs, cancel",
    )
    rn.set_defaults(run=_run_sync)
    cmd = _Actions(rn)
    ls = cmd.add_parser("list", help="runs, most recently changed first")
    ls.add_argument("--state", choices=RUN_STATES)
    ls.add_argument("--schedule", help="the runs of one schedule's fires (newest first)")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument(
        "--after", help="the next a previous --json list gave (the fire id of its last run)"
    )
    show = cmd.add_parser("show", help="one run")
    show.add_argument("fire_id")
    retry = cmd.add_parser("retry", help="replay a dead run")
    retry.add_argument("fire_id")
    cancel = cmd.add_parser(
        "cancel", help="cancel a run (a running one is stopped by its worker within a second)"
    )
    cancel.add_argument("fire_id")


def _add_webhooks_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    wh = sub.add_parser(
        "webhooks",
        parents=[common],
        help="a namespace's events POSTed to a URL, signed: add, list, show, delete, deliveries",
    )
    wh.set_defaults(run=_run_sync)
    cmd = _Actions(wh)
    add = cmd.add_parser(
        "add",
        help="create a webhook (admin in its namespace); prints its "
        "secret, the only time it is shown",
    )
    add.add_argument("--url", required=True, help="http(s) URL the events are POSTed to")
    add.add_argument(
        "--event",
        action="append",
        required=True,
        choices=WEBHOOK_EVENTS,
        help="an event it receives; repeatable",
    )
    add.add_argument("--id")
    add.add_argument("--schedule", help="only this schedule's events")
    cmd.add_parser("list", help="the webhooks the token may read")
    for name, text in (
        ("show", "one webhook (never its secret)"),
        ("delete", "delete a webhook and its deliveries"),
    ):
        cmd.add_parser(name, help=text).add_argument("id")
    dl = cmd.add_parser(
        "deliveries", help="a webhook's deliveries, newest first, with their attempts"
    )
    dl.add_argument("id")
    dl.add_argument("--limit", type=int, default=50)


def resolve_api(explicit: str | None) -> str:
    """The API to call; raises Unavailable saying how to name one."""
    if explicit:
        return explicit.rstrip("/")
    state_dir = local_cluster.state_dir_from_env()
    try:
        status = local_cluster.call(state_dir, "GET", "/status", timeout_s=10)
    except local_cluster.ControlError as exc:
        raise Unavailable(
            f"no API named (--api or HASCHEDULER_API), and no local cluster: {exc}"
        ) from None
    ready = [r["url"] for r in status.get("replicas", []) if r.get("ready")]
    if not ready:
        raise Unavailable(f"the local cluster in {state_dir}/ has no ready replica")
    return str(ready[0]).rstrip("/")


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise Refused(f"{what} is not valid JSON: {exc}") from None


def _read_file(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise Refused(f"--file: {exc}") from None
    return _json_arg(text, "--file")


def _labels(pairs: Sequence[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise Refused(f"--label {pair!r}: write it as key=value")
        labels[key] = value
    return labels


def schedule_body(args: argparse.Namespace) -> dict[str, Any]:
    """The POST body from the add command's flags (or its --file)."""
    if args.file:
        from_file = _read_file(args.file)
        if not isinstance(from_file, dict):
            raise Refused("--file must hold a JSON object")
        return from_file
    missing = [
        flag for flag, value in (("--name", args.name), ("--target", args.target)) if not value
    ]
    if missing:
        raise Refused(f"{' and '.join(missing)} required (or give the schedule with --file)")
    trigger: dict[str, Any]
    if args.cron:
        trigger = {"kind": "cron", "cron": args.cron}
        if args.timezone:
            trigger["timezone"] = args.timezone
    elif args.every:
        every: Any = float(args.every) if args.every.replace(".", "", 1).isdigit() else args.every
        trigger = {"kind": "interval", "every": every}
        for key in ("start_at", "end_at"):
            if getattr(args, key):
                trigger[key] = getattr(args, key)
    elif args.at:
        trigger = {"kind": "at", "at": args.at}
    else:
        raise Refused("give one trigger: --cron, --every or --at")
    body: dict[str, Any] = {
        "name": args.name,
        "target": args.target,
        "trigger": trigger,
        "labels": _labels(args.label),
        "paused": args.paused,
    }
    for key in ("id", "jitter", "catchup", "catchup_window", "overlap", "pause_on_failure"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    if args.payload:
        body["payload"] = _json_arg(args.payload, "--payload")
    if args.fan_out:
        body["fan_out"] = _json_arg(args.fan_out, "--fan-out")
    if args.success_within:
        body["expect"] = {"success_within": args.success_within}
    return body


def _trigger_text(trigger: dict[str, Any]) -> str:
    if trigger["kind"] == "cron":
        return f"cron {trigger['cron']} {trigger.get('timezone', 'UTC')}"
    if trigger["kind"] == "interval":
        return f"every {trigger['every']:g}s"
    instants = trigger["at"]
    return f"at {instants[0]}" + (f" (+{len(instants) - 1})" if len(instants) > 1 else "")


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _schedules_table(
    items: list[dict[str, Any]], health: Mapping[str, ScheduleHealth] | None = None
) -> str:
    def fan_out(schedule: dict[str, Any]) -> str:
        spec = schedule.get("fan_out")
        return f"per {spec['collection']}" if spec else "-"

    rows = [
        [
            s["id"],
            s["name"],
            _trigger_text(s["trigger"]),
            "yes" if s["paused"] else "no",
            str(s["revision"]),
            s["target"],
            fan_out(s),
        ]
        for s in items
    ]
    headers = ["ID", "NAME", "TRIGGER", "PAUSED", "REV", "TARGET", "FAN-OUT"]
    if health is not None:
        for row, s in zip(rows, items, strict=True):
            row.append(_health_word(health[s["id"]]) if s["id"] in health else "-")
        headers.append("HEALTH")
    return table(rows, headers)


def _health_word(health: ScheduleHealth) -> str:
    if health.status == "failing":
        return f"failing ({health.consecutive_failures})"
    return health.status


def _health_text(health: ScheduleHealth) -> str:
    def when(moment: dt.datetime | None) -> str:
        return moment.isoformat() if moment is not None else "never"

    fire = health.last_fire
    lines = [
        f"status                {_health_word(health)}",
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


def _run_sync(args: argparse.Namespace) -> int:
    return asyncio.run(run(args))


def _shown(value: BaseModel | dict[str, Any]) -> str:
    data = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return json.dumps(data, indent=2)


def _schedule_rows(items: list[Any], health: Mapping[str, ScheduleHealth] | None = None) -> str:
    return _schedules_table([s.model_dump(mode="json") for s in items], health)


async def run(args: argparse.Namespace) -> int:
    what = f"hascheduler {args.command} {args.action}"
    try:
        base = resolve_api(args.api)
        async with AsyncClient(base, args.token, attempts=1, reason=args.reason) as api:
            output: str | None
            if args.command == "runs":
                output = await _runs(api, args)
            elif args.command == "webhooks":
                output = await _webhooks(api, args)
            elif args.command == "audit-log":
                output = _audit_output(
                    await _first(
                        api.audit(
                            args.namespace,
                            args.schedule,
                            args.actor,
                            args.since,
                            page_size=min(args.limit, MAX_PAGE),
                        ),
                        args.limit,
                    ),
                    args.json,
                )
            else:
                output = await _dispatch(api, base, args)
    except Refused as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (Unavailable, HaschedulerError) as exc:
        refused = isinstance(exc, HaschedulerError) and 400 <= exc.status < 500
        print(f"{what}: {exc}", file=sys.stderr)
        return EXIT_REFUSED if refused else EXIT_UNAVAILABLE
    if output is not None:
        print(output)
    return 0


async def _dispatch(api: AsyncClient, base: str, args: argparse.Namespace) -> str | None:  # noqa: C901 (one branch per subcommand)
    if_match = getattr(args, "if_match", None)
    sid: str = getattr(args, "id", None) or ""
    if args.action == "add":
        body = schedule_body(args)
        if args.namespace is not None:
            body.setdefault("namespace", args.namespace)
        created = await api.create_schedule(body)
        return _shown(created) if args.json else _schedule_rows([created])
    if args.action == "list":
        paused = None if args.paused is None else args.paused == "true"
        if args.health:
            page = await api.send(
                calls.schedules_health_page(
                    _labels(args.label), paused, None, args.limit, args.namespace
                )
            )
            if args.json:
                return _shown(page.model_dump(mode="json", exclude_none=True))
            return _schedule_rows(page.items, page.health or {})
        items, after = await api.send(
            calls.schedules_page(_labels(args.label), paused, None, args.limit, args.namespace)
        )
        if args.json:
            return _shown({"items": [i.model_dump(mode="json") for i in items], "next": after})
        return _schedule_rows(items)
    if args.action == "health":
        health = await api.health(sid)
        return _shown(health) if args.json else _health_text(health)
    if args.action == "get":
        return _shown(await api.get_schedule(sid))
    if args.action == "update":
        if args.file:
            changed = await api.replace_schedule(sid, _read_file(args.file), if_match)
        else:
            changed = await api.patch_schedule(sid, _json_arg(args.patch, "--set"), if_match)
        return _shown(changed) if args.json else _schedule_rows([changed])
    if args.action in {"pause", "resume"}:
        if args.action == "pause":
            changed = await api.pause(sid, args.note, args.until, if_match)
        else:
            changed = await api.resume(sid, if_match)
        return _shown(changed) if args.json else _schedule_rows([changed])
    if args.action == "delete":
        await api.delete_schedule(sid, if_match)
        return None if not args.json else json.dumps({"deleted": sid})
    if args.action == "trigger":
        payload = None if args.payload is None else _json_arg(args.payload, "--payload")
        fired = await api.trigger(
            sid, payload, args.overlap, args.force, args.idempotency_key, args.priority
        )
        return _shown(fired) if args.json else fired.fire_id
    if args.action == "backfill":
        answer = await api.backfill(sid, args.start, args.end, args.overlap)
        return (
            _shown(answer)
            if args.json
            else (
                f"backfill {answer['id']}: {answer['total']} fire times, "
                f"progress at {base}/backfills/{answer['id']}"
            )
        )
    if args.action == "history":
        return _audit_output(
            await _first(api.history(sid, min(args.limit, MAX_PAGE)), args.limit), args.json
        )
    if args.action == "restore":
        restored = await api.restore(sid, args.revision, if_match)
        return _shown(restored) if args.json else _schedule_rows([restored])
    if args.action == "next":
        preview = await api.next_fires(sid, args.count)
        if args.json:
            return _shown(preview)
        return table(
            [[t.nominal.isoformat(), t.fire_at.isoformat(), t.fire_id] for t in preview.times],
            ["NOMINAL", "FIRE AT", "FIRE ID"],
        )
    raise Refused(f"unknown action {args.action}")


async def _first(items: AsyncIterator[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    if count < 1:
        raise Refused("--limit must be at least 1")
    out = []
    async for item in items:
        out.append(item)
        if len(out) >= count:
            break
    return out


def _audit_output(records: list[dict[str, Any]], as_json: bool) -> str:
    if as_json:
        return _shown({"items": records})
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


def _runs_table(items: list[dict[str, Any]]) -> str:
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
                r["state"],
                str(r["attempts"]),
                r.get("worker_id") or "-",
                seconds(r.get("duration_s")),
                note(r),
            ]
            for r in items
        ],
        ["FIRE ID", "STATE", "ATTEMPTS", "WORKER", "DURATION", "LAST ERROR / WAITING ON"],
    )


async def _runs(api: AsyncClient, args: argparse.Namespace) -> str:
    if args.action == "list":
        if not 1 <= args.limit <= 500:
            raise Refused("--limit must be from 1 to 500")
        if args.schedule:
            if args.state or args.after:
                raise Refused("--schedule lists one schedule's runs: without --state/--after")
            body = await api.schedule_runs(args.schedule, args.limit)
        else:
            items, after = await api.send(
                calls.runs_page(args.state, args.after, args.limit, args.namespace)
            )
            body = {"items": items, "next": after}
        return json.dumps(body, indent=2) if args.json else _runs_table(body["items"])
    if args.action == "show":
        return json.dumps(await api.get_run(args.fire_id), indent=2)
    changed = await (
        api.retry_run(args.fire_id) if args.action == "retry" else api.cancel_run(args.fire_id)
    )
    return json.dumps(changed, indent=2) if args.json else _runs_table([changed])


async def _webhooks(api: AsyncClient, args: argparse.Namespace) -> str | None:
    if args.action == "add":
        body: dict[str, Any] = {"url": args.url, "events": args.event}
        for field, value in (
            ("id", args.id),
            ("schedule_id", args.schedule),
            ("namespace", args.namespace),
            ("secret", os.environ.get("HASCHEDULER_WEBHOOK_SECRET")),
        ):
            if value is not None:
                body[field] = value
        made = await api.create_webhook(body)
        return (
            _shown(made)
            if args.json
            else (
                f"webhook {made.id}: {', '.join(made.events)} of {made.namespace}"
                f"{'/' + made.schedule_id if made.schedule_id else ''} to {made.url}\n"
                f"secret (shown once): {made.secret}"
            )
        )
    if args.action == "list":
        hooks = (await api.webhooks(args.namespace)).items
        if args.json:
            return _shown({"items": [h.model_dump(mode="json") for h in hooks]})
        return table(
            [[h.id, h.namespace, h.schedule_id or "*", ",".join(h.events), h.url] for h in hooks],
            ["ID", "NAMESPACE", "SCHEDULE", "EVENTS", "URL"],
        )
    if args.action == "show":
        return _shown(await api.get_webhook(args.id))
    if args.action == "delete":
        await api.delete_webhook(args.id)
        return None if not args.json else json.dumps({"deleted": args.id})
    if not 1 <= args.limit <= MAX_PAGE:
        raise Refused(f"--limit must be from 1 to {MAX_PAGE}")
    found = await api.webhook_deliveries(args.id, args.limit)
    if args.json:
        return json.dumps(found, indent=2)
    return table(
        [
            [
                d["id"].partition(":")[2],
                d["type"],
                d["state"],
                str(d["attempts"]),
                str(d.get("last_status") or "-"),
                (d.get("last_error") or "")[:60],
            ]
            for d in found["items"]
        ],
        ["EVENT", "TYPE", "STATE", "ATTEMPTS", "LAST STATUS", "LAST ERROR"],
    )
