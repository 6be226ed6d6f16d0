"""The mirror's decisions (pure) and its sync against a server in another process."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import pytest
from bson import Timestamp

from hascheduler.core.entries import Written
from hascheduler.replica.mirror import RECENTLY_APPLIED, Mirror, decide, read_ahead
from tests.dispatching import unreachable_db
from tests.drivers import Driver
from tests.waiting import wait_until


def doc(schedule_id: str, revision: int, **extra: Any) -> dict[str, Any]:
    return {
        "_id": schedule_id,
        "revision": revision,
        "paused": False,
        "jitter": 0.0,
        "catchup": "latest",
        "catchup_window": 3600.0,
        "target": "t",
        "trigger": {"kind": "cron", "cron": "*/5 * * * * *", "timezone": "UTC"},
        **extra,
    }


def event(
    op: str, schedule_id: str, full: dict[str, Any] | None = None, ts: int = 1
) -> dict[str, Any]:
    e: dict[str, Any] = {
        "operationType": op,
        "documentKey": {"_id": schedule_id},
        "clusterTime": Timestamp(ts, 1),
    }
    if full is not None:
        e["fullDocument"] = full
    return e


def offline_mirror() -> Mirror:
    """A mirror fed by hand: its collection is never asked."""
    return Mirror(collection=unreachable_db().schedules)


@pytest.mark.parametrize(
    ("ev", "current", "action"),
    [
        (event("insert", "a", doc("a", 1)), None, "upsert"),
        (event("update", "a", doc("a", 3)), 2, "upsert"),
        (event("update", "a", doc("a", 2)), 2, "ignore"),  # not newer
        (event("replace", "a", doc("a", 1)), 5, "ignore"),  # older: a replayed event
        (event("update", "a", None), 2, "ignore"),  # deleted before the lookup
        (event("delete", "a"), 2, "remove"),
        (event("delete", "a"), None, "remove"),
        (event("drop", "a"), None, "ignore"),
    ],
)
def test_decide(ev: dict[str, Any], current: int | None, action: str) -> None:
    assert decide(ev, current)[0] == action


def test_events_in_order_converge_and_stale_ones_never_move_back() -> None:
    mirror = offline_mirror()
    mirror.apply(event("insert", "a", doc("a", 1)))
    mirror.apply(event("update", "a", doc("a", 3)))  # updateLookup saw a later state
    mirror.apply(event("update", "a", doc("a", 2)))  # the replayed middle event
    assert mirror.entries["a"].revision == 3
    mirror.apply(event("delete", "a", ts=9))
    assert "a" not in mirror.entries
    assert mirror.last_applied == Timestamp(9, 1)


def test_only_streamed_changes_are_noted_as_recently_applied() -> None:
    """A load propagates nothing: its schedules are not noted (a million of them churned
    the bounded record through the whole load); a streamed change is, the newest last."""
    mirror = offline_mirror()
    mirror.load([doc(f"s{i}", 1) for i in range(3 * RECENTLY_APPLIED)])
    assert not mirror.recently_applied
    mirror.apply(event("insert", "new", doc("new", 1)))
    mirror.apply(event("update", "s1", doc("s1", 2)))
    assert list(mirror.recently_applied) == ["new", "s1"]


def test_a_change_carries_its_commit_time_only_when_the_server_gives_a_date() -> None:
    """A server older than MongoDB 6.0 sends no wallTime; anything but a date is none."""
    seen: list[tuple[str, dt.datetime | None]] = []
    mirror = Mirror(
        collection=unreachable_db().schedules,
        on_change=lambda schedule_id, _entry, written: seen.append(
            (schedule_id, written.at if written else None)
        ),
    )
    committed = dt.datetime(2030, 1, 1, 12, 0, 0, 123000)  # naive, as a driver may give it
    for schedule_id, wall in [("dated", committed), ("old", None), ("odd", "yesterday")]:
        change = event("insert", schedule_id, doc(schedule_id, 1))
        if wall is not None:
            change["wallTime"] = wall
        mirror.apply(change)
    mirror.apply({**event("delete", "dated"), "wallTime": committed})
    assert seen == [
        ("dated", committed.replace(tzinfo=dt.UTC)),
        ("old", None),
        ("odd", None),
        ("dated", committed.replace(tzinfo=dt.UTC)),
    ]


def test_resync_leaves_unchanged_entries_alone_and_drops_the_gone() -> None:
    mirror = offline_mirror()
    mirror.load([doc("keep", 1), doc("change", 1), doc("gone", 1)])
    kept = mirror.entries["keep"]
    changed, removed = mirror.load([doc("keep", 1), doc("change", 2), doc("new", 1)])
    assert (changed, removed) == (2, 1)
    assert mirror.entries["keep"] is kept
    assert set(mirror.entries) == {"keep", "change", "new"}


def test_digest_depends_on_ids_and_revisions_only() -> None:
    one, two = (
        offline_mirror(),
        offline_mirror(),
    )
    one.load([doc("a", 1), doc("b", 2)])
    two.load([doc("b", 2, target="elsewhere"), doc("a", 1)])
    assert one.digest == two.digest
    two.apply(event("update", "a", doc("a", 2)))
    assert one.digest != two.digest


def test_a_document_written_around_the_api_is_refused_not_fatal() -> None:
    mirror = offline_mirror()
    mirror.load([doc("ok", 1), doc("junk", 1, trigger={"kind": "cron", "cron": "nope"})])
    assert set(mirror.entries) == {"ok"}
    assert "junk" in mirror.invalid


class Batches:
    """A cursor over ``batches``: each batch is a round trip that waits for ``arrive``;
    ``asked`` records the order of what happened, batch requests and the caller's work."""

    def __init__(self, batches: list[list[dict[str, Any]]], fail_after: int | None = None) -> None:
        self.batches, self.fail_after = batches, fail_after
        self.asked: list[str] = []

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        for n, batch in enumerate(self.batches):
            if n == self.fail_after:
                raise ConnectionError("the link dropped mid-load")
            self.asked.append(f"batch {n}")
            await asyncio.sleep(0)  # a round trip: the loop runs others meanwhile
            for d in batch:
                yield d


