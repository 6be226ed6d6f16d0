"""Deadline-bounded waits: tests wait for a condition, never for a fixed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_until(
    probe: Callable[[], Any], deadline_s: float, what: str, interval_s: float = 0.05
) -> Any:
    """Poll ``probe`` (a coroutine function, or a plain one) until it returns a truthy
    value; fail the test at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        answer = probe()
        value = await answer if inspect.isawaitable(answer) else answer
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(
                f"timed out after {deadline_s}s waiting for {what} (last value {value!r})"
            )
        await asyncio.sleep(interval_s)


def wait_until_sync(
    probe: Callable[[], T | None], deadline_s: float, what: str, interval_s: float = 0.05
) -> T:
    """``wait_until`` for tests that are not coroutines: the probe's first truthy value."""
    end = time.monotonic() + deadline_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(
                f"timed out after {deadline_s}s waiting for {what} (last value {value!r})"
            )
        time.sleep(interval_s)


async def still_pending(task: asyncio.Future[Any], within_s: float, what: str) -> None:
    """Assert that ``task`` does not finish within ``within_s``: waits on its end with
    that deadline (a turn of the loop or two would give a wrong early end less room)."""
    done, _ = await asyncio.wait({task}, timeout=within_s)
    assert not done, f"{what}: ended within {within_s}s"
