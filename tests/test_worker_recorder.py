"""The recorder writes outcomes behind the handlers and has each answered: one answer
failing, whatever it raises, stops neither the answers after it nor the next writes."""

from __future__ import annotations

import asyncio
import datetime as dt

from hascheduler.storage.run_records import Outcome
from hascheduler.storage.runs import RunLedger
from hascheduler.worker.recorder import Recorder
from tests.dispatching import unreachable_db
from tests.waiting import wait_until

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


class RecordingLedger(RunLedger):
    """Records every outcome (none taken over), in memory."""

    def __init__(self) -> None:
        super().__init__(unreachable_db().runs)
        self.writes: list[list[str]] = []

    async def record(self, outcomes: list[Outcome]) -> set[str]:
        self.writes.append([o.fire_id for o in outcomes])
        return set()


def succeeded(fire_id: str) -> Outcome:
    return Outcome(fire_id, "w", 1, T0, T0, "succeeded")


async def test_an_answer_that_raises_stops_neither_the_others_nor_the_next_writes() -> None:
    answered: list[tuple[str, bool | None]] = []

    async def answer(token: object, outcome: Outcome, kept: bool | None) -> None:
        if outcome.fire_id == "broken@1":
            # What a broker's client raised outside its errors (a retry's copy on a
            # channel mid-resubscribe): it once stopped the recorder for good.
            raise AssertionError
        answered.append((outcome.fire_id, kept))

    ledger = RecordingLedger()
    recorder = Recorder(ledger, 30.0, answer)
    running = asyncio.create_task(recorder.run())
    try:
        recorder.submit("a", succeeded("broken@1"))
        recorder.submit("b", succeeded("after@1"))
        await wait_until(lambda: ("after@1", True) in answered, 5, "the next answer")
        recorder.submit("c", succeeded("later@1"))
        await wait_until(lambda: ("later@1", True) in answered, 5, "a later write's answer")
        assert not running.done()
        assert ledger.writes[0] == ["broken@1", "after@1"]
        assert ["later@1"] in ledger.writes
    finally:
        recorder.stop()
        await asyncio.wait_for(running, 5)
