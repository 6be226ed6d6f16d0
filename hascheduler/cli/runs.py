"""``hascheduler runs ...``: what the workers made of the fires, from a terminal."""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

from hascheduler.cli.output import runs_table
from hascheduler.cli.remote import Actions, Refused, schedule_handle
from hascheduler.client import AsyncClient, HaschedulerError, calls
from hascheduler.core.run_states import STATES as RUN_STATES


def add_parser(sub: Any, common: argparse.ArgumentParser) -> Any:
    rn = sub.add_parser(
        "runs",
        parents=[common],
        help="what the workers made of the fires: list, show, retry dead runs, cancel",
    )
    cmd = Actions(rn)
    ls = cmd.add_parser("list", help="runs, most recently changed first")
    ls.add_argument("--state", choices=RUN_STATES, help="only the runs in this state")
    ls.add_argument(
        "--schedule", help="the runs of one schedule's fires, by its id or name (newest first)"
    )
    ls.add_argument("--limit", type=int, default=50, help="at most this many (50)")
    ls.add_argument(
        "--after", help="the next a previous --json list gave (the fire id of its last run)"
    )
    show = cmd.add_parser("show", help="one run")
    show.add_argument("fire_id", help="the run's fire id (runs list shows them)")
    retry = cmd.add_parser("retry", help="replay a dead run")
    retry.add_argument("fire_id", help="a dead run's fire id")
    cancel = cmd.add_parser(
        "cancel", help="cancel a run (a running one is stopped by its worker within a second)"
    )
    cancel.add_argument("fire_id", help="the run's fire id")
    return rn


async def command(api: AsyncClient, args: argparse.Namespace) -> str:
    if args.action == "list":
        if not 1 <= args.limit <= 500:
            raise Refused("--limit must be from 1 to 500")
        if args.schedule:
            if args.state or args.after:
                raise Refused("--schedule lists one schedule's runs: without --state/--after")
            schedule = await schedule_handle(api, args.schedule, args.namespace)
            body = await api.schedule_runs(schedule, args.limit)
        else:
            items, after = await api.send(
                calls.runs_page(args.state, args.after, args.limit, args.namespace)
            )
            body = {"items": items, "next": after}
        if args.json:
            return json.dumps(body, indent=2)
        return runs_table(body["items"], await _names(api, body["items"]))
    if args.action == "show":
        return json.dumps(await api.get_run(args.fire_id), indent=2)
    changed = await (
        api.retry_run(args.fire_id) if args.action == "retry" else api.cancel_run(args.fire_id)
    )
    return json.dumps(changed, indent=2) if args.json else runs_table([changed])


async def _names(api: AsyncClient, runs: list[dict[str, Any]]) -> dict[str, str]:
    """The name of each schedule these runs belong to (one read each; a deleted one's
    id stands for it)."""
    names = {}
    for schedule_id in {str(r["schedule_id"]) for r in runs if r.get("schedule_id")}:
        with contextlib.suppress(HaschedulerError):
            names[schedule_id] = (await api.get_schedule(schedule_id)).name
    return names
