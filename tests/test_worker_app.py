"""The worker's pure parts: retry verdicts, target patterns, reading a delivery, and the
stale-term rule."""

from __future__ import annotations

import datetime as dt
import json
import random
import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hascheduler.worker import PermanentFailure, RetryPolicy, Run, WorkerApp
from hascheduler.worker.app import (
    ROUTED_TARGETS,
    LazyEvent,
    WorkerConfigError,
    load_app,
    pattern_matches,
)
from hascheduler.worker.claiming import AHEAD_S, PACE_WINDOW_S, ClaimAhead
from hascheduler.worker.delivery import NotAFire, StaleFilter, read_delivery
from hascheduler.worker.policy import MAX_ERROR_CHARS, PolicyError, after_failure


def test_a_permanent_failure_is_dead_at_once() -> None:
    verdict = after_failure(RetryPolicy(max_attempts=9), 1, PermanentFailure("gone"))
    assert (verdict.outcome, verdict.error) == ("dead", "PermanentFailure: gone")


def test_exhaustion_is_dead_with_the_last_error() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert after_failure(policy, 2, ValueError("x")).outcome == "retry"
    last = after_failure(policy, 3, ValueError("x"))
    assert (last.outcome, last.error) == ("dead", "ValueError: x (attempt 3 of 3)")


def test_an_error_text_is_bounded() -> None:
    verdict = after_failure(RetryPolicy(), 1, ValueError("e" * 100_000))
    assert len(verdict.error) == MAX_ERROR_CHARS


def test_backoff_is_full_jitter_under_a_doubling_capped_ceiling() -> None:
    policy = RetryPolicy(backoff_base_s=0.5, backoff_cap_s=10)
    ceilings = [policy.backoff_s(n, lambda low, high: high) for n in range(1, 8)]
    assert ceilings == [0.5, 1, 2, 4, 8, 10, 10]
    assert policy.backoff_s(3, lambda low, high: low) == 0
    draws = random.Random(16)
    means = [sum(policy.backoff_s(n, draws.uniform) for _ in range(2000)) / 2000 for n in (1, 2, 3)]
    assert means[0] < means[1] < means[2]
    assert policy.backoff_s(10_000, lambda low, high: high) == 10  # no overflow


@pytest.mark.parametrize(
    "fields",
    [
        {"max_attempts": 0},
        {"max_attempts": 1.5},
        {"backoff_base_s": 0},
        {"backoff_cap_s": -1},
        {"timeout_s": float("nan")},
        {"timeout_s": float("inf")},
        {"backoff_base_s": 5, "backoff_cap_s": 1},
    ],
)
def test_a_policy_that_cannot_work_is_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(PolicyError):
        RetryPolicy(**fields)


@pytest.mark.parametrize(
    ("pattern", "target", "matches"),
    [
        ("jobs", "jobs", True),
        ("jobs", "jobs.a", False),
        ("jobs.*", "jobs.a", True),
        ("jobs.*", "jobs.a.b", False),
        ("jobs.>", "jobs.a.b", True),
        ("jobs.>", "jobs", False),
        (">", "anything.at.all", True),
        ("*.b", "a.b", True),
        ("*.b", "a.c", False),
    ],
)
def test_target_patterns_match_as_nats_subjects_do(
    pattern: str, target: str, matches: bool
) -> None:
    assert pattern_matches(pattern, target) is matches


def test_the_first_registered_route_wins_and_bad_patterns_are_refused() -> None:
    app = WorkerApp()

    @app.handler("a.special")
    def special(run: Run) -> None: ...

    @app.handler("a.>", policy=RetryPolicy(max_attempts=1))
    async def rest(run: Run) -> None: ...

    route = app.route("a.special")
    assert route is not None
    assert route.handler is special
    assert not route.is_async
    other = app.route("a.b")
    assert other is not None
    assert other.is_async
    assert other.policy.max_attempts == 1
    assert app.route("b") is None
    for bad in ("", "a..b", "a.>.b", "a b", "a.*x"):
        with pytest.raises(WorkerConfigError):
            app.add(bad, special)
    with pytest.raises(WorkerConfigError, match="no handler"):
        load_app("tests.test_worker_app:EMPTY_APP", None, None)


