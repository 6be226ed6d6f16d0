"""A run a worker has claimed, from its claim to its answer: queued for a runner, or
running."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from hascheduler.core.flow import Wanted
from hascheduler.process import tracing
from hascheduler.worker.app import LazyEvent, Route
from hascheduler.worker.delivery import Delivery


@dataclass(slots=True)
class Held:
    """A run this worker has claimed: queued for a runner, or running."""

    message: Any
    delivery: Delivery
    route: Route
    attempt: int
    started: bool = False
    lost: bool = False  # taken over by another worker after its lease lapsed
    runner: asyncio.Task[None] | None = None  # running it, once started
    cancelled: threading.Event = field(default_factory=LazyEvent)
    trace: tracing.Context | None = None  # its claim span (tracing on): attempts' parent
    slot: Wanted | None = None  # the concurrency slot it holds (worker/flow.py)
    key_error: str | None = None  # why its concurrency key cannot be rendered: dead
    stops: int = 0  # cancels of its runner asked for this run (an operator's, its timeout)

    def stop(self) -> None:
        """Cancel the runner running it (an operator's cancel, or its timeout)."""
        if self.runner is not None:
            self.stops += 1
            self.runner.cancel()
