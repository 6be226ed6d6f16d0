"""Tracing's cost: firing lateness and worker throughput with tracing on (1% sampled) and
off, same run.

    python -m bench.tracing_bench [--schedules 10000] [--seconds 20] [--fires 10000]
                                  [--concurrency 16] [--rounds 3] [--sample 0.01]

Runs the development MongoDB server, a real nats-server and an OTLP/HTTP receiver (in this
process, keeping a count of the spans it is sent), as tests/test_tracing.py does.

- Lateness: --schedules schedules every second for --seconds on three replicas, with
  tracing on (OTEL_EXPORTER_OTLP_ENDPOINT set, OTEL_TRACES_SAMPLER=parentbased_traceidratio
  at --sample) and off, --rounds of each in ABBA order, each on a fresh development server,
  nats-server and cluster: publish acknowledged minus due time, as bench/firing_bench.py
  measures it. Target: the median round's p99 on within 1.1x of off's.
- Worker: --fires fires in the stream, every one carrying a traceparent, one in 1/--sample
  sampled (as a leader sampling at that rate sends them); a `hascheduler worker` at
  --concurrency consumes them all with tracing off and on, alternating, --rounds each, the
  best of each kept. Target: on within 1.15x of off.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys

from bench.devmongo_bench import pct
from bench.firing_bench import lateness, ms
from bench.worker_bench import fill_stream, our_worker
from hascheduler.process import logs
from tests.helpers.otlp import OtlpReceiver
from tests.servers import start_devmongo, start_nats


def traced_env(receiver: OtlpReceiver, sample: float) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": str(sample),
    }


async def main_async(args: argparse.Namespace) -> int:
    print(
        f"# tracing benchmark: {platform.processor() or platform.machine()}, "
        f"python {sys.version.split()[0]}, sampling {args.sample:.0%}"
    )
    receiver = await OtlpReceiver().start()
    mongo = start_devmongo()
    broker = start_nats()
    env = traced_env(receiver, args.sample)
    try:
        # ABBA order (on, off, off, on ...): a drift over the run (the development server
        # and the stream holding more) weighs on both modes alike.
        order = [
            m for n in range(args.rounds) for m in (("on", "off") if n % 2 == 0 else ("off", "on"))
        ]
        p99: dict[str, list[float]] = {"off": [], "on": []}
        print(
            f"\nlateness, {args.schedules:,} schedules every second for {args.seconds:g} s"
            " (publish acknowledged minus due time), one cluster per row"
        )
        print("| round | tracing | fires | p50 | p99 | max |")
        print("|---|---|---|---|---|---|")
        for n, mode in enumerate(order):
            # Fresh servers each round: the development server's change log keeps the last
            # million writes and a round makes some 400,000, so on one server each round
            # runs slower than the one before, whatever its mode (docs/BENCHMARKS.md).
            round_mongo, round_broker = start_devmongo(), start_nats()
            try:
                values = await lateness(
                    round_mongo,
                    round_broker,
                    args.schedules,
                    1,
                    args.seconds,
                    env if mode == "on" else None,
                    f"tb_late_{mode}_{n}",
                )
            finally:
                round_broker.stop()
                round_mongo.stop()
            p99[mode].append(pct(values, 0.99))
            print(
                f"| {n + 1} | {mode} | {len(values):,} | {ms(values, 0.5)} | "
                f"{ms(values, 0.99)} | {ms(values, 1.0)} |",
                flush=True,
            )
        spans_firing = len(receiver.spans)
        # The median round of each mode: a round's p99 moves by tens of milliseconds from
        # one cluster to the next on a shared machine, as much as tracing's effect.
        median = {mode: statistics.median(v) for mode, v in p99.items()}
        print(
            f"median p99: off {median['off'] * 1000:.0f} ms, on "
            f"{median['on'] * 1000:.0f} ms; on / off "
            f"{median['on'] / median['off']:.2f}x (target <= 1.1x); spans exported: "
            f"{spans_firing:,}"
        )

        last = await fill_stream(broker.uri, args.fires, round(1 / args.sample))
        best: dict[str, float] = {}
        for n in range(args.rounds):
            for mode in ("off", "on"):
                seconds, _, _ = await our_worker(
                    broker.uri,
                    mongo,
                    f"tb_worker_{mode}_{n}",
                    args.concurrency,
                    last,
                    env if mode == "on" else None,
                    durable=f"tb-{mode}-{n}",
                )
                best[mode] = min(best.get(mode, seconds), seconds)
        print(
            f"\nworker, {args.fires:,} fires at concurrency {args.concurrency} "
            f"(best of {args.rounds})"
        )
        print("| tracing | seconds | runs/s |")
        print("|---|---|---|")
        for mode, seconds in best.items():
            print(f"| {mode} | {seconds:.2f} | {args.fires / seconds:,.0f} |")
        print(
            f"on / off: {best['on'] / best['off']:.2f}x (target <= 1.15x); spans "
            f"exported by the worker: {len(receiver.spans) - spans_firing:,}"
        )
    finally:
        broker.stop()
        mongo.stop()
        await receiver.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    logs.configure("warning")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--fires", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample", type=float, default=0.01)
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
