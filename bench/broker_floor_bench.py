"""The broker's floor for aligned fires: how late nats-server alone makes a burst.

    python -m bench.broker_floor_bench [--fires 10000] [--rounds 5]

No scheduler runs. A client with nothing else to do writes ``--fires`` fires' frames at
once, built before the clock starts, on one connection to a real nats-server (JetStream,
file storage), and notes when each JetStream acknowledgement arrives: a fire published by
a leader at its due time cannot be acknowledged sooner than this. The layouts, alternated
round by round (the first is hascheduler's, the baseline; the others are what a change of
layout would buy):

- one stream: the leader's own frames (its event bodies, ``Nats-Msg-Id`` and term headers)
  on the fire stream as hascheduler creates it (file storage, 600 s duplicate window);
- split over 2 and over 4 streams (each its own subjects, the same frames);
- memory storage (not durable: a nats-server restart loses the fires);
- 20-byte bodies (what the events' size costs);
- fast-ingest batches (nats-server 2.14 and later, a stream with ``allow_batched``): the
  same frames as one batch whose reply subjects carry the batch's control
  (``<inbox>.<batch>.<flow>.fail.<seq>.<op>.$FI``, the JetStream batch publishing ADR),
  the server acknowledging every ``flow`` messages instead of each; a fire's lateness is
  the arrival of the first acknowledgement covering its sequence. The first message
  waits for the server's answer, as the protocol asks (it says whether the stream takes
  batches and at what flow);
- held by the broker: each fire published 2 s ahead as a message schedule
  (``Nats-Schedule: @at <due>``, nats-server 2.12 and later), which the server publishes
  into the stream at its due time; its lateness is the stored message's timestamp minus
  the due time (the others': the acknowledgement's arrival minus the write).

Prints p50, p99 and the last fire of each layout (medians over the rounds) and, per
layout, each round's p99. The lateness target of docs/BENCHMARKS.md (p99 at most 50 ms at
10,000 aligned fires a second) is below what every durable layout leaves here.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import nats
from nats.js.api import StorageType, StreamConfig

from bench.devmongo_bench import pct
from bench.firing_bench import fire_frames
from hascheduler.brokers.base import SUBJECT_PREFIX
from hascheduler.brokers.nats.publisher import NatsEndpoint, ack_error, ensure_stream
from hascheduler.brokers.nats.wire import PublishConnection, frame
from hascheduler.process import logs
from tests.servers import start_nats

HELD_AHEAD_S = 2.0  # a held fire is published this long before its due time
SMALL_BODY = b'{"id":"floor-small"}'
FAST_FLOW = 1000  # the flow a fast-ingest batch asks for (the server may lower it)


@dataclass
class Layout:
    name: str
    # The subject of the i-th fire (None: held by the broker, measured apart).
    subject: Callable[[int], str] | None
    small: bool = False
    fast: bool = False  # one fast-ingest batch
    rounds: list[list[float]] = field(default_factory=list)  # each round's latenesses (s)


def layouts() -> list[Layout]:
    fire = f"{SUBJECT_PREFIX}.bench.floor"
    return [
        Layout("one stream, file storage (hascheduler's)", lambda i: fire),
        Layout("split over 2 streams", lambda i: f"floor2.s{i % 2}.t"),
        Layout("split over 4 streams", lambda i: f"floor4.s{i % 4}.t"),
        Layout("memory storage (not durable)", lambda i: "floormem.t"),
        Layout("20-byte bodies", lambda i: fire, small=True),
        Layout(
            "fast-ingest batch (acknowledged every flow messages)",
            lambda i: "floorfast.t",
            fast=True,
        ),
        Layout("held by the broker (Nats-Schedule @at)", None),
    ]


async def create_streams(nats_uri: str) -> None:
    endpoint = NatsEndpoint.parse(nats_uri)
    nc = await nats.connect(endpoint.servers)
    try:
        js = nc.jetstream()
        await ensure_stream(js, endpoint)
        window = endpoint.dedup_window_s
        for k in (2, 4):
            for s in range(k):
                await js.add_stream(
                    StreamConfig(
                        name=f"FLOOR{k}_{s}", subjects=[f"floor{k}.s{s}.>"], duplicate_window=window
                    )
                )
        await js.add_stream(
            StreamConfig(
                name="FLOORMEM",
                subjects=["floormem.>"],
                storage=StorageType.MEMORY,
                duplicate_window=window,
            )
        )
        # nats-py's StreamConfig has neither allow_msg_schedules nor allow_batched yet:
        # the API's own requests.
        for name, allow in (("FLOORHELD", "allow_msg_schedules"), ("FLOORFAST", "allow_batched")):
            config = {
                "name": name,
                "subjects": [f"{name.lower()}.>"],
                "storage": "file",
                allow: True,
                "duplicate_window": int(window * 1e9),
            }
            reply = json.loads(
                (
                    await nc.request(
                        f"$JS.API.STREAM.CREATE.{name}", json.dumps(config).encode(), 10
                    )
                ).data
            )
            if "error" in reply:
                raise RuntimeError(f"a stream with {allow}: {reply['error']}")
    finally:
        await nc.close()


async def acked_burst(nats_uri: str, layout: Layout, n: int, round_no: int) -> list[float]:
    """Each fire's acknowledgement, in seconds after the frames were written."""
    inbox = f"_INBOX.floor{time.time_ns()}"
    arrived: list[float] = []
    errors: list[BaseException] = []
    all_acked = asyncio.Event()
    start = 0.0

    def acked(_subject: bytes, data: bytes, status: bytes | None) -> None:
        error = ack_error(data, status)  # a refusal is no floor: it comes back at once
        if error is not None:
            errors.append(error)
        arrived.append(time.perf_counter() - start)
        if len(arrived) == n:
            all_acked.set()

    assert layout.subject is not None
    subject = layout.subject
    if layout.small:
        frames = [
            frame(
                subject(i),
                f"{inbox}.{i}",
                f"Nats-Msg-Id: small-{round_no}-{i}-{inbox[-8:]}\r\n",
                SMALL_BODY,
            )
            for i in range(n)
        ]
    else:
        frames = fire_frames(n, inbox, subject)
    endpoint = NatsEndpoint.parse(nats_uri)
    connection = PublishConnection(endpoint.servers, None, acked)
    await connection.start(f"{inbox}.>")
    try:
        start = time.perf_counter()
        await connection.send(frames)
        await asyncio.wait_for(all_acked.wait(), 60)
    finally:
        await connection.close()
    assert not errors, f"{len(errors)} of {n} publishes refused: {errors[0]!r}"
    return arrived


