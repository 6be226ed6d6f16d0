"""The runs ledger against the development server through each driver: claims, the
fence, takeover after a lapsed lease, retries, replays and paging."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any

import pytest

from hascheduler.api.run_view import public_view
from hascheduler.core.claims import Claim
from hascheduler.core.errors import RunConflict
from hascheduler.core.run_states import DEAD, RETRYING, RUNNING, SUCCEEDED
from hascheduler.storage.run_records import FireRef, Outcome
from hascheduler.storage.runs import RunLedger

T0 = dt.datetime.now(dt.UTC).replace(microsecond=0)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def fire(fire_id: str = "s@1", schedule_id: str = "s", nominal: float = 0) -> FireRef:
    event = {"id": fire_id, "data": {}}
    return FireRef(fire_id, schedule_id, "jobs", at(nominal), event, json.dumps(event).encode())


async def ended(
    ledger: RunLedger,
    fire_id: str,
    worker: str,
    attempt: int,
    started: dt.datetime,
    finished: dt.datetime,
    state: str,
    error: str | None = None,
    retry_in_s: float = 0.0,
) -> bool:
    """Record one outcome; whether the claim was still the worker's."""
    lost = await ledger.record(
        [Outcome(fire_id, worker, attempt, started, finished, state, error, retry_in_s)]
    )
    return fire_id not in lost


@pytest.fixture
async def ledger(db: Any) -> RunLedger:
    runs = RunLedger(db.runs)
    await runs.ensure_indexes(3600)
    return runs


async def test_a_claim_is_exclusive_until_its_lease_lapses(ledger: RunLedger) -> None:
    first = await ledger.claim(fire(), "a", at(0), lease_s=10)
    assert first.claimed
    assert first.attempt == 1
    busy = await ledger.claim(fire(), "b", at(4), lease_s=10)
    assert (busy.outcome, busy.wait_s) == (RUNNING, 6)
    assert await ledger.heartbeat({"s@1": 1}, "a", at(8), lease_s=10) == set()
    assert (await ledger.claim(fire(), "b", at(15), lease_s=10)).outcome == RUNNING
    taken = await ledger.claim(fire(), "b", at(19), lease_s=10)
    assert taken.claimed
    assert taken.attempt == 2
    assert taken.took_over == "a"
    # The fence: the stalled worker wakes and writes nothing.
    assert await ledger.heartbeat({"s@1": 1}, "a", at(20), lease_s=10) == {"s@1"}
    assert not await ended(ledger, "s@1", "a", 1, at(0), at(20), SUCCEEDED)
    assert await ended(ledger, "s@1", "b", 2, at(19), at(21), SUCCEEDED)
    doc = await ledger.get("s@1")
    assert doc is not None
    assert (doc["state"], doc["worker_id"], doc["attempts"], doc["duration_s"]) == (
        SUCCEEDED,
        "b",
        2,
        2.0,
    )
    assert (await ledger.claim(fire(), "c", at(30), lease_s=10)).outcome == SUCCEEDED


async def test_concurrent_claims_of_one_fire_have_one_winner(ledger: RunLedger) -> None:
    claims = await asyncio.gather(*(ledger.claim(fire(), f"w{i}", at(0), 10) for i in range(20)))
    assert sum(c.claimed for c in claims) == 1


async def test_a_retry_waits_for_its_time_then_counts_the_next_attempt(ledger: RunLedger) -> None:
    await ledger.claim(fire(), "a", at(0), 10)
    assert await ended(ledger, "s@1", "a", 1, at(0), at(1), RETRYING, "E: boom", 5)
    early = await ledger.claim(fire(), "b", at(3), 10)
    assert (early.outcome, early.wait_s) == (RETRYING, 3)
    second = await ledger.claim(fire(), "b", at(6), 10)
    assert second.claimed
    assert second.attempt == 2
    assert second.took_over is None
    assert await ended(ledger, "s@1", "b", 2, at(6), at(7), DEAD, "E: boom again")
    dead = await ledger.get("s@1")
    assert dead is not None
    assert (dead["state"], dead["last_error"]) == (DEAD, "E: boom again")
    assert (await ledger.claim(fire(), "c", at(8), 10)).outcome == DEAD


