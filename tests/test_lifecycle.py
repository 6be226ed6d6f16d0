"""A component's lifecycle (process/lifecycle.py): a service that dies while its process
goes on says so when it dies, not at the stop."""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from hascheduler.process import lifecycle
from tests.waiting import wait_until


class Failing:
    """A service that fails once ``fail`` is set."""

    def __init__(self) -> None:
        self.fail = asyncio.Event()

    async def run(self) -> None:
        await self.fail.wait()
        raise AssertionError("broken")

    def stop(self) -> None:
        return None


async def test_a_service_that_fails_is_logged_when_it_fails_and_once() -> None:
    service = Failing()
    with structlog.testing.capture_logs() as logs:
        async with contextlib.AsyncExitStack() as stack:
            lifecycle.start(stack, "the failing one", service)
            service.fail.set()
            await wait_until(
                lambda: any(e["event"] == "service_failed" for e in logs), 5, "the failure said"
            )
        failed = [e for e in logs if e["event"] == "service_failed"]
    assert failed == [
        {
            "event": "service_failed",
            "service": "the failing one",
            "error": "AssertionError('broken')",
            "log_level": "error",
        }
    ]
