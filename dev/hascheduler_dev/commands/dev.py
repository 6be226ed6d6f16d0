"""``hascheduler dev``: run the whole cluster locally (devcluster/supervisor.py), or, with
an action, control the one running from this directory (devcluster/control.py)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from hascheduler.brokers.registry import parse_broker_url
from hascheduler.client.local_cluster import DEFAULT_STATE_DIR
from hascheduler_dev.devcluster import control, supervisor


def add_parser(sub: Any) -> None:
    dev = sub.add_parser(
        "dev",
        help="run the whole cluster locally (development MongoDB "
        "server, nats-server, replicas, a worker); or control it",
    )
    dev.add_argument(
        "--state-dir",
        default=DEFAULT_STATE_DIR,
        help="where the running cluster keeps its logs and control address",
    )
    dev.add_argument("--replicas", type=_replicas, default=3, help="scheduler replicas (3)")
    dev.add_argument(
        "--app",
        action="append",
        default=[],
        metavar="MODULE:APP",
        help="your handlers: a hascheduler.worker.WorkerApp importable from this directory "
        "(repeatable; each runs in --workers workers). Without it, a demo worker logs the "
        "fires of demo.* targets and takes no other",
    )
    dev.add_argument(
        "--workers",
        type=_count,
        default=1,
        help="workers running the fires (1; none with --broker log:)",
    )
    dev.add_argument(
        "--broker",
        type=_broker_url,
        default=None,
        help="where fires go, as for serve: nats://host:port (a server already "
        "running) or log: (log lines, no worker); rabbitmq: a RabbitMQ "
        "node of its own (Debian's rabbitmq-server), its workers on it; "
        "default: a nats-server of its own",
    )
    dev.add_argument(
        "--nats-cluster",
        type=_nodes,
        default=1,
        metavar="N",
        help="nats-servers of its own: 1, or a JetStream cluster of N (3 for "
        "the fire stream replicated 3 ways)",
    )
    dev.add_argument(
        "--control-port",
        type=int,
        default=0,
        help="port of the loopback control API (0: any free port)",
    )
    # Accepted after the action too (`dev status --state-dir D`); SUPPRESS keeps a value
    # given before the action from being reset by the action's default.
    located = argparse.ArgumentParser(add_help=False)
    located.add_argument("--state-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    actions = dev.add_subparsers(
        dest="action", metavar="[status | kill-leader | scale | scale-workers | audit]"
    )
    status = actions.add_parser("status", help="replicas, leader and term", parents=[located])
    status.add_argument("--json", action="store_true")
    kill = actions.add_parser(
        "kill-leader", help="signal the leader; print the takeover time", parents=[located]
    )
    kill.add_argument("--signal", choices=["KILL", "TERM", "STOP"], default="KILL")
    kill.add_argument(
        "--stop-for",
        type=float,
        default=None,
        help="with STOP: seconds before SIGCONT, at least the lease ttl (default 2 x lease ttl)",
    )
    kill.add_argument("--json", action="store_true")
    scale = actions.add_parser("scale", help="change the number of replicas", parents=[located])
    scale.add_argument("replicas", type=_replicas)
    scale.add_argument("--json", action="store_true")
    scale_workers = actions.add_parser(
        "scale-workers", help="change the number of workers", parents=[located]
    )
    scale_workers.add_argument("workers", type=_count)
    scale_workers.add_argument("--json", action="store_true")
    audit = actions.add_parser(
        "audit",
        help="count fires in the broker stream: exit 1 if any was missed or duplicated",
        parents=[located],
    )
    window = audit.add_mutually_exclusive_group(required=True)
    window.add_argument("--since", help="ISO-8601 instant with offset (with --until)")
    window.add_argument(
        "--last",
        type=_duration,
        metavar="DURATION",
        help="the window ending 5 s ago, this long (30s, 5m, 1h): the fires "
        "due in it have had time to reach the stream",
    )
    audit.add_argument("--until", help="ISO-8601 instant with offset (with --since)")
    audit.add_argument("--json", action="store_true", help="print the report as JSON")
    dev.set_defaults(run=run)


def _duration(text: str) -> float:
    from hascheduler.cli.remote import Refused, duration

    try:
        seconds = duration(text, "--last")
    except Refused as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if isinstance(seconds, str) or not 0 < seconds <= 86_400:
        raise argparse.ArgumentTypeError("--last: a duration from 1s to 24h, such as 2m")
    return seconds


def _broker_url(text: str) -> str:
    """The same broker URLs serve takes (checked by building its broker, unstarted), or
    rabbitmq."""
    if text == "rabbitmq":
        return text
    try:
        parse_broker_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _nodes(text: str) -> int:
    """A NATS cluster's size: at least one server, and few enough for one machine."""
    value = _count(text)
    if not 1 <= value <= 7:
        raise argparse.ArgumentTypeError(f"{value} is not from 1 to 7 nats-servers")
    return value


def _replicas(text: str) -> int:
    """A count of replicas: at least one (none would leave no API and no leader)."""
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError("at least 1: with no replica nothing fires")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value <= 20:
        raise argparse.ArgumentTypeError(f"{value} is not from 0 to 20")
    return value


def run(args: argparse.Namespace) -> int:
    if args.action is not None:
        return control.run(args)
    return asyncio.run(
        supervisor.run(
            supervisor.DevSettings(
                replicas=args.replicas,
                workers=args.workers,
                apps=tuple(args.app),
                broker=args.broker,
                nats_cluster=args.nats_cluster,
                state_dir=Path(args.state_dir),
                control_port=args.control_port,
            )
        )
    )