async def test_a_replay_gives_a_dead_run_a_fresh_budget(ledger: RunLedger) -> None:
    await ledger.claim(fire(), "a", at(0), 10)
    assert await ledger.replay("s@1", at(1)) is None  # running: not dead
    await ended(ledger, "s@1", "a", 1, at(0), at(1), DEAD, "E")
    replayed = await ledger.replay("s@1", at(2))
    assert replayed is not None
    assert (replayed["state"], replayed["attempts"], replayed["replays"]) == (RETRYING, 0, 1)
    assert await ledger.replay("s@1", at(2)) is None  # once
    await ledger.unreplay("s@1", 1, "the broker refused", at(3))
    undone = await ledger.get("s@1")
    assert undone is not None
    assert (undone["state"], undone["last_error"]) == (DEAD, "the broker refused")
    await ledger.replay("s@1", at(4))
    again = await ledger.claim(fire(), "b", at(5), 10)
    assert again.claimed
    assert again.attempt == 1


async def test_a_replay_under_an_overlap_policy_is_open_and_never_beside_another(
    ledger: RunLedger,
) -> None:
    """Replaying a dead run of a governed schedule opens it under the schedule's key: not
    while another run of the key is open (RunConflict naming it), and the leader's next
    reservation of the key is refused while the replay runs."""

    def governed(fire_id: str) -> Claim:
        return Claim(fire_id, "s", at(1), at(1))

    await ledger.claim(fire(), "a", at(0), 10)
    await ended(ledger, "s@1", "a", 1, at(0), at(1), DEAD, "E")
    assert await ledger.reserve([governed("s@2")], {"s": "jobs"}, at(1), 1) == {}
    with pytest.raises(RunConflict, match="s@2"):
        await ledger.replay("s@1", at(2), key="s")
    untouched = await ledger.get("s@1")
    assert untouched is not None
    assert (untouched["state"], untouched["replays"]) == (DEAD, 0)

    await ledger.cancel("s@2", at(3), "ci")
    replayed = await ledger.replay("s@1", at(4), key="s")
    assert replayed is not None
    assert (replayed["state"], replayed["open_key"]) == (RETRYING, "s")
    assert await ledger.reserve([governed("s@3")], {"s": "jobs"}, at(5), 1) == {"s@3": "s@1"}
    # The replay runs and ends: the key is free again.
    assert (await ledger.claim(fire(), "b", at(6), 10)).claimed
    await ended(ledger, "s@1", "b", 1, at(6), at(7), SUCCEEDED)
    assert await ledger.reserve([governed("s@4")], {"s": "jobs"}, at(8), 1) == {}


async def test_a_released_run_is_due_at_once_and_its_attempt_not_counted(ledger: RunLedger) -> None:
    await ledger.claim(fire(), "a", at(0), 10)
    assert await ledger.release("s@1", "a", 1, at(1), "shutting down")
    claim = await ledger.claim(fire(), "b", at(1), 10)
    assert claim.claimed
    assert claim.attempt == 1


