"""Every benchmark, each with its in-run baseline, gathered into docs/BENCHMARKS.md.

    python -m bench [--quick [--jobs N]] [--out docs/BENCHMARKS.md]

Runs the benchmark modules one after another (never two at once: they share the
machine's cores) and writes their tables, under the machine and the date, with the
command that reproduces each. --quick runs small versions (the test suite uses it, four at
a time, to keep the entry point working); its figures are not the ones to publish.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# (module, title, full arguments, quick arguments, what it measures and its targets)
SECTIONS = [
    (
        "bench.firing_bench",
        "Firing: failover gaps, burst drain, lateness",
        [],
        ["--kills", "1", "--burst", "300", "--lateness", "200", "--seconds", "2", "--lead", "6"],
        "The development MongoDB server, a real nats-server and three replicas (lease ttl 2 s, "
        "renew deadline 1.4 s, renew interval 0.4 s) on this one machine. Failover: from the "
        "signal to the next leader's lease and to its first published fire of an every-second "
        "schedule (which waits for that schedule's next second: up to 1 s after the lease); "
        "no in-run baseline exists for a failover, so its ratio is to the bound the design "
        "promises. "
        "Burst: 10,000 one-off schedules due in the same second, until all are "
        "published and acknowledged; baseline raw nats-py publishing as many messages, "
        "pipelined (js.publish), second the broker's own technique raw (core publishes "
        "whose acks land on one wildcard subscription), and third the broker's floor (the "
        "leader's own frames for as many fires, built before the clock starts and written at "
        "once on one connection, until the last ack). Lateness: publish-acknowledged time "
        "minus due time; baseline plain APScheduler 3 running the same cron triggers with an "
        "empty job. Targets: graceful failover p99 <= 1 s; crash failover p99 <= ttl + renew "
        "interval (2.4 s); burst within 1.5x of raw; lateness p99 at 10,000 <= a quarter of "
        "APScheduler's. Everything shares two cores: at 10,000 fires every second the "
        "development server, the leader and nats-server together use most of them (the CPU "
        "lines below), and the 10,000 publishes of each second take nats-server about as long "
        "as the raw technique's burst.",
    ),
    (
        "bench.schedules_bench",
        "Schedules: mirror load, memory, propagation",
        [],
        ["--sizes", "2000", "--creates", "50", "--million", "5000"],
        "Mirror load to ready and resident bytes per schedule against APScheduler add_job of "
        "the same triggers and against the documents' own BSON size (bson.encode of the same "
        "documents); 1,000,000 schedules loaded to ready against a raw find() drain of the "
        "same projection, each in a fresh process, the best of two alternated; propagation "
        "from an HTTP write on one replica to the two others' mirrors against a raw insert "
        "seen by a raw change-stream watcher. Targets: bytes per schedule at most the BSON "
        "size; 100,000 ready within 5 s; the million within 1.5x of the raw drain.",
    ),
    (
        "bench.api_bench",
        "HTTP API create rate and a new replica's time to ready",
        [],
        ["--creates", "100", "--ready", "1000"],
        "POST /schedules against raw PyMongo inserts of the same documents; a new replica from "
        "spawn to /readyz 200 against a fresh process reading the same schedules with the raw "
        "driver.",
    ),
    (
        "bench.cron_bench",
        "Cron: next fire, refusal, catch-up after long outages",
        [],
        ["--calls", "100", "--days", "1,30"],
        "One uncached next-fire computation in Europe/Paris per kind of expression, against "
        "APScheduler 3's CronTrigger in the zone (where one trigger can say it) and cronsim; "
        "refusing an impossible expression against APScheduler searching to year 9999; "
        "planning catch-up for a per-second cron after outages of a day to a year, against "
        "listing the missed times of the shortest. Target: every accepted expression's next "
        "fire well under a millisecond; a plan's cost independent of the outage but for "
        "the hour listed at each DST change.",
    ),
    (
        "bench.worker_bench",
        "Worker: throughput with the runs ledger, due time to handler start",
        [],
        [
            "--fires",
            "500",
            "--concurrency",
            "4",
            "--amqp-concurrency",
            "4",
            "--rate",
            "50",
            "--seconds",
            "2",
            "--rounds",
            "1",
        ],
        "A `hascheduler worker` process with a no-op async handler consuming 10,000 fires "
        "already in the stream (each claimed in the runs ledger, run, recorded, "
        "acknowledged), at concurrency 1 and 16, against a raw nats-py pull consumer fetching"
        " as many at a time and acknowledging each (no ledger), three rounds of the two "
        "alternated, each with a consumer of its own, the median round of each compared (one "
        "round on this shared machine can be a third slower than the next); then the same at "
        "concurrency 16 on RabbitMQ (a quorum queue), against a raw aio-pika consumer with "
        "the worker's prefetch acknowledging each, three rounds alternated likewise. Then "
        "1,000 schedules firing every second for 20 s with one replica leading and one worker"
        " (concurrency 16): the handler's start minus the due time, against the scheduler "
        "half alone (publish acknowledged minus due time, from the fire ledger). Target: "
        "throughput within 1.3x of the raw consumer on both brokers. The runs ledger lives on"
        " the development MongoDB server on the same two cores: the CPU lines under the table"
        " show where a run's time goes (at concurrency 16 the worker, the development server "
        "and nats-server together keep both cores busy; the raw consumer writes nothing).",
    ),
    (
        "bench.fanout_bench",
        "Fan-out: one schedule to 10,000 tenants, memory per tenant",
        [],
        ["--tenants", "200", "--workers", "1", "--mirror", "2000", "--lead", "8"],
        "The development MongoDB server, a real nats-server and three replicas. One one-off "
        "schedule whose fan_out selects 10,000 tenants: from its due time until every "
        "tenant's fire is published and acknowledged, against 10,000 separate one-off "
        "schedules due together (the burst) in the same run; then until every run has "
        "succeeded with 2 workers. The leader's longest event-loop stall meanwhile, against "
        "its lease's renew interval. Memory of a source mirror per tenant, against the same "
        "fields as plain dicts. Target: the fan-out within 1.2x of the separate schedules, "
        "and no stall near a renewal's deadline.",
    ),
    (
        "bench.ha_bench",
        "High availability: a 3-node NATS cluster, a node lost, a step-down",
        # A lead of 6 s, as the firing benchmark's: three replicas started beside the other
        # quick benchmarks need seconds to elect a leader, and a burst due before the first
        # leader is a catch-up, not a burst.
        [],
        [
            "--burst",
            "500",
            "--steady",
            "100",
            "--seconds",
            "1",
            "--ticks",
            "20",
            "--lead",
            "6",
            "--settle",
            "5",
        ],
        "The development MongoDB server, three replicas, and either one nats-server (the "
        "stream at 1 replica: the baseline) or a 3-node JetStream cluster (the stream at 3). "
        "The 10,000 burst and the lateness of 1,000 schedules firing every second on each, same "
        "run. Then, with 100 schedules firing every second: SIGKILL of the node leading the "
        "stream, and a 2 s step-down of the database (longer than the renew deadline, so the "
        "leader loses its lease): the lateness of the latest fire due from a second before the "
        "fault (the gap), and how many were over a second late. Nothing is lost or duplicated "
        "in either (tests/test_nats_cluster.py, tests/test_db_elections.py).",
    ),
    (
        "bench.amqp_bench",
        "RabbitMQ: the burst to confirmed, and republishes after failovers",
        [],
        ["--burst", "300", "--rounds", "1", "--kills", "1", "--ticks", "20", "--lead", "5"],
        "A RabbitMQ node (Debian's rabbitmq-server), the development MongoDB server and three "
        "replicas, a durable queue bound to the fire exchange. The 10,000 burst to confirmed "
        "and recorded published, against raw aio-pika publishing as many of the same messages "
        "(persistent, mandatory, same properties) on a confirm channel 500 at a time, and "
        "against our publisher alone, same run, the best of 3 alternating rounds each "
        "(target: within 1.2x of raw). Then 200 schedules every second and "
        "the leader SIGKILLed 5 times: the copies of a fire beyond the first that the queue "
        "holds, which RabbitMQ cannot deduplicate (the runs ledger makes the runs once).",
    ),
    (
        "bench.celery_bench",
        "Celery: scheduled fires run by a Celery worker",
        [],
        ["--fires", "100", "--lead", "5"],
        "A RabbitMQ node, the development MongoDB server, three replicas and an unmodified "
        "`celery worker` (2 prefork processes, acks_late, prefetch 1) on an ordinary app. "
        "1,000 one-off schedules with a `celery:` target due in the same second, from that "
        "second until the worker has run every task (each run's own time), against the same "
        "1,000 tasks sent with Celery's own `send_task`, first send to last run, same run "
        "and worker. Every fire id's run is counted: one each.",
    ),
    (
        "bench.run_control_bench",
        "Run control: an overlap policy's cost, buffered fires, backfill",
        [],
        [
            "--schedules",
            "200",
            "--seconds",
            "2",
            "--warmup",
            "1",
            "--buffered",
            "5",
            "--backfill",
            "1000",
            "--regular",
            "50",
            "--baseline",
            "2",
        ],
        "The development MongoDB server (its compiled build: see the development-server "
        "section), a real nats-server and three replicas. 1,000 and 10,000 schedules every "
        "second all with `overlap: skip`, against the same with `allow`, each its own "
        "cluster in the same run: lateness as in the firing benchmark. Under both, runs end "
        "at once: a task standing in for the workers, started before the cluster, takes each "
        "fire from the stream (its id from the message's `Nats-Msg-Id` header) and records "
        "its run ended, one runs-ledger write per fetched batch (inserting the runs under "
        "allow, ending the leader's reservations under skip); each cluster fires 5 s "
        "(`--warmup`) before its 20 s window. The skip run adds the leader's reservations "
        "(one insert per publish batch, made a quarter second before the batch is due; a "
        "fire whose run is still open then is asked again at its due time), so it writes the "
        "runs ledger twice per fire where allow writes it once: the CPU line under the table "
        "shows what the development server and the replicas took during each window. "
        "Then 50 `buffer_one` schedules every second whose runs take 1.5 s: from a run's end "
        "recorded to its buffered successor's publish acknowledged, against a raw change "
        "event's latency between processes. Then a 100,000-fire backfill beside 1,000 "
        "schedules firing every second: its rate, and their lateness over the whole time it "
        "runs against 60 s windows without it, one before and one after (together the "
        "baseline: the ledgers grow through the run), same cluster. Each regular second's "
        "1,000 fires go out as one batch and share one lateness, so a window's p99 is its "
        "slowest second or so: the windows are long so that one slow second moves neither "
        "figure. Targets: skip within 1.2x of allow; buffered p99 <= 100 ms; regular "
        "lateness with the backfill within 1.2x of without.",
    ),
    (
        "bench.partition_bench",
        "Partitions and clocks: failover cut from MongoDB, the offset",
        [],
        ["--rounds", "1", "--schedules", "3"],
        "`hascheduler dev`'s cluster with every process in a network namespace of its own "
        "(root only): the development MongoDB server, one nats-server and three replicas "
        "(lease ttl 2 s, renew deadline 1.4 s, renew interval 0.4 s) with schedules firing "
        "every second. Failover: rounds alternating SIGKILL of the leader (the baseline) and "
        "the leader cut from MongoDB both ways with nftables, same run: from the fault to the "
        "next term's lease and to its first fire. Offset: replicas started with their wall "
        "clock moved by -600, -4, +4 and +600 s (libfaketime), their estimate of the offset "
        "against the truth, and the bound they state; reading the estimate against reading "
        "the wall clock. Target: the partition's takeover p99 within 1.2x of the kill's.",
    ),
    (
        "bench.apply_bench",
        "Schedules as code: apply, and a no-op apply",
        [],
        ["--schedules", "300"],
        "The development MongoDB server and one replica. 10,000 declarations (a cron each, "
        "labelled team=bench) applied by `hascheduler apply`'s engine to an empty cluster "
        "(batched creates), against the same schedules created one request at a time through "
        "the client into another database of the same server, same run; then the same apply "
        "again, which has nothing to do, and its plan alone (reading the file, checking each "
        "declaration with the server's model, reading the cluster). Targets: apply at least "
        "5x faster than one by one; a no-op apply of 10,000 under 2 s.",
    ),
    (
        "bench.access_bench",
        "Many teams: the audit trail's cost, a token's check",
        [],
        ["--creates", "100", "--checks", "2000", "--tokens", "1000"],
        "POST /schedules with 16 in flight, against the API served in the bench's process "
        "(the development MongoDB server in its own): with the audit trail (each create "
        "carries its record; the relay copies records into the trail) against the same API "
        "whose store attaches no record, same run, rounds alternated. Then authenticating a "
        "named token and checking its action and namespace with 10,000 named tokens "
        "configured against 1. Targets: create rate at least 0.8x; the check within 1.1x.",
    ),
    (
        "bench.tracing_bench",
        "Tracing: lateness and worker throughput, on against off",
        [],
        [
            "--schedules",
            "100",
            "--seconds",
            "2",
            "--rounds",
            "1",
            "--fires",
            "300",
            "--concurrency",
            "4",
        ],
        "An OTLP/HTTP receiver in the bench's process; each lateness round on a fresh "
        "development MongoDB server, nats-server and three replicas: 10,000 schedules every "
        "second for 20 s with tracing on (sampled 1%: parentbased_traceidratio) and off, "
        "three rounds each in ABBA order: publish acknowledged minus due time, the median "
        "round of each mode compared. Then a worker at concurrency 16 consuming 10,000 fires "
        "that each carry a traceparent (1% sampled), tracing on against off, best of 3 "
        "alternated. Targets: lateness p99 on within 1.1x of off; worker on within 1.15x of "
        "off.",
    ),
    (
        "bench.flow_bench",
        "Flow control: fairness, a concurrency key's cost, a freed slot "
        "to the next start, a rate over a minute, a 10,000-tenant fan-out",
        [],
        [
            "--fires",
            "500",
            "--rounds",
            "1",
            "--hot",
            "30",
            "--rate-seconds",
            "2",
            "--tenants",
            "100",
            "--fires-per-tenant",
            "2",
            "--crowd",
            "100",
        ],
        "The development MongoDB server and a real nats-server. Fairness: 10,000 runs of one "
        "key at limit 2 published ahead of 50 runs of 50 other keys, two workers: when each "
        "of the 50 started. Throughput: 10,000 fires without a concurrency key and with the "
        "schedule's key {target} at limit 1,000 (every run takes and frees a slot; none "
        "waits), a worker at concurrency 16, alternated three times, the best of each. "
        "Hand-on: 500 runs of one key at limit 1 through two workers, each run's start minus "
        "the previous run's end. Rate: two keys at 5 starts a second, 300 runs each waiting, "
        "starts counted per second at the instant each was granted. Fan-out: 10,000 tenants "
        "at concurrency {tenant} limit 3, run now 4 times at once, through one replica and "
        "four workers, one SIGKILLed a third of the way. Targets: the 50 start within the "
        "first seconds; with the key within 1.2x of without; hand-on p99 under 50 ms; never "
        "more than 5 starts of a key in a second, close to 5; every fan-out run succeeds, "
        "never more than 3 of a tenant at once.",
    ),
    (
        "bench.ramp_bench",
        "Ramp: the highest firing rate sustained, against APScheduler",
        ["--profile"],
        [
            "--spread",
            "300,600",
            "--aligned",
            "300",
            "--baseline-spread",
            "300",
            "--baseline-aligned",
            "300",
            "--seconds",
            "2",
        ],
        "Schedules firing every second, stepped up until lateness p99 exceeds 100 ms or a "
        "fire due in the window is not published, in two shapes: spread (phases over the "
        "second: an interval of 1 s anchored at i mod 1000 ms) and aligned (a cron every "
        "second: all due on one instant). hascheduler: the development MongoDB server, a real "
        "nats-server and three replicas, fresh servers each step; baseline, same run: "
        "APScheduler 3 with the same triggers and an empty job (in process: no database, no "
        "broker, no failover). The plot (ramp.png beside this file) shows p50 and p99 "
        "against the rate; the profile lines say where the leader's and the development "
        "server's own time went (py-spy) in the step past each ceiling. Targets: at least "
        "20,000 fires a second, at least 4x APScheduler's highest sustained rate.",
    ),
    (
        "bench.broker_floor_bench",
        "Broker floor: how late nats-server alone leaves aligned fires, by layout",
        [],
        ["--fires", "300", "--rounds", "1"],
        "No scheduler: a client with nothing else to do writes 10,000 fires' frames at once "
        "(built before the clock starts) to a real nats-server and notes each JetStream "
        "acknowledgement, five rounds with the layouts alternated. Baseline, same run: "
        "hascheduler's layout (the leader's own frames on one file-backed stream). The others "
        "are what a change of layout would buy: the fires split over 2 or 4 streams, memory "
        "storage (not durable), 20-byte bodies, one fast-ingest batch (nats-server 2.14's "
        "batched publishing: the server acknowledges every few hundred messages instead of "
        "each), and the fires held by the broker (published "
        "2 s ahead as message schedules, `Nats-Schedule: @at`, stored by nats-server at "
        "their due time: lateness is the stored timestamp minus the due time). What it "
        "bounds: the firing benchmark's target of lateness p99 at most 50 ms at 10,000 "
        "aligned fires a second, which no layout meets before the scheduler does any work.",
    ),
    (
        "bench.lease_bench",
        "Lease at ttl 1 s: held under load, taken over after a crash",
        [],
        ["--schedules", "200", "--seconds", "3", "--kills", "1"],
        "The development MongoDB server, a real nats-server and three replicas with "
        "`--lease-ttl 1 --renew-deadline 0.7 --renew-interval 0.2`, 10,000 cron schedules "
        "firing every second (all on the second), fires kept 60 s (a ledger growing by 6 "
        "million documents would measure the development server's dictionaries doubling, "
        "not the lease). Ten minutes without a fault, the term read every 0.1 s, and the "
        "leader's watermark (how far ahead of now it has claimed, or behind: how late its "
        "fires are) minute by minute; then twenty "
        "SIGKILLs of the leader, each once it has led 5 s and keeps up (its watermark within "
        "2 s of now): from the signal to the next lease and to that term's first "
        "fire as the stream stored it, on fresh servers. Targets: no leadership change; "
        "first fire p99 within 1.1x of ttl + renew interval. All fires due on the second at "
        "10,000 a second is past what the development server (one Python process) sustains "
        "on two cores (the ramp's aligned ceiling): its watermark says how far behind the "
        "firing fell while the lease held.",
    ),
    (
        "bench.dev_bench",
        "Local cluster: start, and Ctrl-C",
        [],
        ["--replicas", "1", "--rounds", "1"],
        "`hascheduler dev` in a fresh directory each round (the development MongoDB "
        "server's build and the virtualenv ready: a second start), with one and with three "
        "replicas: its start to its ready line, then from the signal to every process of "
        "the cluster gone, three rounds each way alternated. Ctrl-C: SIGINT to dev alone, "
        "which stops workers, replicas, then broker and database in that order; baseline: "
        "SIGINT to dev and every child at once, as a terminal's Ctrl-C reached them all "
        "before the children had sessions of their own. With each, the shutdown steps that "
        "timed out in the children's logs. Target: Ctrl-C under 2 s, no step timed out.",
    ),
    (
        "bench.devmongo_bench",
        "Development MongoDB server",
        [],
        [
            "--docs",
            "2000",
            "--ops",
            "200",
            "--events",
            "50",
            "--ledger-fires",
            "1000",
            "--ledger-rounds",
            "2",
        ],
        "Round trips on a 100,000-document collection against an empty one (limit 2x), "
        "change-event latency between processes, and the server's CPU per fire for the "
        "firing path's ledger writes (the leader's claim and publish mark, an overlap "
        "policy's run reservation, the run's end; the ledgers' own indexes, their ordered "
        "ones built as the leader's range scans build them) against plain inserts of as "
        "many claim documents into a collection with only `_id` (baseline, same run). And a "
        "claim whose fire is in the ledger already (a new leader meeting its predecessor's "
        "fires), inserted and refused as a duplicate, against read first (baseline, same "
        "run).",
    ),
]


# Started first with --jobs (the longest quick versions, longest first): the rest fit
# beside them.
LONGEST = (
    "bench.run_control_bench",
    "bench.ha_bench",
    "bench.ramp_bench",
    "bench.firing_bench",
    "bench.partition_bench",
)


def run_section(
    module: str, args: list[str], docs_dir: Path, echo: bool = True
) -> tuple[int, str, float]:
    """Run one benchmark (echoing its output as it comes, or once it is done); its exit
    code, stdout and seconds taken. Figures it draws go to ``docs_dir`` (BENCH_DOCS)."""
    start = time.monotonic()
    if echo:
        print(f"== {module} {' '.join(args)}", flush=True)
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "BENCH_DOCS": str(docs_dir)},
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        if echo:
            print(line, end="", flush=True)
        lines.append(line)
    code = process.wait()
    if not echo:
        print(f"== {module} {' '.join(args)}\n{''.join(lines)}", end="", flush=True)
    return code, "".join(lines), time.monotonic() - start


def body(output: str) -> str:
    """The benchmark's tables without its own title and command lines."""
    kept = [line for line in output.splitlines() if not line.startswith(("# ", "command: "))]
    return "\n".join(kept).strip()


