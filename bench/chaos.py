"""Chaos soak: the local cluster under random faults, checked by an independent auditor.

    scripts/chaos.py --duration 300 --replicas 3 --schedules 60 --seed 7 [--out DIR]

Runs `hascheduler dev`'s cluster (development MongoDB server, nats-server with JetStream,
N replicas kept at N like a Deployment, --workers workers running bench/chaos_worker.py's
handler, which fails at --fail-rate), creates --schedules schedules over
the HTTP API (policy `all`: every nominal time must fire), then for --duration seconds
injects one of these faults at random moments (seeded; one every --fault-every seconds on
average; each kind that applies once before any repeats), then lets it run --calm seconds
without faults:

- SIGKILL, SIGTERM, SIGSTOP/SIGCONT of the leader, and of a standby;
- a failCommand cut-off (every command's connection closed) or stall (every command
  blocked) of one replica's database connections, picked by its appName;
- a nats-server restart (same port and JetStream store);
- with --nats-cluster 3 (the default): SIGKILL of a NATS node, half the time the one
  leading the fire stream (the supervisor starts it again, as a StatefulSet would);
- a step-down of the database (replSetStepDown: an election);
- a stall of the development MongoDB server itself (SIGSTOP/SIGCONT);
- SIGKILL of a worker (restarted under its name), SIGSTOP/SIGCONT of one.

Beside the faults, the run control meets them: every --pauses-every seconds a pause until
an instant a few seconds on, of an every-second schedule (an API call to a replica picked
at random); every --backfills-every seconds a backfill of a minute of an every-second
schedule, long before the window (each its own range); and some every-second schedules
have `overlap: buffer_one`, so a worker stopped or killed mid-run holds their next fire
back and skips the ones after it.

Afterwards every fault is healed and the auditor (bench/chaos_audit.py, no scheduler code)
reads the whole stream: each (schedule, nominal time) due in the window must be there
exactly once, never early, and outside fault windows within --late-bound seconds; one a
pause covered at most once, every one from its end on exactly once; one of a buffer_one
schedule either there once or recorded skipped in the ledger (read back), never both; each
instant of each backfill once, and the backfill's record done with every one fired. Then
every fire in the stream must end in the runs ledger `succeeded` (its side effect done) or,
for the fires the handler dooms, `dead` with its error; none lost or left running, and a
side effect done twice only by a worker the soak interrupted. Prints a
table, writes report.json, timeline.png and failover-gaps.png into --out, and exits 1 when
any check fails (2 on bad arguments).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from hascheduler_dev.clocks import moved_clock_env
from hascheduler_dev.devcluster.supervisor import (
    Child,
    DevSettings,
    Supervisor,
)
from pymongo import AsyncMongoClient

from bench.chaos_audit import (
    TENANTS,
    BackfillAudit,
    Key,
    RunsAudit,
    SoakAudit,
    SoakBackfill,
    SoakSchedule,
    Window,
    audit,
    audit_backfills,
    audit_runs,
    streamed_fire,
)
from bench.chaos_records import Fault, LeaseSample
from bench.chaos_worker import doomed
from bench.devmongo_bench import pct
from hascheduler.brokers.base import StoredFire
from hascheduler.brokers.nats.reader import read_stream, stream_leader
from hascheduler.core.triggers import iso_utc
from hascheduler.process import logs
from hascheduler.storage.lease import LeaseTimings
from hascheduler.storage.lease_history import LeaseHistory
from hascheduler.storage.reservations import open_key
from tests.waiting import wait_until

UTC = dt.UTC
TARGET = "chaos"
SOAK_TENANTS = ("acme", "globex", "initech")
# Relative weights: the leader's faults are the ones that test exactly-once.
KINDS = {
    "leader-kill": 2.0,
    "leader-term": 1.5,
    "leader-stop": 1.5,
    "standby-kill": 1.0,
    "standby-term": 1.0,
    "standby-stop": 1.0,
    "db-cutoff": 1.5,
    "db-stall": 1.0,
    "nats-restart": 1.0,
    "devmongo-stall": 1.0,
    "worker-kill": 1.0,
    "worker-stop": 1.0,
    "nats-node-kill": 1.0,
    "db-step-down": 1.0,
    # A replica restarted with its wall clock moved, ahead or behind.
    "clock-skew": 1.0,
    # With --partitions (every process in a network namespace of its own): links cut
    # with nftables.
    "leader-cut-db": 1.5,
    "leader-cut-broker": 1.0,
    "leader-isolated": 1.0,
    "leader-one-way-db": 1.0,
    "leader-lossy-db": 1.0,
    "worker-cut-db": 1.0,
}
PARTITIONS = (
    "leader-cut-db",
    "leader-cut-broker",
    "leader-isolated",
    "leader-one-way-db",
    "leader-lossy-db",
    "worker-cut-db",
)
# How long a healed fault may take to be over (a NATS node restarted, the database primary
# again) before the soak stops and says which: it never waits for ever.
RECOVERY_WITHIN_S = 120.0
# How far a clock-skew fault moves a replica's wall clock, either way: seconds to minutes.
SKEWS_S = (2.0, 5.0, 30.0, 120.0, 600.0)
# Faults that can hold a write up between its sending and its applying: a stalled
# database, and a link cut or lossy while TCP retransmits what was sent.
HOLDS_WRITES = (
    "devmongo-stall",
    "db-stall",
    "leader-cut-db",
    "leader-isolated",
    "leader-one-way-db",
    "leader-lossy-db",
)
LOSS_PERCENT = 30
DB_COMMANDS = [
    "find",
    "insert",
    "update",
    "delete",
    "findAndModify",
    "aggregate",
    "getMore",
    "count",
    "killCursors",
]
COMPLETE_WITHIN_S = 120.0  # after the last fault is healed, for the stream to be complete
# The workers' broker ack wait and run lease: a stop shorter than the lease minus one
# heartbeat interval never lets another worker take a run over.
WORKER_ACK_WAIT_S = 6.0
STREAM_LEADER = "a nats node"  # nats-node-kill picks it when injected (_nats_victim)


@dataclass
class Soak:
    args: argparse.Namespace
    settings: DevSettings
    rng: random.Random
    supervisor: Supervisor
    schedules: list[SoakSchedule] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    samples: list[LeaseSample] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)
    heals: set[asyncio.Task[None]] = field(default_factory=set)
    interrupted: set[str] = field(default_factory=set)  # workers killed or stopped
    # Schedules asked for while the faults run (whether each was created is read back
    # from the database once they are healed).
    asked: list[SoakSchedule] = field(default_factory=list)
    # Schedules asked to pause while the faults run (their pauses are read back from the
    # audit trail), and the backfills asked for.
    # (schedule id, until) -> when the request was sent: a pause takes effect at its
    # commit, after that (its audit record's time is the answering replica's clock, which
    # a clock-skew fault moves).
    pause_asked: dict[tuple[str, str], dt.datetime] = field(default_factory=dict)
    backfills: list[SoakBackfill] = field(default_factory=list)
    t0: dt.datetime = dt.datetime.min  # the window's start, set by run()

    # -- set-up ---------------------------------------------------------------------------

    def make_schedules(self, start: dt.datetime, end: dt.datetime) -> None:
        """A mix: every second (some fanning out to 3 tenants), seconds steps (some
        jittered), intervals, one-off instants."""
        rng, n = self.rng, self.args.schedules
        for i in range(n):
            sid = f"soak-{i:04d}"
            roll = i % 10
            if roll == 3:  # every second, one fire per tenant
                s = SoakSchedule(sid, "second_step", step_s=1, tenants=SOAK_TENANTS)
            elif roll < 4:
                # Every fifth of them holds a fire back while the one before runs.
                buffered = self.args.buffer_one and i % 50 in (1, 12)
                s = SoakSchedule(
                    sid, "second_step", step_s=1, overlap="buffer_one" if buffered else None
                )
            elif roll < 6:
                s = SoakSchedule(
                    sid,
                    "second_step",
                    step_s=rng.choice([2, 3, 5, 10]),
                    jitter_s=rng.choice([0.0, 0.5, 1.5]),
                )
            elif roll < 9:
                s = SoakSchedule(
                    sid,
                    "interval",
                    every_s=rng.choice([2, 3, 5, 7]),
                    anchor=start + dt.timedelta(seconds=rng.randrange(0, 7)),
                )
            else:
                span = (end - start).total_seconds()
                s = SoakSchedule(
                    sid,
                    "at",
                    instants=tuple(
                        sorted(
                            start + dt.timedelta(milliseconds=rng.randrange(0, int(span * 1000)))
                            for _ in range(5)
                        )
                    ),
                )
            self.schedules.append(s)

    async def create_schedules(self) -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(self.supervisor.mongodb_uri)
        try:
            await client.get_default_database()[TENANTS].insert_many(
                [{"_id": t} for t in SOAK_TENANTS]
            )
        finally:
            await client.close()
        api = self.supervisor.replicas[0].address
        async with aiohttp.ClientSession(headers=self.supervisor.api_headers) as http:
            for s in self.schedules:
                async with http.post(f"{api}/schedules", json=s.api_body(TARGET)) as r:
                    if r.status != 201:
                        raise RuntimeError(f"creating {s.id}: {r.status} {await r.text()}")

    async def create_while_faulted(self) -> None:
        """Every --creates-every seconds, ask a replica picked at random for a new
        schedule: one firing every second, or a one-off due within a second and a half.
        Created during a takeover or a lagging change stream, they are what the leader
        learns of late; a request the faults refuse or lose is fine (read back later)."""
        rng = random.Random(self.args.seed + 1)  # the faults' own draws stay as they were
        async with aiohttp.ClientSession(
            headers=self.supervisor.api_headers, timeout=aiohttp.ClientTimeout(total=5)
        ) as http:
            while True:
                await asyncio.sleep(self.args.creates_every)
                sid = f"soak-new-{len(self.asked):04d}"
                now = dt.datetime.now(UTC)
                now = now.replace(microsecond=now.microsecond // 1000 * 1000)  # as stored
                if len(self.asked) % 2:
                    s = SoakSchedule(
                        sid,
                        "at",
                        instants=tuple(now + dt.timedelta(milliseconds=ms) for ms in (300, 1500)),
                    )
                else:
                    s = SoakSchedule(sid, "second_step", step_s=1)
                self.asked.append(s)
                api = rng.choice(self.supervisor.replicas).address
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.post(f"{api}/schedules", json=s.api_body(TARGET)) as r:
                        await r.read()

    def run_controlled(self) -> list[SoakSchedule]:
        """The every-second schedules the soak pauses and backfills: plain ones."""
        return [
            s
            for s in self.schedules
            if s.kind == "second_step"
            and s.step_s == 1
            and not s.tenants
            and s.overlap is None
            and not s.jitter_s
            and s.created is None
        ]

    async def pause_while_faulted(self) -> None:
        """Every --pauses-every seconds, pause one of the run-controlled schedules until an
        instant 2 to 6 s on (the pause route of a replica picked at random); a request the
        faults refuse or lose is fine: what was paused is read back from the audit trail."""
        rng = random.Random(self.args.seed + 2)
        pool = self.run_controlled()
        async with aiohttp.ClientSession(
            headers=self.supervisor.api_headers, timeout=aiohttp.ClientTimeout(total=5)
        ) as http:
            while pool:
                await asyncio.sleep(self.args.pauses_every)
                s = rng.choice(pool)
                sent = dt.datetime.now(UTC)
                until = sent + dt.timedelta(seconds=rng.uniform(2.0, 6.0))
                until = until.replace(microsecond=until.microsecond // 1000 * 1000)
                self.pause_asked[(s.id, iso_utc(until))] = sent
                api = rng.choice(self.supervisor.replicas).address
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.post(
                        f"{api}/schedules/{s.id}/pause",
                        json={"until": until.isoformat(), "note": "chaos soak"},
                    ) as r:
                        await r.read()

    async def backfill_while_faulted(self) -> None:
        """Every --backfills-every seconds, a backfill of 60 whole seconds of a
        run-controlled schedule, each its own range an hour or more before the window. A
        refusal (409: paused) is dropped; an answer lost leaves a backfill that may exist,
        audited at most once."""
        rng = random.Random(self.args.seed + 3)
        pool = self.run_controlled()
        base = self.t0.replace(microsecond=0) - dt.timedelta(hours=2)
        async with aiohttp.ClientSession(
            headers=self.supervisor.api_headers, timeout=aiohttp.ClientTimeout(total=5)
        ) as http:
            while pool:
                await asyncio.sleep(self.args.backfills_every)
                s = rng.choice(pool)
                start = base + dt.timedelta(seconds=120 * len(self.backfills))
                asked = SoakBackfill(s.id, start, start + dt.timedelta(seconds=60))
                api = rng.choice(self.supervisor.replicas).address
                try:
                    async with http.post(
                        f"{api}/schedules/{s.id}/backfill",
                        json={"start": asked.start.isoformat(), "end": asked.end.isoformat()},
                    ) as r:
                        body = await r.json(content_type=None)
                        if r.status == 202:
                            asked = dataclasses.replace(asked, id=str(body["id"]))
                        elif r.status < 500:
                            continue  # refused: it does not exist
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass  # lost: it may exist
                self.backfills.append(asked)

    async def read_back_pauses(self) -> None:
        """The pauses made, from the audit trail (the API relays it before it answers):
        each schedule's [sent, until) windows join its audit, from when the soak sent the
        request that made it."""
        api = self.supervisor.replicas[0].address
        windows: dict[str, list[Window]] = {}
        async with aiohttp.ClientSession(headers=self.supervisor.api_headers) as http:
            for sid in sorted({sid for sid, _ in self.pause_asked}):
                async with http.get(f"{api}/audit", params={"schedule": sid, "limit": "500"}) as r:
                    records = (await r.json()).get("items", []) if r.status == 200 else []
                for record in records:
                    pause = (
                        ((record.get("after") or {}).get("pause") or {})
                        if record.get("action") == "pause"
                        else {}
                    )
                    if pause.get("until"):
                        until = _instant(pause["until"])
                        sent = self.pause_asked.get((sid, iso_utc(until)))
                        start = sent if sent is not None else _instant(record["at"])
                        windows.setdefault(sid, []).append((start, until))
        self.schedules = [
            dataclasses.replace(s, pauses=tuple(sorted(windows[s.id]))) if s.id in windows else s
            for s in self.schedules
        ]
        print(
            f"pauses until an instant: {sum(map(len, windows.values()))} made "
            f"on {len(windows)} schedules",
            flush=True,
        )

    async def backfill_records(self) -> dict[str, dict[str, Any]]:
        """Each answered backfill's record, once it is done (or after COMPLETE_WITHIN_S)."""
        api = self.supervisor.replicas[0].address
        records: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + COMPLETE_WITHIN_S
        async with aiohttp.ClientSession(headers=self.supervisor.api_headers) as http:
            for b in self.backfills:
                if b.id is None:
                    continue
                while True:
                    async with http.get(f"{api}/backfills/{b.id}") as r:
                        records[b.id] = await r.json() if r.status == 200 else {}
                    if records[b.id].get("state") != "running" or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.5)
        return records

    async def skipped_by_overlap(self) -> frozenset[Key]:
        """The fires of the buffer_one schedules the ledger records skipped."""
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            self.supervisor.mongodb_uri, tz_aware=True
        )
        try:
            ids = [s.id for s in self.schedules if s.overlap is not None]
            skipped = [
                (d["schedule_id"], d["nominal_at"].astimezone(UTC))
                async for d in client.get_default_database()["fires"].find(
                    {"schedule_id": {"$in": ids}, "state": "skipped"},
                    {"schedule_id": 1, "nominal_at": 1},
                )
            ]
            return frozenset(skipped)
        finally:
            await client.close()

    async def ledger_of(self, missing: list[tuple[str, dt.datetime]]) -> list[str]:
        """What the database holds of fires the stream misses (or holds unexpected): each
        schedule's write times and each fire's ledger record (state, term, attempts, error),
        or the skipped range that covers it, to tell a fire never claimed from one claimed
        and not published, or who claimed one the audit did not expect. A
        fan-out fire is audited as ``<schedule>/<tenant>``: its schedule is the part before
        the slash and its fire id ``<schedule>@<nominal>/<tenant>``."""
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            self.supervisor.mongodb_uri, tz_aware=True
        )
        lines: list[str] = []
        try:
            db = client.get_default_database()
            for sid in sorted({audit_id.partition("/")[0] for audit_id, _ in missing}):
                doc = await db["schedules"].find_one(
                    {"_id": sid}, {"created_at": 1, "updated_at": 1, "revision": 1, "pause": 1}
                )
                pauses = [s.pauses for s in self.schedules if s.id == sid]
                lines.append(f"schedule {sid}: {doc}; pauses read back: {pauses}")
            for audit_id, nominal in missing:
                sid, _, tenant = audit_id.partition("/")
                fire = f"{sid}@{iso_utc(nominal)}" + (f"/{tenant}" if tenant else "")
                found = await db["fires"].find_one(
                    {"_id": fire},
                    {
                        "state": 1,
                        "term": 1,
                        "attempts": 1,
                        "claimed_at": 1,
                        "published_at": 1,
                        "last_error": 1,
                        "reason": 1,
                        "next_attempt_at": 1,
                        "backfill": 1,
                        "open_run": 1,
                        "buffered_at": 1,
                        "recorded_at": 1,
                    },
                )
                if found is None:  # recorded skipped as part of a range?
                    found = await db["fires"].find_one(
                        {
                            "schedule_id": sid,
                            "last_nominal_at": {"$gte": nominal},
                            "nominal_at": {"$lte": nominal},
                        },
                        {"state": 1, "term": 1, "count": 1, "reason": 1},
                    )
                lines.append(f"ledger {fire}: {found or 'never claimed nor recorded'}")
                run = await db["runs"].find_one(
                    {"_id": fire}, {"state": 1, "attempts": 1, "recorded_at": 1, "term": 1}
                )
                lines.append(f"  its run: {run}")
                if found is not None and found.get("state") == "buffered":
                    key = open_key(sid, tenant or None)
                    run = await db["runs"].find_one({"open_key": key})
                    blocker = (
                        await db["fires"].find_one({"_id": run["_id"]}) if run is not None else None
                    )
                    lines.append(f"  its key's open run: {run}; its fire: {blocker}")
        finally:
            await client.close()
        return lines

    async def read_back_created(self) -> None:
        """Those of the schedules asked for while faulted that exist, with their stored
        creation times, join the audit."""
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            self.supervisor.mongodb_uri, tz_aware=True
        )
        try:
            stored = {
                d["_id"]: d["created_at"]
                async for d in client.get_default_database()["schedules"].find(
                    {"_id": {"$in": [s.id for s in self.asked]}}, {"created_at": 1}
                )
            }
        finally:
            await client.close()
        self.schedules += [
            dataclasses.replace(s, created=stored[s.id].astimezone(UTC))
            for s in self.asked
            if s.id in stored
        ]
        print(
            f"schedules created while faulted: {len(stored)} of {len(self.asked)} asked", flush=True
        )

    # -- observation ----------------------------------------------------------------------

    async def watch_lease(self) -> None:
        """Sample the lease document every 100 ms (its own client: no shared fate)."""
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            self.supervisor.mongodb_uri,
            tz_aware=True,
            serverSelectionTimeoutMS=2000,
            appname="chaos-observer",
        )
        leases = client.get_default_database()["leases"]
        try:
            while True:
                with contextlib.suppress(Exception):
                    doc = await asyncio.wait_for(leases.find_one({"_id": "scheduler"}), 1.0)
                    now = dt.datetime.now(UTC)
                    if doc is not None:
                        live = doc.get("expires_at") and doc["expires_at"] > now
                        self.samples.append(
                            LeaseSample(
                                now, doc.get("holder") if live else None, int(doc.get("term", 0))
                            )
                        )
                await asyncio.sleep(0.1)
        finally:
            await client.close()

    def leader(self) -> tuple[str | None, int]:
        if not self.samples:
            return None, 0
        last = self.samples[-1]
        return last.holder, last.term

    # -- faults ---------------------------------------------------------------------------

    def _replicas(self) -> dict[str, Child]:
        return {
            c.name: c
            for c in self.supervisor.replicas
            if c.alive and not c.retiring and c.name not in self.busy
        }

    def _workers(self) -> dict[str, Child]:
        return {c.name: c for c in self.supervisor.workers if c.alive and c.name not in self.busy}

    def _pick(self) -> tuple[str, str] | None:
        """A fault kind that applies right now, and its target."""
        holder, _ = self.leader()
        replicas = self._replicas()
        standbys = [name for name in replicas if name != holder]
        options: dict[str, str] = {}
        if holder in replicas:
            for kind in ("leader-kill", "leader-term", "leader-stop"):
                options[kind] = holder
        if standbys:
            for kind in ("standby-kill", "standby-term", "standby-stop"):
                options[kind] = self.rng.choice(sorted(standbys))
        if replicas and not {"failpoint", "devmongo"} & self.busy:
            target = (
                holder
                if holder in replicas and self.rng.random() < 0.6
                else self.rng.choice(sorted(replicas))
            )
            options["db-cutoff"] = options["db-stall"] = target
        if "nats" not in self.busy:
            nodes = sorted(c.name for c in self.supervisor.others if c.role == "nats" and c.alive)
            options["nats-restart"] = nodes[0]
            if self.settings.nats_cluster >= 3 and len(nodes) == self.settings.nats_cluster:
                options["nats-node-kill"] = STREAM_LEADER  # chosen when injected
        if not {"devmongo", "failpoint"} & self.busy:
            options["db-step-down"] = "devmongo"
        if not {"devmongo", "failpoint"} & self.busy:
            options["devmongo-stall"] = "devmongo"
        workers = sorted(self._workers())
        if workers:
            options["worker-kill"] = self.rng.choice(workers)
            options["worker-stop"] = self.rng.choice(workers)
        if replicas:
            options["clock-skew"] = (
                holder
                if holder in replicas and self.rng.random() < 0.5
                else self.rng.choice(sorted(replicas))
            )
        if self.args.partitions and "network" not in self.busy:
            if holder in replicas:
                for kind in PARTITIONS[:-1]:
                    options[kind] = holder
            if workers:
                options["worker-cut-db"] = self.rng.choice(workers)
        if not options:
            return None
        # Every kind this soak can inject is injected once before any is repeated: a short
        # soak then meets each fault, and a long one is weighted as KINDS says. While one
        # is still to come and none of those applies now (a leader's partition, with the
        # leader stopped), nothing is injected this turn: a repeat would take the turn,
        # and on a slow machine the soak ended before the kind had applied.
        to_come = self.possible() - {f.kind for f in self.faults}
        if to_come and not to_come & set(options):
            return None
        kinds = sorted(to_come & set(options)) or sorted(options)
        kind = self.rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]
        return kind, options[kind]

    def possible(self) -> set[str]:
        """The fault kinds this soak's settings allow."""
        kinds = set(KINDS)
        if not self.args.partitions:
            kinds -= set(PARTITIONS)
        if self.settings.nats_cluster < 3:
            kinds.discard("nats-node-kill")
        return kinds

    async def inject(self, kind: str, target: str) -> Fault:
        ttl = self.settings.lease_ttl
        holder, term = self.leader()
        leader = target == holder
        rng = self.rng
        hold = 0.0
        if kind == "worker-stop":
            hold = rng.uniform(0.5, WORKER_ACK_WAIT_S * 2 / 3 - 0.5)
        elif kind.endswith("-stop"):
            hold = rng.uniform(0.5, 2 * ttl)
        elif kind.startswith("db-"):
            hold = rng.uniform(1.0, 2 * ttl)
        elif kind in PARTITIONS:
            # Longer than a failover, and one at a time: short enough that a short soak
            # meets every kind of them.
            hold = rng.uniform(1.0, ttl + 1.0)
        elif kind in ("nats-restart", "devmongo-stall"):
            hold = rng.uniform(0.5, 3.0)
        elif kind == "db-step-down":
            hold = float(rng.randint(1, 2 * int(ttl)))  # in whole seconds, as mongod takes it
        if kind == "nats-node-kill":
            target = await self._nats_victim()
        # How long after a fault ends its effects may still make fires late: a leader's
        # fault costs up to a lease ttl plus a renew interval before another takes over; a
        # broker outage leaves publishes in their retry backoff.
        failover = ttl + self.settings.renew_interval + 2.0
        settle = {
            "leader-kill": failover,
            "leader-term": 3.0,
            "leader-stop": failover,
            "nats-restart": 10.0,
            "devmongo-stall": failover,
            # A JetStream stream elects a new leader within about 10 s, then the
            # waiting fires go out within the capped backoff (2 s).
            "nats-node-kill": 15.0,
            "db-step-down": failover,
            "db-cutoff": failover if leader else 2.0,
            "db-stall": failover if leader else 2.0,
            "clock-skew": failover if leader else 2.0,
            "leader-cut-db": failover,
            "leader-isolated": failover,
            "leader-one-way-db": failover,
            # The leader keeps its lease without the broker: its fires wait out
            # the cut, then the publish retries' capped backoff.
            "leader-cut-broker": 5.0,
            # Lost packets leave TCP in its retransmission backoff (seconds) after
            # the loss ends.
            "leader-lossy-db": 15.0,
        }.get(kind, 2.0)
        fault = Fault(kind, target, dt.datetime.now(UTC), round(hold, 2), term, leader, settle)
        self.faults.append(fault)
        sup = self.supervisor
        if kind in PARTITIONS:
            self._partition(fault)
            return fault
        if kind == "clock-skew":
            # The replacement the supervisor starts (as a Deployment would) has its wall
            # clock moved: it joins, may lead, and must never fire early.
            skew = rng.choice(SKEWS_S) * rng.choice((-1, 1))
            sup.next_replica_env = moved_clock_env(skew)
            fault.hold_s = skew  # shown in the table: how far the clock was moved
            child = self._replicas()[target]
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGKILL if rng.random() < 0.5 else signal.SIGTERM)
            fault.ended = fault.started
            return fault
        if kind.startswith("worker-"):
            self.interrupted.add(target)
            child = self._workers()[target]
            if kind == "worker-kill":
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGKILL)
                fault.ended = fault.started
                return fault
            self.busy.add(target)
            child.process.send_signal(signal.SIGSTOP)
            self._heal_later(fault, self._continue(child, target))
            return fault
        if kind == "nats-node-kill":
            # The supervisor starts the node again, as its StatefulSet would; one node down
            # at a time, so the stream keeps its quorum.
            self.busy.add("nats")
            node = next(c for c in sup.others if c.name == target)
            with contextlib.suppress(ProcessLookupError):
                node.process.send_signal(signal.SIGKILL)
            self._heal_later(fault, self._nats_back(target, node.process.pid))
            return fault
        if kind.endswith(("-kill", "-term")):
            child = self._replicas()[target]
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(
                    signal.SIGKILL if kind.endswith("kill") else signal.SIGTERM
                )
            fault.ended = fault.started
            return fault
        if kind.endswith("-stop"):
            child = self._replicas()[target]
            self.busy.add(target)
            child.process.send_signal(signal.SIGSTOP)
            self._heal_later(fault, self._continue(child, target))
        elif kind.startswith("db-"):
            self.busy.add("failpoint")
            data: dict[str, Any] = {"failCommands": DB_COMMANDS, "appName": f"hascheduler/{target}"}
            if kind == "db-cutoff":
                data["closeConnection"] = True
            else:
                data.update(blockConnection=True, blockTimeMS=int(hold * 1000))
            await self.admin(
                {"configureFailPoint": "failCommand", "mode": "alwaysOn", "data": data}
            )
            self._heal_later(fault, self._failpoint_off())
        elif kind == "nats-restart":
            self.busy.add("nats")
            stopped = await sup.stop_nats()
            self._heal_later(fault, self._start_nats(stopped))
        elif kind == "db-step-down":
            self.busy.add("devmongo")
            await self.admin({"replSetStepDown": hold, "force": True})
            self._heal_later(fault, self._stepped_up())
        else:
            self.busy.add("devmongo")
            sup.child("devmongo").process.send_signal(signal.SIGSTOP)
            self._heal_later(fault, self._continue(sup.child("devmongo"), "devmongo"))
        return fault

    def _partition(self, fault: Fault) -> None:
        """Cut the target's links with nftables in its namespace; healed after the hold."""
        sup, kind = self.supervisor, fault.kind
        assert sup.net is not None, "partitions need the cluster in network namespaces"
        child = (self._workers() if kind.startswith("worker-") else self._replicas())[fault.target]
        node = child.node
        assert node is not None
        db = sup.child("devmongo").node
        assert db is not None
        brokers = [c.node for c in sup.others if c.role == "nats" and c.node is not None]
        if kind in ("leader-cut-db", "worker-cut-db"):
            sup.net.cut(node, db)
        elif kind == "leader-cut-broker":
            sup.net.cut(node, *brokers)
        elif kind == "leader-isolated":
            everyone = [n for n in sup.net.nodes.values() if n is not node]
            sup.net.cut(node, *everyone)
        elif kind == "leader-one-way-db":
            # One direction only, either one: the requests lost, or the replies.
            outgoing = self.rng.random() < 0.5
            sup.net.cut(node, db, outgoing=outgoing, incoming=not outgoing)
        else:
            sup.net.lossy(node, db, LOSS_PERCENT)
        if kind.startswith("worker-"):
            self.interrupted.add(fault.target)  # its runs may be taken over: done twice
        self.busy |= {fault.target, "network"}

        async def heal() -> None:
            assert sup.net is not None
            sup.net.heal(node)
            self.busy -= {fault.target, "network"}

        self._heal_later(fault, heal())

    async def admin(self, command: dict[str, Any]) -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            self.supervisor.mongodb_uri, serverSelectionTimeoutMS=10_000
        )
        try:
            await client.admin.command(command)
        finally:
            await client.close()

    async def _continue(self, child: Child, resource: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.process.send_signal(signal.SIGCONT)
        self.busy.discard(resource)

    async def _failpoint_off(self) -> None:
        await self.admin({"configureFailPoint": "failCommand", "mode": "off"})
        self.busy.discard("failpoint")

    async def _nats_victim(self) -> str:
        """The node leading the fire stream half the time (its loss costs an election),
        another node otherwise."""
        nodes = sorted(c.name for c in self.supervisor.others if c.role == "nats" and c.alive)
        if self.rng.random() < 0.5:
            with contextlib.suppress(Exception):
                leader, _ = await asyncio.wait_for(stream_leader(self.supervisor.nats_uri), 5)
                if leader in nodes:
                    return leader
        return self.rng.choice(nodes)

    async def _nats_back(self, name: str, killed_pid: int) -> None:
        """Until the killed node runs again (restarted by the supervisor)."""

        def back() -> bool:
            return any(
                c.name == name and c.alive and c.process.pid != killed_pid
                for c in self.supervisor.others
            )

        await wait_until(back, RECOVERY_WITHIN_S, f"{name} restarted by the supervisor", 0.2)
        self.busy.discard("nats")

    async def _stepped_up(self) -> None:
        """Until the database is primary again."""

        async def primary() -> bool:
            with contextlib.suppress(Exception):
                client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
                    self.supervisor.mongodb_uri,
                    directConnection=True,
                    serverSelectionTimeoutMS=2000,
                )
                try:
                    hello = await client.admin.command("hello")
                finally:
                    await client.close()
                return bool(hello.get("isWritablePrimary"))
            return False

        await wait_until(primary, RECOVERY_WITHIN_S, "the database primary again", 0.2)
        self.busy.discard("devmongo")

    async def _start_nats(self, stopped: Child) -> None:
        await self.supervisor.start_nats(stopped)
        self.busy.discard("nats")

    def _heal_later(self, fault: Fault, heal: Any) -> None:
        async def run() -> None:
            await asyncio.sleep(fault.hold_s)
            await heal
            fault.ended = dt.datetime.now(UTC)

        task = asyncio.create_task(run())
        self.heals.add(task)
        task.add_done_callback(self.heals.discard)

    async def heal_all(self) -> None:
        """Let every pending heal finish (each bounded: its hold time, then RECOVERY_WITHIN_S
        for what it waits to be over)."""
        while self.heals:
            await asyncio.gather(*list(self.heals))

    async def inject_until(self, until: float) -> None:
        mean = self.args.fault_every
        while True:
            await asyncio.sleep(self.rng.uniform(0.4 * mean, 1.6 * mean))
            if time.monotonic() >= until:
                return
            picked = self._pick()
            if picked is not None:
                fault = await self.inject(*picked)
                print(
                    f"  {(fault.started - self.t0).total_seconds():6.1f} s  {fault.kind:<15}"
                    f" {fault.target:<12} hold {fault.hold_s:4.1f} s  term {fault.term}",
                    flush=True,
                )


