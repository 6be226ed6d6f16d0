"""Firing logic: catch-up plans, backoff, the worker's filter, lease timings, seeding, and taking
over a deposed leader's claim (against the development server)."""

from __future__ import annotations

import datetime as dt
import json
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hascheduler.dispatch import next_due
from hascheduler.fires import EventTemplate, backoff_s, plan_catchup
from hascheduler.lease import LeaseSettingsError, LeaseTimings
from hascheduler.mirror import Entry
from hascheduler.triggers import (
    Cron,
    Interval,
    Trigger,
    count_between,
    fire_id,
    fire_times,
    iso_utc,
    latest_at_or_before,
)
from hascheduler.worker import FireFilter
from tests.test_time_travel import next_offset_change

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
EVERY_MINUTE = Interval(60.0, T0)


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


@pytest.mark.parametrize(("policy", "window_s", "fired", "skipped", "reason"), [
    ("all", 3600, [1, 2, 3, 4, 5], None, ""),
    ("all", 150, [3, 4, 5], (1, 2, 2), "older than the catch-up window"),
    ("latest", 3600, [5], (1, 4, 4), "a later time fired"),
    ("none", 3600, [], (1, 5, 5), "policy 'none'"),
])
def test_catchup_policies(policy: str, window_s: float, fired: list[int],
                          skipped: tuple[int, int, int] | None, reason: str) -> None:
    fire, skip = plan_catchup(EVERY_MINUTE, policy, window_s, at(0.5), at(5.5))
    assert fire == [at(m) for m in fired]
    if skipped is None:
        assert skip is None
    else:
        assert skip is not None
        assert (skip.first, skip.last, skip.count) == (at(skipped[0]), at(skipped[1]),
                                                       skipped[2])
        assert reason in skip.reason


DAY = 86_400.0


@pytest.mark.parametrize("trigger", [Cron("* * * * * *"), Cron("* * * * * *", "Europe/Paris"),
                                     Interval(1.0, T0 - dt.timedelta(days=500))])
@pytest.mark.parametrize("down_s", [DAY, 30 * DAY, 400 * DAY])
def test_latest_after_a_long_outage_fires_the_latest_missed_time(trigger: Trigger,
                                                                 down_s: float) -> None:
    now = T0 + dt.timedelta(milliseconds=400)
    since = now - dt.timedelta(seconds=down_s)
    fire, skip = plan_catchup(trigger, "latest", 3600, since, now)
    assert fire == [T0]  # the last whole second before now, not one a day old
    assert skip is not None
    assert skip.last == T0 - dt.timedelta(seconds=1)
    assert skip.count == round(down_s) - 1  # every second of the outage but the one fired
    assert skip.first == next(iter(fire_times(trigger, since, limit=1)))


@pytest.mark.parametrize("down_s", [DAY, 30 * DAY, 400 * DAY])
def test_all_fires_exactly_the_window_and_records_the_rest_as_one_range(down_s: float) -> None:
    every_second = Interval(1.0, T0 - dt.timedelta(days=500))
    now = T0 + dt.timedelta(milliseconds=400)
    since = now - dt.timedelta(seconds=down_s)
    fire, skip = plan_catchup(every_second, "all", 600, since, now)
    window_start = now - dt.timedelta(seconds=600)
    assert fire == list(fire_times(every_second, window_start, until=now))
    assert len(fire) == 600
    assert fire[0] >= window_start
    assert fire[-1] == T0
    assert skip is not None
    assert skip.count == round(down_s) - 600
    assert skip.last == fire[0] - dt.timedelta(seconds=1)
    assert "window" in skip.reason


def test_count_and_latest_agree_with_listing_across_dst_and_odd_zones() -> None:
    rng = random.Random(7)
    for expression, spans in [("*/7 * * * * *", [10, 3600, 4 * 3600]),
                              ("*/13 * 2 * * *", [3600, 86400]),
                              ("30 2 * * *", [86400, 40 * DAY]), ("30 * * * *", [40 * DAY]),
                              ("15,45 2,3 * * *", [86400, 40 * DAY]),
                              ("0 9 1 * mon", [400 * DAY]), ("0 0 L * *", [400 * DAY])]:
        for zone_name in ["Europe/Paris", "America/New_York", "Australia/Lord_Howe",
                          "Pacific/Chatham", "UTC"]:
            trigger = Cron(expression, zone_name)
            somewhere = T0 + dt.timedelta(seconds=rng.randint(0, 365 * 86400))
            # Spans that start just before a change of offset, and one anywhere.
            change = next_offset_change(zone_name, somewhere) if zone_name != "UTC" \
                else somewhere
            for after in (somewhere, change - dt.timedelta(seconds=rng.randint(1, 7200))):
                until = after + dt.timedelta(seconds=rng.choice(spans))
                listed = list(fire_times(trigger, after, until=until))
                assert count_between(trigger, after, until) == len(listed)
                assert latest_at_or_before(trigger, after, until) == (listed[-1] if listed
                                                                      else None)


