"""``hascheduler worker``: consume fires, claim each in the runs ledger, run a handler with
retries, record the outcome."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from hascheduler.brokers.registry import consumable_url
from hascheduler.cli.settings import (
    Setting,
    add_command,
    boolean,
    mongodb_uri,
    port,
    positive_float,
    positive_int,
    resolve,
    text,
)
from hascheduler.core.constants import DEFAULT_RUN_RETENTION_S
from hascheduler.core.errors import ConfigError
from hascheduler.worker.policy import PolicyError, RetryPolicy
from hascheduler.worker.service import run_worker
from hascheduler.worker.settings import WorkerSettings

_POLICY = RetryPolicy()


def _worker(flag: str, default: Any, parse: Any, help_text: str, **more: Any) -> Setting:
    """A worker's own setting: HASCHEDULER_WORKER_<FLAG> in the environment."""
    env = (
        "HASCHEDULER_WORKER_"
        + flag.removeprefix("--").removeprefix("worker-").replace("-", "_").upper()
    )
    return Setting(flag, default, parse, help_text, env=env, **more)


SETTINGS = (
    Setting(
        "--broker",
        None,
        consumable_url,
        "nats://host:port or amqp://user:password@host:port/vhost",
        required=True,
    ),
    Setting(
        "--mongodb-uri",
        None,
        mongodb_uri,
        "the cluster's MongoDB URI: the runs ledger",
        required=True,
    ),
    _worker(
        "--app",
        None,
        text,
        "module:attribute naming a hascheduler.worker.WorkerApp (handlers per target pattern)",
    ),
    _worker(
        "--handler",
        None,
        text,
        "module:function called with each Run (default: log it); instead of --app",
    ),
    _worker(
        "--target",
        None,
        text,
        "with --handler: the target pattern to consume (tokens, "
        "* for one, a last > for the rest; default >)",
    ),
    _worker(
        "--durable",
        None,
        text,
        "durable consumer name, shared by the workers that "
        "split the work (default from the target patterns)",
    ),
    _worker(
        "--worker-id",
        None,
        text,
        "this worker's name in the runs ledger (default host name and pid)",
        fallback_env="POD_NAME",
    ),
    _worker("--concurrency", WorkerSettings.concurrency, positive_int, "runs at once"),
    _worker(
        "--ack-wait",
        WorkerSettings.ack_wait_s,
        positive_float,
        "seconds without a "
        "heartbeat before a run is redelivered and its ledger claim may be taken over",
    ),
    _worker(
        "--drain-timeout",
        WorkerSettings.drain_timeout_s,
        positive_float,
        "on SIGTERM, seconds runs in flight may take to finish before they are given back",
    ),
    Setting(
        "--run-retention",
        DEFAULT_RUN_RETENTION_S,
        positive_float,
        "seconds the runs ledger keeps a run after its last change",
    ),
    _worker("--metrics-port", None, port, "serve Prometheus metrics on this port"),
    _worker(
        "--max-attempts",
        _POLICY.max_attempts,
        positive_int,
        "with --handler: attempts before a run is dead",
    ),
    _worker(
        "--backoff-base",
        _POLICY.backoff_base_s,
        positive_float,
        "with --handler: the "
        "first retry waits up to this many seconds, doubling per attempt (full jitter)",
    ),
    _worker(
        "--backoff-cap",
        _POLICY.backoff_cap_s,
        positive_float,
        "with --handler: the longest wait between attempts",
    ),
    _worker(
        "--timeout",
        _POLICY.timeout_s,
        positive_float,
        "with --handler: seconds one attempt may run",
    ),
    _worker(
        "--sync-schedules",
        False,
        boolean,
        "before consuming, apply the schedules the "
        "--app declares (and prune those it no longer does) through the API",
        switch=True,
    ),
    Setting(
        "--api",
        None,
        text,
        "with --sync-schedules: a replica's API URL (the token: HASCHEDULER_TOKEN)",
    ),
)


def worker_settings(args: argparse.Namespace) -> WorkerSettings:
    """The worker's settings from flags and environment. Raises ConfigError."""
    v = resolve(args, SETTINGS)
    try:
        policy = RetryPolicy(
            max_attempts=v["max_attempts"],
            backoff_base_s=v["backoff_base"],
            backoff_cap_s=v["backoff_cap"],
            timeout_s=v["timeout"],
        )
    except PolicyError as exc:
        raise ConfigError(f"--max-attempts / --backoff-* / --timeout: {exc}") from None
    return WorkerSettings.parse(
        broker=v["broker"],
        mongodb_uri=v["mongodb_uri"],
        app=v["app"],
        handler=v["handler"],
        target=v["target"],
        durable=v["durable"],
        worker_id=v["worker_id"],
        concurrency=v["concurrency"],
        ack_wait_s=v["ack_wait"],
        drain_timeout_s=v["drain_timeout"],
        run_retention_s=v["run_retention"],
        metrics_port=v["metrics_port"],
        policy=policy,
    )


def run(args: argparse.Namespace) -> int:
    settings = worker_settings(args)
    values = resolve(args, SETTINGS)
    if values["sync_schedules"]:
        from hascheduler.cli.apply import sync_app  # and PyYAML: only a worker that syncs

        synced = sync_app(settings.app, values["api"], None)
        if synced != 0:
            return synced
    return asyncio.run(run_worker(settings))


def add_parser(sub: Any) -> None:
    add_command(
        sub,
        "worker",
        SETTINGS,
        run,
        help="run fires: consume them from the broker, "
        "claim each in the runs ledger, run a handler with retries, record the "
        "outcome",
    )
