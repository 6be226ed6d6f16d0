"""`hascheduler dev status | kill-leader | scale | audit`: talk to a running supervisor."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ..brokers import broker_from_url
from .audit import describe
from .supervisor import STATE_FILE


class ControlError(Exception):
    """No running cluster, or it refused the request (message says why)."""


def control_url(state_dir: Path) -> str:
    try:
        return str(json.loads((state_dir / STATE_FILE).read_text())["control_url"])
    except (OSError, ValueError, KeyError):
        raise ControlError(f"no running cluster found in {state_dir}/ "
                           "(start one with `hascheduler dev`)") from None


def call(state_dir: Path, method: str, path: str, body: dict[str, Any] | None = None,
         timeout_s: float = 120.0) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(control_url(state_dir) + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError):
            detail = json.loads(detail).get("error", detail)
        raise ControlError(detail) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ControlError(f"the cluster's control API does not answer: {exc}") from None


def run(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir)
    try:
        if args.action == "status":
            result = call(state_dir, "GET", "/status")
            if args.json:
                print(json.dumps(result))
            else:
                print(f"leader: {result['leader'] or '(none)'}  term: {result['term']}  "
                      f"replicas: {len(result['replicas'])} (desired {result['desired']})")
                for r in result["replicas"]:
                    state = "ready" if r["ready"] else ("running" if r["alive"] else "exited")
                    mark = "  <- leader" if r["leader"] else ""
                    print(f"  {r['id']:<5} pid {r['pid']:<8} {r['url']:<24} {state}{mark}")
                for w in result["workers"]:
                    print(f"  {w['id']:<5} pid {w['pid']:<8} {'worker':<24} "
                          f"{'running' if w['alive'] else 'exited'}")
            return 0
        if args.action == "kill-leader":
            body: dict[str, Any] = {"signal": args.signal}
            if args.stop_for is not None:
                body["stop_for_s"] = args.stop_for
            result = call(state_dir, "POST", "/kill-leader", body)
            print(json.dumps(result) if args.json else
                  f"SIG{result['signal']} to leader {result['killed']} (term "
                  f"{result['old_term']}); new leader {result['new_leader']} (term "
                  f"{result['new_term']}) after {result['takeover_ms']:.0f} ms")
            return 0
        if args.action == "scale":
            result = call(state_dir, "POST", "/scale", {"replicas": args.replicas})
            print(json.dumps(result) if args.json else
                  f"replicas: {', '.join(r['id'] for r in result['replicas']) or '(none)'}; "
                  f"leader: {result['leader'] or '(none)'}")
            return 0
        if args.action == "scale-workers":
            result = call(state_dir, "POST", "/scale-workers", {"workers": args.workers})
            print(json.dumps(result) if args.json else
                  f"workers: {', '.join(w['id'] for w in result['workers']) or '(none)'}")
            return 0
        if args.action == "audit":
            query = urllib.parse.urlencode({"since": args.since, "until": args.until})
            result = call(state_dir, "GET", f"/audit?{query}")
            print(json.dumps(result) if args.json else describe(result))
            return 0 if result["ok"] else 1
    except ControlError as exc:
        print(f"hascheduler dev {args.action}: {exc}", file=sys.stderr)
        return 1
    return 2


def add_parser(sub: Any) -> None:
    dev = sub.add_parser("dev", help="run the whole cluster locally (development MongoDB "
                                     "server, nats-server, replicas, a worker); or control it")
    dev.add_argument("--state-dir", default=".hascheduler-dev",
                     help="where the running cluster keeps its logs and control address")
    dev.add_argument("--replicas", type=_count, default=3, help="scheduler replicas (3)")
    dev.add_argument("--workers", type=_count, default=1,
                     help="workers running the fires (1; none with --broker log:)")
    dev.add_argument("--broker", type=_broker_url, default=None,
                     help="where fires go, as for serve: nats://host:port (a server already "
                          "running) or log: (log lines, no worker); rabbitmq: a RabbitMQ "
                          "node of its own (Debian's rabbitmq-server), its workers on it; "
                          "default: a nats-server of its own")
    dev.add_argument("--nats-cluster", type=_nodes, default=1, metavar="N",
                     help="nats-servers of its own: 1, or a JetStream cluster of N (3 for "
                          "the fire stream replicated 3 ways)")
    dev.add_argument("--control-port", type=int, default=0,
                     help="port of the loopback control API (0: any free port)")
    # Accepted after the action too (`dev status --state-dir D`); SUPPRESS keeps a value
    # given before the action from being reset by the action's default.
    located = argparse.ArgumentParser(add_help=False)
    located.add_argument("--state-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    actions = dev.add_subparsers(
        dest="action", metavar="[status | kill-leader | scale | scale-workers | audit]")
    status = actions.add_parser("status", help="replicas, leader and term", parents=[located])
    status.add_argument("--json", action="store_true")
    kill = actions.add_parser("kill-leader", help="signal the leader; print the takeover time",
                               parents=[located])
    kill.add_argument("--signal", choices=["KILL", "TERM", "STOP"], default="KILL")
    kill.add_argument("--stop-for", type=float, default=None,
                      help="with STOP: seconds before SIGCONT, at least the lease ttl "
                           "(default 2 x lease ttl)")
    kill.add_argument("--json", action="store_true")
    scale = actions.add_parser("scale", help="change the number of replicas",
                               parents=[located])
    scale.add_argument("replicas", type=_count)
    scale.add_argument("--json", action="store_true")
    scale_workers = actions.add_parser("scale-workers", help="change the number of workers",
                                       parents=[located])
    scale_workers.add_argument("workers", type=_count)
    scale_workers.add_argument("--json", action="store_true")
    audit = actions.add_parser("audit", help="count fires in the broker stream: exit 1 if any "
                                             "was missed or duplicated", parents=[located])
    audit.add_argument("--since", required=True, help="ISO-8601 instant with offset")
    audit.add_argument("--until", required=True, help="ISO-8601 instant with offset")
    audit.add_argument("--json", action="store_true")


def _broker_url(text: str) -> str:
    """The same broker URLs serve takes (checked by building its broker, unstarted), or
    rabbitmq."""
    if text == "rabbitmq":
        return text
    try:
        broker_from_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _nodes(text: str) -> int:
    """A NATS cluster's size: at least one server, and few enough for one machine."""
    value = _count(text)
    if not 1 <= value <= 7:
        raise argparse.ArgumentTypeError(f"{value} is not from 1 to 7 nats-servers")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value <= 20:
        raise argparse.ArgumentTypeError(f"{value} is not from 0 to 20")
    return value