async def test_a_load_reads_the_next_batch_while_it_builds_from_the_last() -> None:
    batches = [[doc(f"s{b}-{i}", 1) for i in range(5)] for b in range(3)]
    cursor = Batches(batches)
    got: list[str] = []
    async for docs in read_ahead(cursor, chunk=5, ahead=4):
        got.extend(d["_id"] for d in docs)
        # Still building this chunk: the next batch is asked for meanwhile (a load that
        # read only when asked would never get there, and the wait would time out).
        following = f"batch {len(got) // 5}"
        if len(got) < 15:

            def asked(wanted: str = following) -> bool:
                return wanted in cursor.asked

            await wait_until(asked, 5, f"{following} asked for while building")
        cursor.asked.append(f"built {len(got)}")
    assert got == [d["_id"] for b in batches for d in b]  # each once, in order
    assert cursor.asked.index("batch 1") < cursor.asked.index("built 5"), cursor.asked


async def test_a_load_that_fails_midway_raises_and_stops_reading() -> None:
    cursor = Batches([[doc(f"s{b}-{i}", 1) for i in range(5)] for b in range(3)], fail_after=2)
    seen = []

    async def load() -> None:
        async for docs in read_ahead(cursor, chunk=2, ahead=2):
            seen.extend(docs)

    with pytest.raises(ConnectionError):
        await load()
    assert len(seen) == 10  # what came before the failure, no more
    assert "batch 2" not in cursor.asked


@pytest.fixture
async def collection(driver: Driver, mongo_uri: str, db_name: str) -> AsyncIterator[Any]:
    client = driver.client(mongo_uri, tz_aware=True)
    yield client[db_name].schedules
    await client.drop_database(db_name)
    await driver.close(client)