def test_a_remembered_route_follows_new_routes_and_stays_bounded() -> None:
    """Routes are remembered by target: a route added later still takes the targets it
    matches first (no handler before, now one), and a broker full of distinct targets
    cannot grow the memory past its bound."""
    app = WorkerApp()

    @app.handler("a.*")
    async def a(run: Run) -> None: ...

    assert app.route("b.x") is None
    assert app.route("b.x") is None  # remembered: no handler
    route = app.route("a.x")
    assert route is not None
    assert app.route("a.x") is route

    @app.handler("b.>")
    async def b(run: Run) -> None: ...

    found = app.route("b.x")
    assert found is not None
    assert found.handler is b
    for i in range(3 * ROUTED_TARGETS):
        assert app.route(f"c.{i}") is None
        assert len(app._routed) <= ROUTED_TARGETS
    again = app.route("a.x")
    assert again is not None
    assert again.handler is a


def test_runs_are_claimed_ahead_as_far_as_the_runners_pace_reaches() -> None:
    """Ahead of the runners: what they finished in AHEAD_S over the last window, never
    below the floor (slow runs stay spread over the workers) nor above the ceiling; a
    window with nothing finished falls back to the floor."""
    now = 0.0
    ahead = ClaimAhead(32, 500, clock=lambda: now)
    assert ahead.current() == 32

    def finish(count: int, over_s: float) -> int:
        nonlocal now
        for _ in range(count):
            ahead.finished()
        now += over_s
        return ahead.current()

    window = PACE_WINDOW_S * 1.001  # a whole window, whatever the float sums round to
    assert finish(100, PACE_WINDOW_S / 2) == 32  # the window is not over: as it was
    assert finish(900, window / 2) == round(1000 / window * AHEAD_S)  # 10,000 a second
    assert finish(int(100_000 * window), window) == 500  # 100,000 a second: the ceiling
    assert finish(int(10 * window), window) == 32  # ten a second: below it, the floor
    assert finish(int(100_000 * window), window) == 500
    assert finish(0, 10 * window) == 32  # idle
    assert ClaimAhead(64, 8).current() == 64  # a ceiling below the floor is the floor


EMPTY_APP = WorkerApp()


NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)


def body(**data: Any) -> bytes:
    return json.dumps(
        {"id": "s@1", "data": {"term": 1, "nominal_at": NOW.isoformat(), **data}}
    ).encode()


def test_a_delivery_is_read_with_its_target_and_schedule() -> None:
    delivery = read_delivery("hascheduler.fire.a.b", body(schedule_id="s", payload={"k": 1}))
    assert delivery.fire.target == "a.b"
    assert delivery.fire.schedule_id == "s"
    assert delivery.nominal_at == NOW
    assert delivery.payload == {"k": 1}
    assert delivery.replay == 0
    assert delivery.tenant is None
    assert read_delivery("hascheduler.fire.a", body(tenant="acme")).tenant == "acme"


@pytest.mark.parametrize(
    ("fields", "kept"),
    [
        ({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": "v=1"}, True),
        ({"traceparent": "x" * 100_000, "tracestate": "y" * 100_000}, False),  # too long
        ({"traceparent": 7, "tracestate": ["v"]}, False),  # not strings
    ],
)
def test_a_fires_trace_context_is_read_only_when_it_is_plausible(
    fields: dict[str, Any], kept: bool
) -> None:
    raw = json.dumps(
        {"id": "s@1", **fields, "data": {"term": 1, "nominal_at": NOW.isoformat()}}
    ).encode()
    delivery = read_delivery("hascheduler.fire.a", raw)  # never refused for its trace
    assert (delivery.traceparent is not None) is kept
    assert (delivery.tracestate is not None) is kept


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff",
        b"null",
        b"[]",
        b'{"id": "s@1"}',
        b'{"id": 5, "data": {}}',
        body(term=True),
        body(term=-1),
        body(term="1"),
        body(replay=-2),
        body(nominal_at=None),
        body(nominal_at="yesterday"),
        body(nominal_at="2030-01-01T00:00:00"),
        body(tenant=5),
        body(tenant=""),
        body(tenant=["a"]),
        json.dumps({"id": "", "data": {"term": 1, "nominal_at": NOW.isoformat()}}).encode(),
    ],
    # The same names in every process that collects them (pytest-xdist's workers).
    ids=lambda raw: raw.decode(errors="replace").replace(NOW.isoformat(), "NOW"),
)
def test_what_is_not_a_fire_is_refused_with_a_reason(raw: bytes) -> None:
    with pytest.raises(NotAFire):
        read_delivery("hascheduler.fire.a", raw)