def _instant(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


LEADER_FAULTS = (
    "leader-kill",
    "leader-term",
    "leader-stop",
    "db-cutoff",
    "db-stall",
    "clock-skew",
    "leader-cut-db",
    "leader-isolated",
    "leader-one-way-db",
)


def failover_gaps(
    faults: list[Fault], samples: list[LeaseSample], fires: list[tuple[int, dt.datetime]]
) -> list[dict[str, Any]]:
    """For each fault of the leader followed by a newer term before the next such fault:
    the time to that term's lease (takeover) and to its first fire stored in the stream.
    A pause shorter than the renew deadline may keep the lease: no takeover, no gap."""
    ordered = sorted(
        (f for f in faults if f.leader and f.kind in LEADER_FAULTS), key=lambda f: f.started
    )
    gaps = []
    for f, after in zip(ordered, [*ordered[1:], None], strict=True):
        horizon = f.started + dt.timedelta(seconds=60)
        if after is not None:
            horizon = min(horizon, after.started)
        takeover = next(
            (
                s.at
                for s in samples
                if f.started <= s.at <= horizon and s.term > f.term and s.holder
            ),
            None,
        )
        first = min(
            (at for term, at in fires if term > f.term and f.started <= at <= horizon), default=None
        )
        if takeover is None or first is None:
            continue
        gaps.append(
            {
                "kind": f.kind,
                "takeover_s": (takeover - f.started).total_seconds(),
                "gap_s": (first - f.started).total_seconds(),
            }
        )
    return gaps


def _ms(value: float) -> str:
    return f"{value * 1000:,.0f} ms"


def table(report: SoakAudit, faults: list[Fault], gaps: list[dict[str, Any]]) -> str:
    by_kind: dict[str, int] = {}
    for f in faults:
        by_kind[f.kind] = by_kind.get(f.kind, 0) + 1
    lines = ["| fault | injected |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(by_kind.items())]
    lines += [
        f"| **all** | **{len(faults)}** |",
        "",
        "| fires expected | delivered | of which per tenant | missing | duplicated | "
        "unexpected | early |",
        "|---|---|---|---|---|---|---|",
        f"| {report.expected:,} | {report.delivered:,} | {report.tenant_fires:,} | "
        f"{len(report.missing)} | {len(report.duplicated)} | {len(report.unexpected)} | "
        f"{len(report.early)} |",
        "",
        "| lateness (stored - due) | fires | p50 | p99 | max | over the bound |",
        "|---|---|---|---|---|---|",
    ]
    for name, values, over in (
        ("outside fault windows", report.lateness_clear, len(report.over_bound)),
        ("inside fault windows", report.lateness_faulted, None),
    ):
        lines.append(
            f"| {name} | {len(values):,} | {_ms(pct(values, 0.5))} | "
            f"{_ms(pct(values, 0.99))} | {_ms(max(values, default=0))} | "
            f"{'-' if over is None else over} |"
        )
    lines += [
        "",
        "| failover (fault of the leader to ...) | samples | p50 | p99 | max |",
        "|---|---|---|---|---|",
    ]
    for key, label in (
        ("takeover_s", "a newer term's lease"),
        ("gap_s", "its first fire in the stream"),
    ):
        values = [g[key] for g in gaps]
        lines.append(
            f"| {label} | {len(values)} | {_ms(pct(values, 0.5))} | "
            f"{_ms(pct(values, 0.99))} | {_ms(max(values, default=0))} |"
        )
    return "\n".join(lines)


def backfills_table(b: BackfillAudit, report: SoakAudit) -> str:
    return "\n".join(
        [
            "| backfills asked (answered) | instants expected | delivered | missing | "
            "duplicated | records not exact | pause-covered instants | skipped by overlap |",
            "|---|---|---|---|---|---|---|---|",
            f"| {b.asked} ({b.answered}) | {b.expected:,} | {b.delivered:,} | "
            f"{len(b.missing)} | {len(b.duplicated)} | {len(b.miscounted)} | "
            f"{report.paused_optional:,} | {report.skipped_accounted:,} |",
        ]
    )


def runs_table(r: RunsAudit) -> str:
    attempts = ", ".join(f"{n}: {c:,}" for n, c in sorted(r.attempts.items()))
    return "\n".join(
        [
            "| fires in the stream | runs succeeded | dead (doomed) | lost | unsettled | "
            "wrongly dead/alive | side effect repeated (by an interrupted worker) |",
            "|---|---|---|---|---|---|---|",
            f"| {r.fires:,} | {r.succeeded:,} | {r.dead:,} | {len(r.lost)} | {len(r.unsettled)} | "
            f"{len(r.wrongly_dead)}/{len(r.wrongly_alive)} | {len(r.repeated)} "
            f"({len(r.repeated) - len(r.unexplained)}) |",
            "",
            f"runs by attempts: {attempts}",
        ]
    )


async def settled_runs(soak: Soak, fire_ids: set[str]) -> dict[str, dict[str, Any]]:
    """The runs of ``fire_ids`` once none is running or retrying (or the deadline passes)."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        soak.supervisor.mongodb_uri, tz_aware=True
    )
    deadline = time.monotonic() + COMPLETE_WITHIN_S
    try:
        while True:
            runs = {
                d["_id"]: d
                async for d in client.get_default_database()["runs"].find({}, {"event": 0})
            }
            open_runs = [
                f for f in fire_ids if runs.get(f, {}).get("state") in (None, "running", "retrying")
            ]
            if not open_runs or time.monotonic() > deadline:
                return runs
            await asyncio.sleep(1.0)  # retries wait out their backoff at the broker
    finally:
        await client.close()


def dated(fires: list[StoredFire]) -> list[tuple[dict[str, Any], dt.datetime]]:
    """Each fire with the time JetStream stored it, which it gives every message: the
    audit's clock."""
    messages = []
    for fire in fires:
        if fire.stored_at is None:
            raise RuntimeError(f"the stream gave no store time for {fire.event.get('id')}")
        messages.append((fire.event, fire.stored_at))
    return messages


async def complete_stream(
    soak: Soak,
    since: dt.datetime,
    until: dt.datetime,
    windows: list[Window],
    records: dict[str, dict[str, Any]],
) -> tuple[SoakAudit, list[Any]]:
    """Read the stream until nothing due and no backfilled instant is missing, or the
    deadline passes."""
    deadline = time.monotonic() + COMPLETE_WITHIN_S
    while True:
        messages = dated(await read_stream(soak.supervisor.nats_uri))
        report = audit(
            soak.schedules,
            messages,
            since,
            until,
            windows,
            soak.args.late_bound,
            await soak.skipped_by_overlap(),
        )
        backfilled = audit_backfills(soak.backfills, messages, records)
        if not (report.missing or backfilled.missing) or time.monotonic() > deadline:
            return report, messages
        await asyncio.sleep(2.0)  # catch-up and retries are still publishing


async def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before anything runs
    state_dir = Path(tempfile.mkdtemp(prefix="hascheduler-chaos-"))
    side_effects = state_dir / "side-effects.txt"
    os.environ["CHAOS_SIDE_EFFECTS"] = str(side_effects)  # the workers inherit both
    os.environ["CHAOS_FAIL_RATE"] = str(args.fail_rate)
    settings = DevSettings(
        replicas=args.replicas,
        state_dir=state_dir,
        workers=args.workers,
        nats_cluster=args.nats_cluster,
        network=args.partitions,
        apps=("bench.chaos_worker:app",),
        worker_args=("--ack-wait", str(WORKER_ACK_WAIT_S), "--concurrency", "16"),
    )
    soak = Soak(args, settings, random.Random(args.seed), Supervisor(settings))
    print(
        f"chaos soak: {args.duration:g} s of faults then {args.calm:g} s calm, "
        f"{args.replicas} replicas, {args.workers} workers failing {args.fail_rate:.0%} of "
        f"attempts, {args.schedules} schedules, seed {args.seed}, "
        f"a fault every {args.fault_every:g} s on average; "
        f"lease ttl {settings.lease_ttl:g} s, renew deadline {settings.renew_deadline:g} s, "
        f"renew interval {settings.renew_interval:g} s; logs in {settings.state_dir}",
        flush=True,
    )
    watcher: asyncio.Task[None] | None = None
    history: LeaseHistory | None = None
    missing_records: list[str] = []  # the database's record of fires the stream misses
    history_client: AsyncMongoClient[dict[str, Any]] | None = None
    try:
        await soak.supervisor.start()
        # Every acquisition, renewal and release of the lease, and every claim, from the
        # database's change stream, checked once the soak is over.
        history_client = AsyncMongoClient(soak.supervisor.mongodb_uri, tz_aware=True)
        history = LeaseHistory(history_client.get_default_database())
        await history.__aenter__()
        now = dt.datetime.now(UTC)
        since = (now + dt.timedelta(seconds=5)).replace(microsecond=0)
        # Faults for --duration, then --calm seconds without: the audit window covers both,
        # so the lateness bound is also checked once the faults' effects have passed.
        until = since + dt.timedelta(seconds=args.duration + args.calm)
        soak.t0 = since
        soak.make_schedules(since, until)
        await soak.create_schedules()
        watcher = asyncio.create_task(soak.watch_lease())
        await asyncio.sleep(max(0.0, (since - dt.datetime.now(UTC)).total_seconds()))
        print(f"window {since.isoformat()} .. {until.isoformat()}; faults:", flush=True)
        meanwhile = [
            asyncio.create_task(work())
            for work, every in (
                (soak.create_while_faulted, args.creates_every),
                (soak.pause_while_faulted, args.pauses_every),
                (soak.backfill_while_faulted, args.backfills_every),
            )
            if every
        ]
        try:
            await soak.inject_until(time.monotonic() + args.duration)
        finally:
            for task in meanwhile:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await soak.heal_all()
        await soak.supervisor.reconcile()
        await soak.read_back_created()
        await soak.read_back_pauses()
        await asyncio.sleep(max(0.0, (until - dt.datetime.now(UTC)).total_seconds()))
        windows = [f.window() for f in soak.faults]
        # The backfills' records first (each once done): a backfill's claims count as
        # fired while a publish of theirs is still being retried, and the stream is read
        # until those are in it too.
        records = await soak.backfill_records()
        report, messages = await complete_stream(soak, since, until, windows, records)
        backfill_report = audit_backfills(soak.backfills, messages, records)
        odd = report.missing + report.fired_and_skipped + report.unexpected
        if odd or backfill_report.missing:
            with contextlib.suppress(Exception):
                missing_records = await soak.ledger_of(odd[:20] + backfill_report.missing[:5])
        fire_ids = {str(e.get("id")) for e, _ in messages if isinstance(e, dict)}
        runs = await settled_runs(soak, fire_ids)
        await history.settle()
    finally:
        if history is not None:
            with contextlib.suppress(Exception):
                await history.__aexit__(None, None, None)
        if history_client is not None:
            await history_client.close()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        with contextlib.suppress(Exception):
            await soak.heal_all()
        await soak.supervisor.stop()

    fires = [(f.term, f.stored_at) for e, at in messages if (f := streamed_fire(e, at))]
    effects = (
        [
            (f, w, int(a), what)
            for f, w, a, what in (line.split() for line in side_effects.read_text().splitlines())
        ]
        if side_effects.exists()
        else []
    )
    runs_report = audit_runs(fire_ids, runs, effects, doomed, soak.interrupted)
    gaps = failover_gaps(soak.faults, soak.samples, fires)
    assert history is not None
    leases = history.check(
        LeaseTimings(settings.lease_ttl, settings.renew_deadline, settings.renew_interval)
    )
    # A write sent within its term and held up past the lease's margin lands where the
    # next term could act: only a fault that holds writes up (a stalled server, a link
    # cut or lossy while TCP retransmits) may explain one.
    holding = [f.window() for f in soak.faults if f.kind in HOLDS_WRITES]
    unexplained = [
        a for a in leases.stale if not any(start <= a.at <= end for start, end in holding)
    ]
    print()
    print(table(report, soak.faults, gaps))
    print()
    print(runs_table(runs_report))
    print()
    print(backfills_table(backfill_report, report))
    checks = {
        "every due fire delivered": not report.missing,
        "none duplicated": not report.duplicated,
        "none unexpected or early": not (report.unexpected or report.early),
        f"lateness outside fault windows <= {args.late_bound:g} s": not report.over_bound,
        "every message well formed": not report.malformed,
        f"at least {args.min_faults} faults injected": len(soak.faults) >= args.min_faults,
        "every fire run: succeeded, or dead (doomed) with its error": not (
            runs_report.lost
            or runs_report.unsettled
            or runs_report.wrongly_dead
            or runs_report.wrongly_alive
            or runs_report.not_done
        ),
        "a side effect repeated only by an interrupted worker": not runs_report.unexplained,
        "no instant both fired and recorded skipped": not report.fired_and_skipped,
        "every backfilled instant once, each backfill's record exact": backfill_report.ok,
        "lease history: no two terms valid at once; a write of a term only within "
        "it, or held up by a fault": not leases.violations
        and not unexplained
        and leases.terms > 0
        and leases.acts > 0,
    }
    print()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for label, keys in (
        ("missing", report.missing[:5]),
        ("duplicated", [k for k, _ in report.duplicated[:5]]),
        ("unexpected", report.unexpected[:5]),
        ("early", report.early[:5]),
    ):
        for sid, nominal in keys:
            print(f"  {label}: {sid} @ {nominal.isoformat()}")
    for line in missing_records:
        print(f"  {line}")
    for sid, nominal in report.fired_and_skipped[:5]:
        print(f"  fired and recorded skipped: {sid} @ {nominal.isoformat()}")
    for sid, nominal in backfill_report.missing[:5]:
        print(f"  backfill missing: {sid} @ {nominal.isoformat()}")
    for (sid, nominal), count in backfill_report.duplicated[:5]:
        print(f"  backfill duplicated: {sid} @ {nominal.isoformat()} x{count}")
    for backfill_id, record in backfill_report.miscounted[:5]:
        print(f"  backfill record: {backfill_id} {record}")
    for (sid, nominal), late in report.over_bound[:5]:
        print(f"  late: {sid} @ {nominal.isoformat()} by {late:.2f} s")
    for violation in leases.violations[:5]:
        print(f"  lease history: {violation}")
    for act in unexplained[:5]:
        print(
            f"  lease history: {act.what} written with term {act.term} at "
            f"{act.at.isoformat()}, where another term could act, outside any fault "
            "that holds writes up"
        )
    for label, ids in (
        ("lost run", runs_report.lost),
        ("unsettled", runs_report.unsettled),
        ("wrongly dead", runs_report.wrongly_dead),
        ("doomed yet succeeded", runs_report.wrongly_alive),
        ("no side effect", runs_report.not_done),
        ("repeated, unexplained", runs_report.unexplained),
    ):
        for fire_id in ids[:5]:
            print(f"  {label}: {fire_id}")

    command = " ".join(["scripts/chaos.py", *sys.argv[1:]])
    result = {
        "command": command,
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "since": since.isoformat(),
        "until": until.isoformat(),
        "lease": {
            "ttl_s": settings.lease_ttl,
            "renew_deadline_s": settings.renew_deadline,
            "renew_interval_s": settings.renew_interval,
        },
        "faults": [
            {
                **asdict(f),
                "started": f.started.isoformat(),
                "ended": f.ended.isoformat() if f.ended else None,
            }
            for f in soak.faults
        ],
        "expected": report.expected,
        "delivered": report.delivered,
        "tenant_fires": report.tenant_fires,
        "paused_optional": report.paused_optional,
        "skipped_accounted": report.skipped_accounted,
        "fired_and_skipped": len(report.fired_and_skipped),
        "backfills": {
            "asked": backfill_report.asked,
            "answered": backfill_report.answered,
            "expected": backfill_report.expected,
            "delivered": backfill_report.delivered,
            "missing": len(backfill_report.missing),
            "duplicated": len(backfill_report.duplicated),
            "miscounted": len(backfill_report.miscounted),
        },
        "missing": len(report.missing),
        "duplicated": len(report.duplicated),
        "unexpected": len(report.unexpected),
        "early": len(report.early),
        "malformed": report.malformed,
        "over_bound": len(report.over_bound),
        "lateness_clear_s": {
            "n": len(report.lateness_clear),
            "p50": pct(report.lateness_clear, 0.5),
            "p99": pct(report.lateness_clear, 0.99),
            "max": max(report.lateness_clear, default=0.0),
        },
        "gaps": gaps,
        "lease_history": {**leases.as_dict(), "stale_unexplained": len(unexplained)},
        "checks": checks,
        "ok": all(checks.values()),
        "runs": {
            "fires": runs_report.fires,
            "succeeded": runs_report.succeeded,
            "dead": runs_report.dead,
            "lost": len(runs_report.lost),
            "unsettled": len(runs_report.unsettled),
            "wrongly_dead": len(runs_report.wrongly_dead),
            "wrongly_alive": len(runs_report.wrongly_alive),
            "not_done": len(runs_report.not_done),
            "repeated": len(runs_report.repeated),
            "unexplained": len(runs_report.unexplained),
            "attempts": dict(sorted(runs_report.attempts.items())),
        },
        "table": table(report, soak.faults, gaps) + "\n\n" + runs_table(runs_report),
    }
    (out / "report.json").write_text(json.dumps(result, indent=1))
    from bench.chaos_plot import plot_gaps, plot_timeline

    plot_timeline(
        out / "timeline.png",
        since,
        until,
        soak.samples,
        soak.faults,
        [at for _, at in fires],
        title=command,
    )
    plot_gaps(out / "failover-gaps.png", gaps, title=command)
    print(f"\nreport, timeline.png and failover-gaps.png in {out}/")
    return 0 if result["ok"] else 1


def _positive(kind: type[int] | type[float], low: float) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low:g}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/chaos.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--duration",
        type=_positive(float, 10),
        default=300.0,
        help="seconds of faults (default 300)",
    )
    parser.add_argument("--replicas", type=_positive(int, 2), default=3)
    parser.add_argument("--schedules", type=_positive(int, 1), default=60)
    parser.add_argument("--workers", type=_positive(int, 1), default=2)
    parser.add_argument(
        "--nats-cluster",
        type=_positive(int, 1),
        default=3,
        help="nats-servers: a JetStream cluster of N (3: the fire stream at 3 "
        "replicas, and node kills among the faults), or 1",
    )
    parser.add_argument(
        "--fail-rate",
        type=_positive(float, 0),
        default=0.05,
        help="the share of handler attempts that fail (default 0.05)",
    )
    parser.add_argument(
        "--calm",
        type=_positive(float, 0),
        default=20.0,
        help="seconds without faults after them, inside the audit window (default 20)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--fault-every",
        type=_positive(float, 0.5),
        default=2.5,
        help="mean seconds between faults (default 2.5)",
    )
    parser.add_argument(
        "--late-bound",
        type=_positive(float, 0.1),
        default=2.0,
        help="lateness bound outside fault windows, seconds (default 2)",
    )
    parser.add_argument(
        "--min-faults",
        type=_positive(int, 0),
        default=0,
        help="fail unless at least this many faults were injected",
    )
    parser.add_argument(
        "--partitions",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run every process in a network namespace of its own and cut "
        "links among the faults (needs root; default on)",
    )
    parser.add_argument(
        "--creates-every",
        type=_positive(float, 0),
        default=5.0,
        help="while the faults run, a new schedule every this many seconds (0: none; default 5)",
    )
    parser.add_argument(
        "--pauses-every",
        type=_positive(float, 0),
        default=15.0,
        help="while the faults run, a pause until an instant every this many "
        "seconds (0: none; default 15)",
    )
    parser.add_argument(
        "--backfills-every",
        type=_positive(float, 0),
        default=20.0,
        help="while the faults run, a 60-instant backfill every this many "
        "seconds (0: none; default 20)",
    )
    parser.add_argument(
        "--buffer-one",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="two every-second schedules in fifty with overlap buffer_one (default on)",
    )
    parser.add_argument("--out", type=Path, default=Path("chaos-out"))
    args = parser.parse_args(argv)
    logs.configure("warning")  # the supervisor's own lines; the soak prints its faults
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