@contextlib.asynccontextmanager
async def running(mirror: Mirror) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(mirror.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_mirror_follows_a_collection_with_either_driver(collection: Any) -> None:
    await collection.insert_many([doc(f"pre{i}", 1) for i in range(5)])
    changes: list[tuple[str, bool, Written | None]] = []
    mirror = Mirror(
        collection,
        on_change=lambda schedule_id, entry, written: changes.append(
            (schedule_id, entry is not None, written)
        ),
    )

    async def server_now() -> dt.datetime:  # the server's clock, not this process's
        reply = await collection.database.command("hello")
        return reply["localTime"].replace(tzinfo=dt.UTC)  # type: ignore[no-any-return]

    began = await server_now()
    async with running(mirror):
        await asyncio.wait_for(mirror.wait_ready(), 10)
        assert mirror.size == 5
        created = await server_now()
        await collection.insert_one(doc("live", 1, created_at=created))
        await collection.update_one(
            {"_id": "pre0"}, {"$set": {"paused": True}, "$inc": {"revision": 1}}
        )
        await collection.delete_one({"_id": "pre1"})

        async def caught_up() -> bool:
            return mirror.size == 5 and "live" in mirror.entries and mirror.entries["pre0"].paused

        await wait_until(caught_up, 10, "the mirror to apply the live changes")
        assert "pre1" not in mirror.entries
        # A load's entries have no commit time; each streamed change has the server's.
        assert sorted(changes[:5]) == [(f"pre{i}", True, None) for i in range(5)]
        assert [c[:2] for c in changes[5:]] == [("live", True), ("pre0", True), ("pre1", False)]
        ended = await server_now()
        written = [c[2].at for c in changes[5:] if c[2] is not None]
        assert len(written) == 3
        assert all(
            w is not None
            and began - dt.timedelta(seconds=1) <= w <= ended + dt.timedelta(seconds=1)
            for w in written
        ), (began, written)
        assert written == sorted(written)  # type: ignore[type-var]
        # A document's own creation time comes with it; a delete has none.
        assert [c[2].created_at for c in changes[5:] if c[2] is not None] == [
            created.replace(microsecond=created.microsecond // 1000 * 1000),
            None,
            None,
        ]
        now = dt.datetime.now(dt.UTC)
        nxt = mirror.entries["live"].trigger.next_after(now)
        assert nxt is not None
        assert nxt.second % 5 == 0


async def test_a_resync_hands_on_each_documents_write_times(
    driver: Driver, mongo_uri: str, db_name: str
) -> None:
    """History lost (286) while schedules were written: the resync's load is the only
    record of those writes, and each hands on its document's times as a streamed change
    would (the leader plans a new schedule from its creation: a one-off due while the
    stream was lost fires late, not never); the first load's carry none."""
    app = f"resync-{db_name}"
    client = driver.client(mongo_uri, tz_aware=True, appname=app)
    collection = client[db_name].schedules
    changes: list[tuple[str, Written | None]] = []
    mirror = Mirror(
        collection,
        on_change=lambda schedule_id, entry, written: changes.append((schedule_id, written)),
    )
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    created, changed = now - dt.timedelta(seconds=3), now - dt.timedelta(seconds=2)
    await collection.insert_many(
        [doc(f"pre{i}", 1, created_at=created, updated_at=created) for i in range(3)]
    )
    try:
        async with running(mirror):
            await asyncio.wait_for(mirror.wait_ready(), 10)
            assert sorted(changes) == [(f"pre{i}", None) for i in range(3)]
            changes.clear()
            # The mirror's next getMore is held, then told its history is lost.
            await client.admin.command(
                {
                    "configureFailPoint": "failCommand",
                    "mode": {"times": 1},
                    "data": {
                        "failCommands": ["getMore"],
                        "appName": app,
                        "errorCode": 286,
                        "blockConnection": True,
                        "blockTimeMS": 1500,
                    },
                }
            )
            await client.admin.command(
                {"waitForFailPoint": "failCommand", "timesEntered": 1, "maxTimeMS": 10_000}
            )
            await collection.insert_one(doc("new", 1, created_at=now, updated_at=now))
            await collection.update_one(
                {"_id": "pre0"},
                {"$set": {"paused": True, "updated_at": changed}, "$inc": {"revision": 1}},
            )
            await collection.update_one(
                {"_id": "pre1"}, {"$set": {"updated_at": "soon"}, "$inc": {"revision": 1}}
            )
            await collection.delete_one({"_id": "pre2"})
            await wait_until(
                lambda: mirror.resyncs == 2 and mirror.ready, 15, "the mirror to resync"
            )
            assert dict(changes) == {
                "new": Written(now, now),  # new to the mirror: its creation too
                "pre0": Written(changed, None),  # changed: when
                "pre1": Written(None, None),  # a time that is no date: none
                "pre2": None,
            }  # removed
            assert mirror.entries["pre0"].paused
            assert "pre2" not in mirror.entries
    finally:
        await client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
        await client.drop_database(db_name)
        await driver.close(client)
