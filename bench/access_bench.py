"""Many teams on one cluster: the audit trail's cost on the create rate, and a token's
check with 10,000 tokens configured.

    python -m bench.access_bench [--creates 2000] [--concurrency 16] [--checks 50000]

- Create rate: POST /schedules with --concurrency in flight, against the API served in
  this process over HTTP, the development MongoDB server in its own; with the audit trail
  (each create carries its record, a relay copies records into the trail) against the same
  API whose store attaches no record, same run, rounds alternated. Target: at least 0.8x.
- Authorisation: authenticating a named token and checking its action and namespace, with
  10,000 named tokens configured against 1, same run. Target: within 1.1x.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from pymongo import AsyncMongoClient

from bench.api_bench import body, timed
from hascheduler.api.access import (
    Access,
    Action,
    Grant,
    NewToken,
    WriteLimit,
    authenticate,
    create_token,
    entry_line,
)
from hascheduler.api.access_file import with_file
from hascheduler.api.routes import create_app
from hascheduler.core.history import Actor
from hascheduler.core.models import ScheduleIn
from hascheduler.replica.mirror import Mirror
from hascheduler.storage.audit_log import AuditLog
from hascheduler.storage.schedules import ScheduleStore
from tests.servers import start_devmongo

ROUNDS = 3


async def serve(db: Any, recorded: bool) -> tuple[web.AppRunner, str, AuditLog]:
    audit = AuditLog(db.audit, [db.schedules] if recorded else [])
    store = ScheduleStore(db.schedules, audit=audit) if recorded else _unrecorded(db.schedules)
    app = create_app(
        store, Mirror(db.schedules), "bench", audit, write_limit=WriteLimit(per_second=0)
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", audit


def _unrecorded(collection: Any) -> ScheduleStore:
    store = ScheduleStore(collection)

    def plain(new: ScheduleIn, now: dt.datetime, actor: Actor, trace: str | None) -> dict[str, Any]:
        doc = ScheduleStore._new_document(store, new, now, actor, trace)
        return {k: v for k, v in doc.items() if k not in ("audit_outbox", "audit_pending")}

    store._new_document = plain  # type: ignore[method-assign]
    return store


async def create_rates(uri: str, n: int, concurrency: int) -> tuple[list[float], list[float]]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
    on: list[float] = []
    off: list[float] = []
    try:
        for round_ in range(ROUNDS):
            for recorded in (True, False):
                db = client[f"access_bench_{round_}_{int(recorded)}"]
                runner, url, audit = await serve(db, recorded)
                relay = asyncio.create_task(audit.run())
                try:
                    async with aiohttp.ClientSession() as http:

                        def post(i: int, url: str = url) -> Any:
                            async def call() -> None:
                                async with http.post(f"{url}/schedules", json=body(i, "a")) as r:
                                    if r.status != 201:
                                        raise RuntimeError(f"{r.status} {await r.text()}")

                            return call

                        seconds, _ = await timed([post(i) for i in range(n)], concurrency)
                    (on if recorded else off).append(n / seconds)
                    if recorded:
                        await audit.relay()
                        assert await db.audit.count_documents({}) == n
                finally:
                    audit.stop()
                    await relay
                    await runner.cleanup()
                    await client.drop_database(db.name)
    finally:
        await client.close()
    return on, off


def check_cost(tokens: int, checks: int) -> tuple[float, float]:
    """Nanoseconds per check with ``tokens`` named tokens configured, and with one."""
    made = [
        create_token(f"t{i}", frozenset({Action.READ}), frozenset({f"ns{i % 50}"}))
        for i in range(tokens)
    ]
    folder = Path(tempfile.mkdtemp(prefix="access-bench-"))

    def access_of(entries: list[NewToken], name: str) -> Access:
        path = folder / name
        path.write_text("tokens:\n" + "".join(entry_line(e.entry) + "\n" for e in entries))
        return with_file(Access(), str(path))

    many, one = access_of(made, "many.yaml"), access_of(made[-1:], "one.yaml")
    header = f"Bearer {made[-1].secret}"
    timings: dict[int, list[float]] = {1: [], tokens: []}
    for _ in range(5):
        for access, size in ((many, tokens), (one, 1)):
            started = time.perf_counter_ns()
            for _ in range(checks):
                grant = authenticate(access, header)
                if not isinstance(grant, Grant) or not grant.allows(Action.READ, "ns49"):
                    raise RuntimeError("the token was not accepted")
            timings[size].append((time.perf_counter_ns() - started) / checks)
    return statistics.median(timings[tokens]), statistics.median(timings[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--creates", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--checks", type=int, default=50_000)
    parser.add_argument("--tokens", type=int, default=10_000)
    args = parser.parse_args()
    mongo = start_devmongo()
    try:
        on, off = asyncio.run(create_rates(mongo.uri, args.creates, args.concurrency))
    finally:
        mongo.stop(signal.SIGKILL)
    many_ns, one_ns = check_cost(args.tokens, args.checks)
    rate_on, rate_off = statistics.median(on), statistics.median(off)
    print("| what | with | baseline | ratio |")
    print("|---|---|---|---|")
    print(
        f"| POST /schedules, {args.concurrency} in flight (creates/s, median of {ROUNDS} "
        f"rounds of {args.creates:,}) | audit trail: {rate_on:,.0f} | no record: "
        f"{rate_off:,.0f} | {rate_on / rate_off:.2f}x |"
    )
    print(
        f"| authenticate + check a named token (ns per request) | {args.tokens:,} tokens: "
        f"{many_ns:,.0f} | 1 token: {one_ns:,.0f} | {many_ns / one_ns:.2f}x |"
    )
    print()
    print(
        f"create rate with the audit trail / without: {rate_on / rate_off:.2f}x (target "
        f">= 0.8x); token check with {args.tokens:,} tokens / 1: {many_ns / one_ns:.2f}x "
        "(target <= 1.1x)"
    )


if __name__ == "__main__":
    main()