async def test_pages_walk_every_run_once_newest_change_first(ledger: RunLedger) -> None:
    for i in range(7):
        await ledger.claim(fire(f"s@{i}", nominal=i), "a", at(i // 2), 10)  # ties in time
        await ended(ledger, f"s@{i}", "a", 1, at(i // 2), at(i // 2), DEAD, "E")
    await ledger.claim(fire("other@1", "other"), "a", at(9), 10)
    seen: list[str] = []
    after = None
    while True:
        page, after = await ledger.page(DEAD, after, 3)
        seen += [d["_id"] for d in page]
        assert all("event" not in d for d in page)
        if after is None:
            break
    assert sorted(seen) == [f"s@{i}" for i in range(7)]
    assert len(seen) == 7
    assert [d["_id"] for d in (await ledger.page(None, None, 1))[0]] == ["other@1"]
    history = await ledger.for_schedule("s", 3)
    assert [d["_id"] for d in history] == ["s@6", "s@5", "s@4"]
    view = public_view(history[0])
    assert view["id"] == "s@6"
    assert view["state"] == DEAD
    assert "event" not in view
    assert view["nominal_at"] == at(6).isoformat()


async def test_a_page_after_a_run_that_is_gone_is_refused(ledger: RunLedger) -> None:
    with pytest.raises(LookupError):
        await ledger.page(DEAD, "no-such-fire", 10)


async def test_many_claims_and_outcomes_in_one_write_each(ledger: RunLedger) -> None:
    await ledger.claim(fire("s@0"), "other", at(0), 10)  # already someone's
    claims = await ledger.claim_many([fire(f"s@{i}") for i in range(4)], "a", at(1), 10)
    assert [c.outcome for c in claims] == [RUNNING, "claimed", "claimed", "claimed"]
    lost = await ledger.record(
        [
            Outcome("s@1", "a", 1, at(1), at(2), SUCCEEDED),
            Outcome("s@2", "a", 1, at(1), at(2), DEAD, "E"),
            Outcome("s@0", "a", 1, at(1), at(2), SUCCEEDED),
        ]
    )  # never ours: dropped
    assert lost == {"s@0"}
    states = {i: (await ledger.get(f"s@{i}") or {}).get("state") for i in range(4)}
    assert states == {0: RUNNING, 1: SUCCEEDED, 2: DEAD, 3: RUNNING}


async def test_a_fan_out_fires_runs_are_counted_per_fire(ledger: RunLedger) -> None:
    def tenant_run(nominal: float, tenant: str) -> FireRef:
        base = f"s@{nominal}"
        event = {"id": f"{base}/{tenant}", "data": {"tenant": tenant}}
        return FireRef(
            f"{base}/{tenant}",
            "s",
            "jobs",
            at(nominal),
            event,
            json.dumps(event).encode(),
            fire=base,
            tenant=tenant,
        )

    for nominal in (1, 2):
        for tenant in ("a", "b", "c"):
            await ledger.claim(tenant_run(nominal, tenant), "w", at(nominal), 10)
    await ended(ledger, "s@2/a", "w", 1, at(2), at(3), SUCCEEDED)
    await ended(ledger, "s@2/b", "w", 1, at(2), at(3), DEAD, "E")
    assert await ledger.counts("s", [at(2), at(1), at(3)]) == {
        at(2): {SUCCEEDED: 1, DEAD: 1, RUNNING: 1},
        at(1): {RUNNING: 3},
        at(3): {},
    }
    assert await ledger.counts("other", [at(2)]) == {at(2): {}}
    assert (await ledger.get("s@2/a") or {}).get("tenant") == "a"


async def test_one_open_run_per_key_reserved_claimed_in_one_write_and_freed_at_its_end(
    ledger: RunLedger,
) -> None:
    """The leader's reservations (overlap policies): a second open run of a key is refused
    naming the first; the worker's batch claim starts them; an end frees the key."""
    from hascheduler.core.claims import Claim as FireClaim
    from hascheduler.core.instants import as_utc

    def reserved(schedule: str, n: float) -> FireClaim:
        return FireClaim(f"{schedule}@{n}", schedule, at(n), at(n))

    targets = {"a": "jobs", "b": "jobs"}
    assert await ledger.reserve([reserved("a", 1), reserved("b", 1)], targets, at(1), 1) == {}
    assert await ledger.reserve([reserved("a", 2)], targets, at(2), 1) == {"a@2": "a@1"}
    assert await ledger.reserve([reserved("a", 2)], targets, at(2), 1, name_blockers=False) == {
        "a@2": ""
    }
    # Published again after a failover: its own run, not refused.
    assert await ledger.reserve([reserved("a", 1)], targets, at(2), 1) == {}
    claims = await ledger.claim_many(
        [fire("a@1", "a", 1), fire("b@1", "b", 1), fire("c@1", "c", 1)], "w", at(3), 10
    )
    assert [(c.outcome, c.attempt) for c in claims] == [("claimed", 1)] * 3
    run = await ledger.get("a@1") or {}
    assert (run["state"], run["worker_id"]) == (RUNNING, "w")
    assert as_utc(run["first_started_at"]) == at(3)
    again = await ledger.claim_many([fire("a@1", "a", 1)], "v", at(4), 10)
    assert again[0].outcome == RUNNING
    assert await ended(ledger, "a@1", "w", 1, at(3), at(5), SUCCEEDED)
    assert await ledger.open_runs(["a", "b"]) == {"b": "b@1"}
    assert await ledger.reserve([reserved("a", 6)], targets, at(6), 1) == {}
