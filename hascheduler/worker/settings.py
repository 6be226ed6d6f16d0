"""A worker's settings, as values (cli/worker.py parses each flag into one)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from hascheduler.brokers.registry import BrokerUrl
from hascheduler.core.constants import (
    DEFAULT_RUN_RETENTION_S,
)
from hascheduler.worker.app import WorkerApp, WorkerConfigError, load_app
from hascheduler.worker.policy import RetryPolicy


@dataclass(frozen=True)
class WorkerSettings:
    broker: BrokerUrl
    mongodb_uri: str
    app: WorkerApp
    durable: str
    worker_id: str
    concurrency: int = 8
    # The broker redelivers an unacknowledged fire after this; the ledger's run lease is as
    # long, and both are renewed every third of it while the handler runs.
    ack_wait_s: float = 30.0
    drain_timeout_s: float = 30.0
    run_retention_s: float = DEFAULT_RUN_RETENTION_S
    metrics_port: int | None = None

    @classmethod
    def parse(  # noqa: PLR0913 (one value per flag of the command)
        cls,
        *,
        broker: BrokerUrl,
        mongodb_uri: str,
        app: str | None,
        handler: str | None,
        target: str | None,
        durable: str | None,
        worker_id: str | None,
        concurrency: int,
        ack_wait_s: float,
        drain_timeout_s: float,
        run_retention_s: float,
        metrics_port: int | None,
        policy: RetryPolicy,
    ) -> WorkerSettings:
        """The worker's settings from their values (cli/worker.py parses each); what only
        holds between them is checked here. Raises WorkerConfigError naming the flag."""
        if app and target:
            raise WorkerConfigError(
                "--target goes with --handler; an --app's handlers name their targets"
            )
        loaded = load_app(app, handler, target, policy)
        name = (
            durable
            or "worker-"
            + "".join(c if c.isalnum() else "-" for c in "_".join(loaded.patterns))[:200]
        )
        if ack_wait_s < 1:
            raise WorkerConfigError("--ack-wait must be at least 1 second")
        return cls(
            broker,
            mongodb_uri,
            loaded,
            name,
            worker_id or f"{socket.gethostname()}-{os.getpid()}",
            concurrency=concurrency,
            ack_wait_s=ack_wait_s,
            drain_timeout_s=drain_timeout_s,
            run_retention_s=run_retention_s,
            metrics_port=metrics_port,
        )