async def fast_burst(nats_uri: str, layout: Layout, n: int, flows: list[int]) -> list[float]:
    """Each fire's acknowledgement in one fast-ingest batch, in seconds after the first
    frame was written: the arrival of the first flow acknowledgement (or of the batch's
    final one) whose sequence reaches it. ``flows`` gets the flow the server chose."""
    assert layout.subject is not None
    prefix, batch = f"_INBOX.fast{time.time_ns()}", secrets.token_hex(8)
    arrived = [0.0] * n
    covered = 0  # acknowledged up to this many fires
    errors: list[str] = []
    answered, ended = asyncio.Event(), asyncio.Event()
    start = 0.0

    def acked(_subject: bytes, data: bytes, status: bytes | None) -> None:
        nonlocal covered
        at = time.perf_counter() - start
        reply = json.loads(data) if data else {}
        if status or "error" in reply:
            errors.append(f"{status!r} {reply.get('error')}")
            answered.set()
            ended.set()
            return
        if "batch" in reply:  # the final acknowledgement: the whole batch is stored
            upto = n
        else:
            upto = int(reply.get("seq", 0))
            if not answered.is_set():
                flows.append(int(reply.get("msgs", 0)))
                answered.set()
        for i in range(covered, min(upto, n)):
            arrived[i] = at
        covered = max(covered, upto)
        if covered >= n:
            ended.set()

    def control(i: int) -> str:  # 0 starts the batch, 2 ends it storing the last message
        op = 0 if i == 0 else 2 if i == n - 1 else 1
        return f"{prefix}.{batch}.{FAST_FLOW}.fail.{i + 1}.{op}.$FI"

    frames = fire_frames(n, prefix, layout.subject, reply=control)
    connection = PublishConnection(NatsEndpoint.parse(nats_uri).servers, None, acked)
    await connection.start(f"{prefix}.{batch}.>")
    try:
        start = time.perf_counter()
        await connection.send(frames[:1])
        await asyncio.wait_for(answered.wait(), 10)
        if not errors:
            await connection.send(frames[1:])
            await asyncio.wait_for(ended.wait(), 60)
    finally:
        await connection.close()
    assert not errors, f"the fast-ingest batch failed: {errors[0]}"
    return arrived


