"""`hascheduler dev status | kill-leader | scale | audit`: talk to a running supervisor."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from hascheduler.client.local_cluster import ControlError, call
from hascheduler.core.audit import describe

# dev audit --last ends this long ago: a fire due just before now may still be on its way.
LAST_SETTLE_S = 5.0


def run(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir)
    try:
        if args.action == "status":
            result = call(state_dir, "GET", "/status")
            if args.json:
                print(json.dumps(result))
            else:
                print(
                    f"leader: {result['leader'] or '(none)'}  term: {result['term']}  "
                    f"replicas: {len(result['replicas'])} (desired {result['desired']})"
                )
                for r in result["replicas"]:
                    state = _state(r, "ready" if r["ready"] else "running")
                    mark = "  <- leader" if r["leader"] else ""
                    print(f"  {r['id']:<5} pid {r['pid']:<8} {r['url']:<24} {state}{mark}")
                for w in result["workers"]:
                    print(f"  {w['id']:<5} pid {w['pid']:<8} {'worker':<24} {_state(w, 'running')}")
            return 0
        if args.action == "kill-leader":
            body: dict[str, Any] = {"signal": args.signal}
            if args.stop_for is not None:
                body["stop_for_s"] = args.stop_for
            result = call(state_dir, "POST", "/kill-leader", body)
            print(
                json.dumps(result)
                if args.json
                else f"SIG{result['signal']} to leader {result['killed']} (term "
                f"{result['old_term']}); new leader {result['new_leader']} (term "
                f"{result['new_term']}) after {result['takeover_ms']:.0f} ms"
            )
            return 0
        if args.action == "scale":
            result = call(state_dir, "POST", "/scale", {"replicas": args.replicas})
            print(
                json.dumps(result)
                if args.json
                else f"replicas: {', '.join(r['id'] for r in result['replicas']) or '(none)'}; "
                f"leader: {result['leader'] or '(none)'}"
            )
            return 0
        if args.action == "scale-workers":
            result = call(state_dir, "POST", "/scale-workers", {"workers": args.workers})
            print(
                json.dumps(result)
                if args.json
                else f"workers: {', '.join(w['id'] for w in result['workers']) or '(none)'}"
            )
            return 0
        if args.action == "audit":
            since, until = args.since, args.until
            if args.last is not None:
                end = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=LAST_SETTLE_S)
                since = (end - dt.timedelta(seconds=args.last)).isoformat()
                until = end.isoformat()
            elif until is None:
                print("hascheduler dev audit: --since needs --until", file=sys.stderr)
                return 2
            query = urllib.parse.urlencode({"since": since, "until": until})
            result = call(state_dir, "GET", f"/audit?{query}")
            print(json.dumps(result) if args.json else describe(result))
            return 0 if result["ok"] else 1
    except ControlError as exc:
        print(f"hascheduler dev {args.action}: {exc}", file=sys.stderr)
        return 1
    return 2


def _state(child: dict[str, Any], alive: str) -> str:
    """A child as ``dev status`` shows it: stopped (SIGSTOP), exited, or ``alive``."""
    if not child["alive"]:
        return "exited"
    return "stopped" if child.get("stopped") else alive
