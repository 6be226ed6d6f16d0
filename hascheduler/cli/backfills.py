"""``hascheduler backfills ...``: a backfill's progress, and its cancel, from a terminal."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hascheduler.cli.output import table
from hascheduler.cli.remote import Actions
from hascheduler.client import AsyncClient


def add_parser(sub: Any, common: argparse.ArgumentParser) -> Any:
    bf = sub.add_parser(
        "backfills",
        parents=[common],
        help="backfills (schedules backfill starts one): show one's progress, cancel it",
    )
    cmd = Actions(bf)
    for name, text in (("show", "a backfill's progress"), ("cancel", "stop a backfill")):
        cmd.add_parser(name, help=text).add_argument(
            "id", help="the backfill's id (schedules backfill prints it)"
        )
    return bf


async def command(api: AsyncClient, args: argparse.Namespace) -> str:
    doc = await (
        api.get_backfill(args.id) if args.action == "show" else api.cancel_backfill(args.id)
    )
    if args.json:
        return json.dumps(doc, indent=2)
    fields = ("id", "schedule_id", "state", "total", "fired", "skipped", "withdrawn")
    return table([[str(doc.get(f, "-")) for f in fields]], [f.upper() for f in fields])
