"""The one lifecycle shape of a process's long-running parts (after River's start/stop
service): a ``Service`` runs until asked to stop; ``start`` runs one on the process's exit
stack, whose unwinding (last started, first stopped) asks it to stop and waits for it,
each step bounded by STOP_STEP_S, cancelling what does not return in time."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

log = structlog.get_logger("hascheduler.replica")

# How long each shutdown step may take before we move on: a driver call selecting a
# vanished server does not yield to cancellation.
STOP_STEP_S = 3.0


class Service(Protocol):
    async def run(self) -> None: ...  # returns soon after stop()

    def stop(self) -> None: ...


async def bounded(what: str, step: Callable[[], Awaitable[object]]) -> None:
    """One shutdown step, given at most STOP_STEP_S; a failure is logged, not raised, so
    the steps after it still run."""
    try:
        await asyncio.wait_for(step(), STOP_STEP_S)
    except Exception as exc:
        log.warning("shutdown_step_failed", step=what, error=repr(exc))


def start(
    stack: contextlib.AsyncExitStack, what: str, service: Service, patient: bool = False
) -> None:
    """Run ``service`` until the stack unwinds. Then it is asked to stop and, unless
    ``patient`` (it has work to finish, as the elector's last renewal), cancelled at once:
    asking first is what ends it when a driver call it awaits ignores cancellation."""
    task = asyncio.create_task(service.run(), name=what)

    def ended(task: asyncio.Task[None]) -> None:
        # Said when it happens, not at the stop: a service that dies while the process
        # goes on (a worker's recorder) leaves it up and doing nothing.
        if not task.cancelled() and task.exception() is not None:
            log.error("service_failed", service=what, error=repr(task.exception()))

    task.add_done_callback(ended)

    async def stop() -> None:
        service.stop()
        if not patient:
            task.cancel()
        done, _ = await asyncio.wait({task}, timeout=STOP_STEP_S)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=STOP_STEP_S)
            log.warning("shutdown_step_failed", step=what, error="did not stop in time")

    stack.push_async_callback(stop)


class Every:
    """A step repeated every ``interval_s`` until stopped; ``late``, if given, is told by
    how much each wait overran (the event loop was busy meanwhile)."""

    def __init__(
        self,
        interval_s: float,
        step: Callable[[], Awaitable[None]],
        late: Callable[[float], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self._step = step
        self._late = late
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        while not self._stopping.is_set():
            await self._step()
            started = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)
            if self._late is not None and not self._stopping.is_set():
                self._late(max(0.0, time.monotonic() - started - self.interval_s))

    def stop(self) -> None:
        self._stopping.set()
