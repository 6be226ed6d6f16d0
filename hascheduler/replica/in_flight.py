"""A bounded number of tasks in flight at once (claim batches, retry batches)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class InFlight:
    """Tasks ``bound`` at a time: ``start`` waits for a place; leaving the block waits for
    them all, or cancels them if it is left by an error. A task's error (LeadershipLost
    ends the term) is raised at the next ``start`` or on leaving."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self, work: Coroutine[Any, Any, Any]) -> None:
        try:
            await self._fewer_than(self.bound)
        except BaseException:
            work.close()  # never to run
            raise
        self._tasks.add(asyncio.create_task(work))

    async def _fewer_than(self, bound: int) -> None:
        while len(self._tasks) >= bound:
            done, self._tasks = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()

    async def __aenter__(self) -> InFlight:
        return self

    async def __aexit__(self, error: type[BaseException] | None, *rest: object) -> None:
        try:
            if error is None:
                await self._fewer_than(1)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
