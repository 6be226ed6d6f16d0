"""Outcomes written behind the handlers: many runs' outcomes in one runs-ledger write, each
then answered to the broker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from pymongo.errors import PyMongoError
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from hascheduler.storage.run_records import Outcome
from hascheduler.storage.runs import RunLedger

log = structlog.get_logger("hascheduler.worker")


# Told how an outcome's write went: True written, False the claim was no longer this
# worker's (the record dropped), None the write failed.
Answer = Callable[[Any, "Outcome", "bool | None"], Awaitable[None]]


class Recorder:
    """Writes attempts' outcomes to the runs ledger behind the handlers, then has each
    answered: whatever ended while the previous write was in flight goes in the next one
    (no timer), so at high concurrency one write records many runs."""

    def __init__(
        self,
        runs: RunLedger,
        give_up_after_s: float,
        answer: Answer,
        ended: Callable[[list[Any]], Awaitable[None]] | None = None,
    ) -> None:
        self.runs = runs
        self.give_up_after_s = give_up_after_s
        self.answer = answer
        self.ended = ended  # the tokens of the batch's runs whose outcome stands
        self._pending: list[tuple[Any, Outcome]] = []
        self._wake = asyncio.Event()
        self._stopping = False

    def submit(self, token: Any, outcome: Outcome) -> None:
        self._pending.append((token, outcome))
        self._wake.set()

    async def run(self) -> None:
        """Until stopped and every outcome submitted by then is written."""
        while not (self._stopping and not self._pending):
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            lost: set[str] | None
            try:
                lost = await self._write([o for _, o in batch])
            except PyMongoError as exc:
                log.warning("runs_unrecorded", count=len(batch), error=repr(exc)[:300])
                lost = None
            for token, outcome in batch:
                kept = None if lost is None else outcome.fire_id not in lost
                try:
                    await self.answer(token, outcome, kept)
                except Exception as exc:  # one answer failing, not the rest
                    # The recorder stopping would leave every later outcome unwritten and
                    # its run held (its lease renewed) for ever: the broker redelivers an
                    # unanswered message, and the ledger answers its claim.
                    log.error("run_answer_failed", fire_id=outcome.fire_id, error=repr(exc)[:300])
            if self.ended is not None and lost is not None:
                await self.ended([token for token, outcome in batch if outcome.fire_id not in lost])

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def _write(self, outcomes: list[Outcome]) -> set[str]:
        """Through a database failover, for as long as a run's lease: after that another
        worker may have taken the runs over anyway."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(PyMongoError),
            wait=wait_exponential_jitter(multiplier=0.1, max=2.0),
            stop=stop_after_delay(self.give_up_after_s),
            reraise=True,
        ):
            with attempt:
                return await self.runs.record(outcomes)
        raise AssertionError("unreachable: AsyncRetrying reraises")
