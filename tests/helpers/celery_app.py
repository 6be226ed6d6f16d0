"""An ordinary Celery app, as a team already running Celery has: the tests start a real
``celery worker`` on it and schedule its task as ``celery:tests.helpers.celery_app.record``.
Each run appends what the worker made of the message to $RECORD_PATH (one JSON line)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

app = Celery("hascheduler_test", broker=os.environ.get("CELERY_BROKER_URL", "amqp://"))
app.conf.update(
    # What docs/FIRING.md asks of Celery users: ack after the run (at least once), one
    # message prefetched per process.
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_serializer="json",
    accept_content=["json"],
    result_backend=None,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(bind=True, name="tests.helpers.celery_app.record")  # type: ignore[untyped-decorator]
def record(self: Any, *args: Any, **kwargs: Any) -> None:
    request = self.request
    delivery = request.delivery_info or {}
    line = json.dumps(
        {
            "id": request.id,
            "task": self.name,
            "args": list(args),
            "kwargs": kwargs,
            "root_id": request.root_id,
            "parent_id": request.parent_id,
            "group": request.group,
            "retries": request.retries,
            "eta": request.eta,
            "expires": request.expires,
            "origin": request.origin,
            "correlation_id": request.correlation_id,
            # A custom message header (the fire's W3C trace context) is an attribute of the
            # task's request, where OpenTelemetry's Celery instrumentation reads it.
            "traceparent": request.get("traceparent"),
            "routing_key": delivery.get("routing_key"),
            "redelivered": delivery.get("redelivered"),
            "pid": os.getpid(),
            "ran_at": time.time(),
        }
    )
    # One short O_APPEND write per run: lines from the worker's processes never interleave.
    with open(os.environ["RECORD_PATH"], "a") as f:
        f.write(line + "\n")
