"""``hascheduler webhooks ...``: a namespace's events POSTed to a URL, from a terminal."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from hascheduler.cli.output import printable, shown, table
from hascheduler.cli.remote import Actions, Refused
from hascheduler.client import AsyncClient
from hascheduler.core.constants import MAX_PAGE
from hascheduler.core.models import WEBHOOK_EVENTS


def add_parser(sub: Any, common: argparse.ArgumentParser) -> Any:
    wh = sub.add_parser(
        "webhooks",
        parents=[common],
        help="a namespace's events POSTed to a URL, signed: add, list, show, delete, deliveries",
    )
    cmd = Actions(wh)
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
    add.add_argument("--id", help="its id, a slug (default: generated)")
    add.add_argument("--schedule", help="only this schedule's events")
    cmd.add_parser("list", help="the webhooks the token may read")
    for name, text in (
        ("show", "one webhook (never its secret)"),
        ("delete", "delete a webhook and its deliveries"),
    ):
        cmd.add_parser(name, help=text).add_argument("id", help="the webhook's id")
    dl = cmd.add_parser(
        "deliveries", help="a webhook's deliveries, newest first, with their attempts"
    )
    dl.add_argument("id", help="the webhook's id")
    dl.add_argument("--limit", type=int, default=50, help="at most this many (50)")
    return wh


async def command(api: AsyncClient, args: argparse.Namespace) -> str | None:
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
            shown(made)
            if args.json
            else (
                f"webhook {made.id}: {', '.join(made.events)} of {made.namespace}"
                f"{'/' + made.schedule_id if made.schedule_id else ''} to {printable(made.url)}\n"
                f"secret (shown once): {made.secret}"
            )
        )
    if args.action == "list":
        hooks = (await api.webhooks(args.namespace)).items
        if args.json:
            return shown({"items": [h.model_dump(mode="json") for h in hooks]})
        return table(
            [[h.id, h.namespace, h.schedule_id or "*", ",".join(h.events), h.url] for h in hooks],
            ["ID", "NAMESPACE", "SCHEDULE", "EVENTS", "URL"],
        )
    if args.action == "show":
        return shown(await api.get_webhook(args.id))
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