def test_skipped_range_is_one_document() -> None:
    _, skip = plan_catchup(Cron("* * * * * *"), "none", 3600, T0, T0 + dt.timedelta(days=2))
    assert skip is not None
    doc = skip.document("s", 4, T0)
    assert doc["_id"] == "s@2030-01-01T00:00:01.000Z..2030-01-03T00:00:00.000Z"
    assert (doc["count"], doc["state"], doc["term"]) == (2 * 86400, "skipped", 4)
    assert doc["nominal_at"] == T0 + dt.timedelta(seconds=1)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(), inner, max_size=3), max_leaves=8)


@given(schedule_id=st.text(min_size=1), name=st.text(), payload=st.dictionaries(st.text(), JSON),
       term=st.integers(1, 2**40), attempt=st.integers(1, 10),
       nominal=st.datetimes(dt.datetime(2000, 1, 1), dt.datetime(2100, 1, 1),
                            timezones=st.just(dt.UTC)))
def test_event_template_renders_what_json_dumps_of_the_event_gives(
        schedule_id: str, name: str, payload: dict[str, Any], term: int, attempt: int,
        nominal: dt.datetime) -> None:
    fired = nominal + dt.timedelta(milliseconds=3)
    fire = {"_id": fire_id(schedule_id, nominal), "schedule_id": schedule_id,
            "nominal_at": nominal}
    schedule = {"_id": schedule_id, "name": name, "payload": payload, "target": "t.x"}
    message = EventTemplate.of(schedule).render(fire, term, attempt, iso_utc(fired))
    event = {
        "specversion": "1.0", "id": fire["_id"], "source": "/hascheduler",
        "type": "io.hascheduler.fire", "subject": schedule_id, "time": iso_utc(fired),
        "datacontenttype": "application/json",
        "data": {"schedule_id": schedule_id, "name": name, "nominal_at": iso_utc(nominal),
                 "fired_at": iso_utc(fired), "term": term, "attempt": attempt,
                 "payload": payload},
    }
    assert message.body == json.dumps(event, separators=(",", ":")).encode()
    assert (message.fire_id, message.target, message.term) == (fire["_id"], "t.x", term)


def test_catchup_with_nothing_missed_is_empty() -> None:
    assert plan_catchup(EVERY_MINUTE, "all", 3600, at(5.1), at(5.9)) == ([], None)
    assert plan_catchup(EVERY_MINUTE, "latest", 3600, at(5.1), at(5.9)) == ([], None)


def test_backoff_is_full_jitter_capped_exponential() -> None:
    assert backoff_s(1, 0.5, 30, 1.0) == 1.0
    assert backoff_s(3, 0.5, 30, 1.0) == 4.0
    assert backoff_s(20, 0.5, 30, 1.0) == 30.0
    assert backoff_s(3, 0.5, 30, 0.25) == 1.0
    assert backoff_s(3, 0.5, 30, 0.0) == 0.0


def test_next_due_applies_deterministic_jitter_and_keeps_the_nominal() -> None:
    entry = Entry(1, False, EVERY_MINUTE, 30.0, "all", 3600.0, "t")
    due = next_due("s", entry, at(1.6))
    assert due is not None
    assert due.nominal == at(2)
    assert at(2) <= due.fire_at < at(2) + dt.timedelta(seconds=30)
    assert next_due("s", entry, at(1.6)) == due
    # A nominal already passed whose jittered time has not: still due.
    late = next_due("s", entry, due.fire_at - dt.timedelta(milliseconds=1))
    assert late == due


@pytest.mark.parametrize(("ttl", "deadline", "interval"), [
    (10, 10, 2), (10, 7, 6), (5, 7, 2), (10, 7, 0)])
def test_lease_timings_that_cannot_fence_are_refused(ttl: float, deadline: float,
                                                      interval: float) -> None:
    with pytest.raises(LeaseSettingsError):
        LeaseTimings(ttl, deadline, interval)


def event(fire_id: str, term: int, nominal: dt.datetime) -> dict[str, object]:
    return {"id": fire_id, "data": {"term": term,
                                    "nominal_at": nominal.isoformat().replace("+00:00", "Z")}}