def section(
    module: str,
    title: str,
    about: str,
    chosen: list[str],
    code: int,
    output: str,
    took: float,
    dated: bool = False,
) -> list[str]:
    when = f" on {dt.date.today().isoformat()}" if dated else ""
    return [
        f"## {title}",
        "",
        about,
        "",
        f"Command: `python -m {module}{' ' if chosen else ''}{' '.join(chosen)}` "
        f"({took:.0f} s{when}{'; exit ' + str(code) + ', a target missed' if code else ''}"
        ").",
        "",
        body(output),
        "",
    ]


def only(module: str, out: Path, quick: bool) -> int:
    """Rerun one benchmark and put its section in place of the old one (or at the end)."""
    found = next((s for s in SECTIONS if s[0] == module), None)
    if found is None:
        print(f"python -m bench: no benchmark {module!r}", file=sys.stderr)
        return 2
    _, title, full, short, about = found
    chosen = short if quick else full
    code, output, took = run_section(module, chosen, out.parent)
    new = "\n".join(section(module, title, about, chosen, code, output, took, dated=True))
    text = out.read_text() if out.exists() else "# Benchmarks\n"
    head = f"## {title}\n"
    if head in text:
        start = text.index(head)
        end = text.find("\n## ", start + len(head))
        text = text[:start] + new + ("\n" + text[end + 1 :] if end != -1 else "\n")
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    out.write_text(text)
    print(f"wrote the {title!r} section of {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small versions (for tests)")
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="benchmarks run at once (more than 1 only for --quick: they "
        "share the machine, so their figures mean little)",
    )
    parser.add_argument(
        "--only",
        metavar="MODULE",
        help="run this one benchmark (as bench.worker_bench) and replace its section in --out",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or (args.jobs > 1 and not args.quick):
        parser.error("--jobs: 1, or more with --quick (figures measured side by side mean little)")
    if args.only:
        return only(args.only, args.out, args.quick)
    command = "python -m bench" + (" --quick" if args.quick else "")
    parts = [
        "# Benchmarks",
        "",
        f"Written by `{command}` on {dt.date.today().isoformat()}: {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}. Every figure below is printed by "
        "the command beside its table, with its baseline measured in the same run on "
        "the same machine; rerun it to reproduce. The chaos soak's figures are in "
        "RELIABILITY.md.",
        "",
    ]
    failed = []
    chosen = {module: quick if args.quick else full for module, _, full, quick, _ in SECTIONS}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        # The longest first, so that the short ones fill the other lanes meanwhile.
        order = sorted(
            SECTIONS, key=lambda s: LONGEST.index(s[0]) if s[0] in LONGEST else len(LONGEST)
        )
        results = {
            module: pool.submit(
                run_section, module, chosen[module], args.out.parent, args.jobs == 1
            )
            for module, *_ in order
        }
        for module, title, _, _, about in SECTIONS:
            code, output, took = results[module].result()
            if code:
                failed.append(module)
            parts += section(module, title, about, chosen[module], code, output, took)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(parts))
    print(f"wrote {args.out}" + (f"; targets missed in {', '.join(failed)}" if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