async def held_burst(nats_uri: str, n: int, round_no: int) -> list[float]:
    """Each held fire's lateness: its stored timestamp minus its due time (both the
    server's clock)."""
    endpoint = NatsEndpoint.parse(nats_uri)
    nc = await nats.connect(endpoint.servers)
    try:
        js = nc.jetstream()
        due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=HELD_AHEAD_S + n / 20_000)
        due = due.replace(microsecond=0) + dt.timedelta(seconds=1)
        at = due.isoformat().replace("+00:00", "Z")
        target = f"floorheld.fire.r{round_no}"
        acks = [
            js.publish(
                f"floorheld.schedule.r{round_no}.{i}",
                b'{"held":true}',
                headers={"Nats-Schedule": f"@at {at}", "Nats-Schedule-Target": f"{target}.{i}"},
            )
            for i in range(n)
        ]
        await asyncio.gather(*acks)
        if dt.datetime.now(dt.UTC) >= due:
            raise RuntimeError("the held fires were not all stored before their due time")
        consumer = await js.pull_subscribe(f"{target}.>", stream="FLOORHELD")
        late: list[float] = []
        deadline = time.monotonic() + HELD_AHEAD_S + 60
        while len(late) < n and time.monotonic() < deadline:
            try:
                batch = await consumer.fetch(min(1000, n - len(late)), timeout=2)
            except (nats.errors.TimeoutError, TimeoutError):  # none due yet: fetch again
                continue
            for message in batch:
                stored = message.metadata.timestamp
                late.append((stored - due).total_seconds())
                await message.ack()
        await consumer.unsubscribe()
        if len(late) < n:
            raise RuntimeError(f"{n - len(late)} of {n} held fires were never published")
        return late
    finally:
        await nc.close()


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


async def main() -> int:
    logs.configure("warning")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fires", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"# broker floor benchmark, {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"command: `python -m bench.broker_floor_bench {' '.join(sys.argv[1:])}`".rstrip())
    broker = start_nats()
    try:
        await create_streams(broker.uri)
        all_layouts = layouts()
        flows: list[int] = []  # the flow the server chose for each fast-ingest batch
        for round_no in range(args.rounds):
            for layout in all_layouts:
                await asyncio.sleep(0.5)  # the last round's writes settle
                if layout.subject is None:
                    layout.rounds.append(await held_burst(broker.uri, args.fires, round_no))
                elif layout.fast:
                    layout.rounds.append(await fast_burst(broker.uri, layout, args.fires, flows))
                else:
                    layout.rounds.append(
                        await acked_burst(broker.uri, layout, args.fires, round_no)
                    )
    finally:
        broker.stop()
    baseline = statistics.median(pct(r, 0.99) for r in all_layouts[0].rounds)
    print(
        f"\n{args.fires:,} fires due at one instant, {args.rounds} rounds alternated "
        "(medians over the rounds)\n"
    )
    print("| layout | p50 | p99 | last | p99 against hascheduler's layout | each round's p99 |")
    print("|---|---|---|---|---|---|")
    for layout in all_layouts:
        p50 = statistics.median(pct(r, 0.5) for r in layout.rounds)
        p99 = statistics.median(pct(r, 0.99) for r in layout.rounds)
        last = statistics.median(max(r) for r in layout.rounds)
        each = ", ".join(f"{pct(r, 0.99) * 1000:.0f}" for r in layout.rounds)
        print(
            f"| {layout.name} | {ms(p50)} | {ms(p99)} | {ms(last)} | "
            f"{p99 / baseline:.2f}x | {each} ms |"
        )
    print(
        f"\nfast-ingest batches: the server acknowledged every {', '.join(map(str, flows))} "
        f"messages ({FAST_FLOW} asked)"
    )
    durable = [lay for lay in all_layouts if not lay.name.startswith("memory")]
    best = min(statistics.median(pct(r, 0.99) for r in lay.rounds) for lay in durable)
    print(
        f"\nthe lowest p99 of a durable layout: {ms(best)} (the target at 10,000 aligned fires "
        f"a second: 50 ms, the scheduler's own work not counted)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
