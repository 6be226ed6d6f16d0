"""`hascheduler audit`: count the fires in the broker's stream against what the schedules
say was due in a window, straight from MongoDB and the broker (no replica involved): NATS
JetStream's stream, or RabbitMQ's audit queue (brokers/amqp/reader.py).

Each demo's last step: run on the host, in a container or in a pod (`kubectl exec`), it
takes the same settings as `serve` (flags or HASCHEDULER_MONGODB_URI, HASCHEDULER_BROKER).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from pymongo.errors import PyMongoError

from hascheduler.brokers.registry import BrokerUrl, parse_broker_url
from hascheduler.core.audit import audit, describe, parse_instant
from hascheduler.core.constants import DEFAULT_DATABASE, SCHEDULES
from hascheduler.core.errors import ConfigError
from hascheduler.storage.driver import connect
from hascheduler.storage.streams import read_all


def _instant(text: str) -> Any:
    try:
        return parse_instant(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO-8601 instant with a UTC offset"
        ) from None


def add_parser(sub: Any) -> None:
    au = sub.add_parser(
        "audit",
        help="count the fires in the broker stream against the "
        "schedules: exit 1 if one due in the window is "
        "missing, duplicated or unexpected",
    )
    au.add_argument(
        "--mongodb-uri",
        default=os.environ.get("HASCHEDULER_MONGODB_URI"),
        help="the cluster's MongoDB URI (env HASCHEDULER_MONGODB_URI)",
    )
    au.add_argument(
        "--broker",
        default=os.environ.get("HASCHEDULER_BROKER"),
        help="the broker URL the replicas publish to (env HASCHEDULER_BROKER)",
    )
    au.add_argument(
        "--since",
        type=_instant,
        required=True,
        help="ISO-8601 instant with offset: the window's start",
    )
    au.add_argument(
        "--until",
        type=_instant,
        required=True,
        help="ISO-8601 instant with offset: the window's end",
    )
    au.add_argument(
        "--min-expected",
        type=int,
        default=0,
        metavar="N",
        help="also fail when fewer than N fires were due in the window (a "
        "demo's guard against auditing nothing)",
    )
    au.add_argument("--json", action="store_true", help="print the report as JSON")
    au.set_defaults(run=_run_sync)


def _broker(text: str | None) -> BrokerUrl:
    try:
        url = parse_broker_url(text or "")
    except ValueError as exc:
        raise ConfigError(f"--broker / HASCHEDULER_BROKER: {exc}") from None
    if url.kind.reader is None:
        raise ConfigError(
            f"--broker {text!r}: {url.kind.name} keeps no fires to audit "
            "(NATS JetStream and RabbitMQ do)"
        )
    return url


def _run_sync(args: argparse.Namespace) -> int:
    return asyncio.run(run(args))


async def run(args: argparse.Namespace) -> int:
    if not args.mongodb_uri:
        raise ConfigError("--mongodb-uri (or HASCHEDULER_MONGODB_URI) is required")
    broker = _broker(args.broker)
    if args.since >= args.until:
        raise ConfigError("--since must be before --until")
    try:
        client = connect(args.mongodb_uri, serverSelectionTimeoutMS=10_000)
    except (PyMongoError, ValueError) as exc:
        raise ConfigError(f"--mongodb-uri: {exc}") from None
    try:
        schedules = [
            doc async for doc in read_all(client.get_default_database(DEFAULT_DATABASE)[SCHEDULES])
        ]
    finally:
        await client.close()
    events = [fire.event for fire in await broker.reader()()]
    report = audit(schedules, events, args.since, args.until).as_dict()
    print(json.dumps(report) if args.json else describe(report))
    if report["expected"] < args.min_expected:
        print(
            f"hascheduler audit: {report['expected']} fires due in the window, fewer "
            f"than --min-expected {args.min_expected}",
            file=sys.stderr,
        )
        return 1
    return 0 if report["ok"] else 1
