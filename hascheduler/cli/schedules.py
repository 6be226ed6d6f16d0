"""``hascheduler schedules ...`` and ``hascheduler audit-log``: the HTTP API from a
terminal, as tables or JSON; ``runs`` and ``webhooks`` are rooms of their own
(cli/runs.py, cli/webhooks.py), and what they all share is cli/remote.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from hascheduler.cli import backfills, runs, webhooks
from hascheduler.cli.output import audit_output, health_text, schedule_rows, shown, table
from hascheduler.cli.remote import (
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    Actions,
    Refused,
    Unavailable,
    common_options,
    duration,
    resolve_api,
    schedule_handle,
)
from hascheduler.client import AsyncClient, HaschedulerError, calls
from hascheduler.core.constants import MAX_PAGE
from hascheduler.core.fields import SLUG, loads
from hascheduler.core.overlap import POLICIES

HANDLE = "the schedule: its id, or its name (unique in its namespace)"


def add_parser(sub: Any) -> None:  # noqa: PLR0915 (the subcommands' table, one statement per flag)
    common = common_options(after_action=False)
    runs.add_parser(sub, common).set_defaults(run=_run_sync)
    webhooks.add_parser(sub, common).set_defaults(run=_run_sync)
    backfills.add_parser(sub, common).set_defaults(run=_run_sync)
    sc = sub.add_parser(
        "schedules",
        parents=[common],
        help="add, list, change and preview schedules over the HTTP API",
    )
    sc.set_defaults(run=_run_sync)
    cmd = Actions(sc)

    add = cmd.add_parser("add", help="create a schedule")
    add.add_argument("--file", help="a schedule as JSON (- for standard input)")
    add.add_argument(
        "--id", help="its id, a slug (default: its --name, when that is one): the handle to use"
    )
    add.add_argument("--name", help="what it is called; also a handle where an id is taken")
    add.add_argument("--target", help="broker subject suffix or routing key")
    kind = add.add_mutually_exclusive_group()
    kind.add_argument("--cron", help="5 or 6 fields, crontab syntax")
    kind.add_argument("--every", help="a duration: seconds, 30s, 5m, 1h30m, or ISO-8601 (PT30S)")
    kind.add_argument("--at", action="append", help="an instant (ISO-8601); repeat for more")
    add.add_argument("--timezone", help="IANA zone for --cron (default UTC)")
    add.add_argument("--start-at", help="anchor of an --every grid")
    add.add_argument("--end-at", help="last possible time of an --every schedule")
    add.add_argument(
        "--jitter",
        type=float,
        help="seconds each fire is moved by, at most (the same each time)",
    )
    add.add_argument("--payload", help="a JSON object")
    add.add_argument(
        "--fan-out",
        help='one run per tenant, as JSON: {"collection": '
        '"tenants", "filter": {"active": true}, "key": "_id"}',
    )
    add.add_argument("--label", action="append", default=[], help="key=value; repeatable")
    add.add_argument("--paused", action="store_true", help="create it paused")
    add.add_argument(
        "--catchup",
        choices=["latest", "all", "none"],
        help="fires missed while no leader fired: the latest, all, or none (default latest)",
    )
    add.add_argument(
        "--catchup-window", type=float, help="seconds back a catch-up may reach (default 3600)"
    )
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
    ls.add_argument("--paused", choices=["true", "false"], help="only the paused, or the others")
    ls.add_argument("--limit", type=int, default=100, help="at most this many (100)")
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
    hl.add_argument("id", help=HANDLE)

    for name, text in (
        ("get", "show one schedule"),
        ("delete", "delete a schedule"),
        ("pause", "pause a schedule"),
        ("resume", "resume a schedule"),
    ):
        p = cmd.add_parser(name, help=text)
        p.add_argument("id", help=HANDLE)
        if name != "get":
            p.add_argument("--if-match", type=int, help="expected revision")
        if name == "pause":
            p.add_argument("--note", help="why (shown with the schedule)")
            p.add_argument("--until", help="resume by itself at this instant (RFC 3339)")

    up = cmd.add_parser(
        "update", help="change a schedule: --set applies a JSON merge patch, --file replaces it"
    )
    up.add_argument("id", help=HANDLE)
    change = up.add_mutually_exclusive_group(required=True)
    change.add_argument("--set", dest="patch", help="JSON merge patch, e.g. '{\"jitter\": 5}'")
    change.add_argument("--file", help="the whole schedule as JSON (- for standard input)")
    up.add_argument("--if-match", type=int, help="expected revision")

    tr = cmd.add_parser("trigger", help="run a schedule now (a fire outside its trigger)")
    tr.add_argument("id", help=HANDLE)
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
    bf.add_argument("id", help=HANDLE)
    bf.add_argument("--start", required=True, help="RFC 3339, inclusive")
    bf.add_argument("--end", required=True, help="RFC 3339, exclusive, not in the future")
    bf.add_argument("--overlap", choices=POLICIES, help="the backfilled fires' policy")

    nx = cmd.add_parser("next", help="preview the next fire times")
    nx.add_argument("id", help=HANDLE)
    nx.add_argument("--count", type=int, default=5, help="how many fire times (5)")
    nx.add_argument("--after", help="from this instant (RFC 3339; default now)")

    hi = cmd.add_parser("history", help="a schedule's audit records, newest first")
    hi.add_argument("id", help=HANDLE)
    hi.add_argument("--limit", type=int, default=20, help="at most this many records (20)")

    rs = cmd.add_parser(
        "restore", help="put back the fields a schedule had at an earlier revision of its history"
    )
    rs.add_argument("id", help=HANDLE)
    rs.add_argument("--revision", type=int, required=True, help="the revision to put back")
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
    al.add_argument("--limit", type=int, default=50, help="at most this many records (50)")


def _json_arg(text: str, what: str) -> Any:
    try:
        return loads(text)
    except ValueError as exc:
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


def _trigger(args: argparse.Namespace) -> dict[str, Any]:
    """The trigger the add command's flags describe. Raises Refused."""
    trigger: dict[str, Any]
    if args.cron:
        trigger = {"kind": "cron", "cron": args.cron}
        if args.timezone:
            trigger["timezone"] = args.timezone
    elif args.every:
        trigger = {"kind": "interval", "every": duration(args.every, "--every")}
        for key in ("start_at", "end_at"):
            if getattr(args, key):
                trigger[key] = getattr(args, key)
    elif args.at:
        trigger = {"kind": "at", "at": args.at}
    else:
        raise Refused("give one trigger: --cron, --every or --at")
    return trigger


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
    trigger = _trigger(args)
    body: dict[str, Any] = {
        "name": args.name,
        "target": args.target,
        "trigger": trigger,
        "labels": _labels(args.label),
        "paused": args.paused,
    }
    if args.id is None and SLUG.fullmatch(args.name):  # the name, a handle as it is
        body["id"] = args.name
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