@pytest.mark.parametrize("target", ["a" * 201, "jobs." + "x" * 100_000, "a..b", "a b", ""])
def test_a_subject_naming_no_target_is_refused(target: str) -> None:
    """On RabbitMQ the target comes from a header as long as a frame: over the API's
    200 characters it is no schedule's (and the worker would remember its route)."""
    with pytest.raises(NotAFire, match="names no target"):
        read_delivery(f"hascheduler.fire.{target}", body())


def test_a_target_as_long_as_the_api_allows_is_read() -> None:
    target = ".".join(["t" * 99, "u" * 100])
    assert len(target) == 200
    assert read_delivery(f"hascheduler.fire.{target}", body()).fire.target == target


@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_reading_any_bytes_answers_a_delivery_or_not_a_fire(raw: bytes) -> None:
    try:
        delivery = read_delivery("hascheduler.fire.a", raw)
    except NotAFire as refused:
        reason = str(refused)
        assert reason
    else:
        assert delivery.fire.fire_id
        assert delivery.nominal_at.tzinfo is not None


def minute(minutes: float) -> dt.datetime:
    return NOW + dt.timedelta(minutes=minutes)


def delivery(term: int, nominal: dt.datetime, replay: int = 0) -> Any:
    return read_delivery(
        "hascheduler.fire.a",
        json.dumps(
            {
                "id": "s@x",
                "data": {"term": term, "nominal_at": nominal.isoformat(), "replay": replay},
            }
        ).encode(),
    )


def test_a_deposed_leaders_fire_after_the_new_term_is_stale() -> None:
    f = StaleFilter()
    assert not f.is_stale(delivery(1, minute(1)), minute(1))
    assert not f.is_stale(delivery(2, minute(2)), minute(2))  # term 2 first seen at 2:00
    # Claimed by term 1 in time (nominal before term 2 appeared), delivered late: run it.
    assert not f.is_stale(delivery(1, minute(1.5)), minute(3))
    # A term-1 fire for a time after term 2 was acting: a deposed leader's, dropped.
    assert f.is_stale(delivery(1, minute(4)), minute(4))
    # An operator's replay of it is never stale.
    assert not f.is_stale(delivery(1, minute(4), replay=1), minute(5))


def test_a_runs_cancel_flag_is_an_event_whose_lock_is_made_at_first_use() -> None:
    flag = Run(
        fire_id="f",
        target="t",
        schedule_id="s",
        nominal_at=None,
        payload=None,
        attempt=1,
        worker_id="w",
        event={},
    ).cancelled
    assert isinstance(flag, threading.Event)
    assert not flag.is_set()
    assert "_cond" not in vars(flag)
    assert flag.wait(0) is False
    flag.set()
    assert flag.is_set()
    assert flag.wait(0) is True
    flag.clear()
    assert not flag.is_set()


def test_a_waiter_and_a_setter_racing_to_first_use_share_one_lock() -> None:
    # Each waiter starts waiting as its setter sets: were each to make a Condition of its
    # own, the waiter would sleep through the notify and its wait would time out (False).
    for _ in range(64):
        flag = LazyEvent()
        both = threading.Barrier(2)
        woken: list[bool] = []

        def waiter(
            flag: LazyEvent = flag, both: threading.Barrier = both, woken: list[bool] = woken
        ) -> None:
            both.wait()
            woken.append(flag.wait(10))

        thread = threading.Thread(target=waiter)
        thread.start()
        both.wait()
        flag.set()
        thread.join(15)
        assert woken == [True]