def test_worker_drops_repeats_and_fires_a_deposed_leader_made_after_the_new_term() -> None:
    f = FireFilter()
    assert f.verdict(event("a", 1, at(1)), at(1)) == "run"
    f.done(event("a", 1, at(1)))
    assert f.verdict(event("a", 2, at(1)), at(1.1)) == "duplicate"
    assert f.verdict(event("b", 2, at(2)), at(2)) == "run"  # term 2 first seen at 2:00
    f.done(event("b", 2, at(2)))
    # Claimed by term 1 in time (nominal before term 2 appeared), delivered late: run it.
    assert f.verdict(event("c", 1, at(1.5)), at(3)) == "run"
    # A term-1 fire for a time after term 2 was acting: a deposed leader's, dropped.
    assert f.verdict(event("d", 1, at(4)), at(4)) == "stale"
    # A handler that failed leaves the fire unseen, so the redelivery runs.
    assert f.verdict(event("e", 2, at(5)), at(5)) == "run"
    assert f.verdict(event("e", 2, at(5)), at(5.1)) == "run"


async def test_seeding_yields_and_requeues_a_schedule_changed_meanwhile() -> None:
    import asyncio
    from types import SimpleNamespace

    from hascheduler.dispatch import YIELD_EVERY, Dispatcher

    def entry(revision: int, every_s: float = 60.0) -> Entry:
        return Entry(revision, False, Interval(every_s, T0), 0.0, "all", 3600.0, "t")

    entries = {f"s{i:05d}": entry(1) for i in range(3 * YIELD_EVERY)}
    mirror = SimpleNamespace(entries=entries)
    lease = SimpleNamespace(valid=True)
    dispatcher = Dispatcher(mirror, None, None, None, lease)  # type: ignore[arg-type]
    dispatcher.term, dispatcher.watermark = 1, None  # leading, heap not built yet
    turns = 0
    seeded = False

    async def meanwhile() -> None:
        nonlocal turns
        while not seeded:
            turns += 1
            if turns == 1:  # s00000 was visited before the first yield; now it changes
                entries["s00000"] = entry(2, every_s=30.0)
                dispatcher.on_change("s00000", entries["s00000"])
            await asyncio.sleep(0)

    other = asyncio.create_task(meanwhile())
    await dispatcher._seed(at(0.25))
    seeded = True
    await other
    assert turns >= 2, "the seed never let another task run"
    queued = {(d.revision, d.nominal) for d in dispatcher._heap if d.schedule_id == "s00000"}
    assert (2, at(0.5)) in queued, queued  # the new revision's next fire, every 30 s
    assert len(dispatcher._heap) >= len(entries)


async def test_a_claim_taken_by_a_deposed_leader_is_adopted_when_it_falls_due(
        mongo_uri: str) -> None:
    """Against the development server: a duplicate key on claiming means another claim;
    only an unpublished one from an older term is taken over (with our term), never a
    published one, a newer term's, or one this replica is already publishing."""
    import uuid
    from types import SimpleNamespace

    from pymongo import AsyncMongoClient

    from hascheduler import fires as ledger
    from hascheduler.dispatch import Dispatcher
    from tests.servers import with_database

    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        with_database(mongo_uri, f"adopt_{uuid.uuid4().hex[:8]}"), tz_aware=True)
    try:
        fires = client.get_default_database().fires
        now = at(10)
        lease = SimpleNamespace(valid=True, remaining=lambda: 5.0)
        dispatcher = Dispatcher(SimpleNamespace(entries={}), None, fires, None,  # type: ignore[arg-type]
                                lease, clock=lambda: now)

        def claim(sid: str, term: int) -> dict[str, object]:
            return ledger.claim_document(sid, at(10), at(10), term, at(9.99))

        deposed, published, newer, ours = (claim("deposed", 1), claim("published", 1),
                                           claim("newer", 3), claim("ours", 2))
        published["state"] = ledger.PUBLISHED
        await fires.insert_many([deposed, published, newer, ours])
        dispatcher._pending.add(str(ours["_id"]))

        mine = [claim(sid, 2) for sid in ("deposed", "published", "newer", "ours", "fresh")]
        owned = await dispatcher._claim(mine, 2)

        assert sorted(str(d["_id"]) for d in owned) == [
            ledger.fire_id("deposed", at(10)), ledger.fire_id("fresh", at(10))]
        stored = {d["schedule_id"]: d async for d in fires.find({})}
        assert (stored["deposed"]["term"], stored["deposed"]["claimed_at"]) == (2, now)
        assert stored["deposed"]["state"] == ledger.CLAIMED
        assert (stored["published"]["term"], stored["published"]["state"]) == (1, "published")
        assert stored["newer"]["term"] == 3
        assert stored["ours"]["claimed_at"] == at(9.99)  # untouched: already ours, in flight
        assert stored["fresh"]["term"] == 2
    finally:
        await client.close()