def _run_sync(args: argparse.Namespace) -> int:
    return asyncio.run(run(args))


async def run(args: argparse.Namespace) -> int:
    what = f"hascheduler {args.command} {args.action}"
    try:
        base = resolve_api(args.api)
        async with AsyncClient(base, args.token, attempts=1, reason=args.reason) as api:
            output: str | None
            if args.command == "runs":
                output = await runs.command(api, args)
            elif args.command == "webhooks":
                output = await webhooks.command(api, args)
            elif args.command == "backfills":
                output = await backfills.command(api, args)
            elif args.command == "audit-log":
                output = audit_output(
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
                output = await _dispatch(api, args)
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


async def _dispatch(api: AsyncClient, args: argparse.Namespace) -> str | None:  # noqa: C901 (one branch per subcommand)
    if_match = getattr(args, "if_match", None)
    # The input read first: a refused one is said without a call to the API.
    payload = (
        None if getattr(args, "payload", None) is None else _json_arg(args.payload, "--payload")
    )
    patch = _json_arg(args.patch, "--set") if getattr(args, "patch", None) else None
    sid: str = getattr(args, "id", None) or ""
    if sid and args.action != "add":
        sid = await schedule_handle(api, sid, args.namespace)
    if args.action == "add":
        body = schedule_body(args)
        if args.namespace is not None:
            body.setdefault("namespace", args.namespace)
        created = await api.create_schedule(body)
        return shown(created) if args.json else schedule_rows([created])
    if args.action == "list":
        paused = None if args.paused is None else args.paused == "true"
        if args.health or not args.json:  # the table's LAST column is the health's
            page = await api.send(
                calls.schedules_health_page(
                    _labels(args.label), paused, None, args.limit, args.namespace
                )
            )
            if args.json:
                return shown(page.model_dump(mode="json", exclude_none=True))
            return schedule_rows(page.items, page.health or {}, judged=args.health)
        items, after = await api.send(
            calls.schedules_page(_labels(args.label), paused, None, args.limit, args.namespace)
        )
        return shown({"items": [i.model_dump(mode="json") for i in items], "next": after})
    if args.action == "health":
        health = await api.health(sid)
        return shown(health) if args.json else health_text(health)
    if args.action == "get":
        return shown(await api.get_schedule(sid))
    if args.action == "update":
        if args.file:
            changed = await api.replace_schedule(sid, _read_file(args.file), if_match)
        else:
            changed = await api.patch_schedule(sid, patch or {}, if_match)
        return shown(changed) if args.json else schedule_rows([changed])
    if args.action in {"pause", "resume"}:
        if args.action == "pause":
            changed = await api.pause(sid, args.note, args.until, if_match)
        else:
            changed = await api.resume(sid, if_match)
        return shown(changed) if args.json else schedule_rows([changed])
    if args.action == "delete":
        await api.delete_schedule(sid, if_match)
        return None if not args.json else json.dumps({"deleted": sid})
    if args.action == "trigger":
        fired = await api.trigger(
            sid, payload, args.overlap, args.force, args.idempotency_key, args.priority
        )
        return shown(fired) if args.json else fired.fire_id
    if args.action == "backfill":
        answer = await api.backfill(sid, args.start, args.end, args.overlap)
        return (
            shown(answer)
            if args.json
            else (
                f"backfill {answer['id']}: {answer['total']} fire times; its progress: "
                f"hascheduler backfills show {answer['id']}"
            )
        )
    if args.action == "history":
        return audit_output(
            await _first(api.history(sid, min(args.limit, MAX_PAGE)), args.limit), args.json
        )
    if args.action == "restore":
        restored = await api.restore(sid, args.revision, if_match)
        return shown(restored) if args.json else schedule_rows([restored])
    if args.action == "next":
        preview = await api.next_fires(sid, args.count, args.after)
        if args.json:
            return shown(preview)
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
