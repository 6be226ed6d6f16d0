"""Overlap policies decided from the open runs and waiting fires alone (core/overlap.py)."""

from __future__ import annotations

import datetime as dt

import pytest

from hascheduler.core.overlap import (
    BUFFER_FULL,
    OVERLAP,
    POLICIES,
    Candidate,
    decide,
)

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def fire(n: int, policy: str, key: tuple[str, str | None] = ("s", None)) -> Candidate:
    return Candidate(f"{key[0]}@{n}", key, T0 + dt.timedelta(seconds=n), policy)


def test_the_policies_are_the_models_choices() -> None:
    from hascheduler.core.models import ScheduleFields

    schema = ScheduleFields.model_json_schema()
    assert tuple(schema["properties"]["overlap"]["enum"]) == POLICIES


@pytest.mark.parametrize("policy", POLICIES)
def test_nothing_open_publishes_whatever_the_policy(policy: str) -> None:
    decision = decide([fire(1, policy)], {}, {}, 10)
    assert decision.publish == ["s@1"]
    assert not decision.skip
    assert not decision.buffer


def test_allow_publishes_beside_an_open_run() -> None:
    decision = decide([fire(2, "allow")], {("s", None): ["s@1"]}, {}, 10)
    assert decision.publish == ["s@2"]


def test_skip_records_the_open_run() -> None:
    decision = decide([fire(2, "skip")], {("s", None): ["s@1"]}, {}, 10)
    assert decision.publish == []
    assert decision.skip == {"s@2": (OVERLAP, "s@1")}


def test_a_fire_whose_own_run_is_open_is_published_again() -> None:
    """Republished after a failover: its run was reserved by the previous publish."""
    decision = decide([fire(1, "skip")], {("s", None): ["s@1"]}, {}, 10)
    assert decision.publish == ["s@1"]


def test_two_fires_of_one_key_in_one_batch_the_second_sees_the_first_open() -> None:
    decision = decide([fire(2, "skip"), fire(1, "skip")], {}, {}, 10)
    assert decision.publish == ["s@1"]
    assert decision.skip == {"s@2": (OVERLAP, "s@1")}


def test_buffer_one_keeps_one_waiting_and_skips_the_rest() -> None:
    decision = decide(
        [fire(2, "buffer_one"), fire(3, "buffer_one")], {("s", None): ["s@1"]}, {}, 10
    )
    assert decision.buffer == {"s@2": "s@1"}
    assert decision.skip == {"s@3": (OVERLAP, "s@1")}
    already = decide([fire(4, "buffer_one")], {("s", None): ["s@1"]}, {("s", None): 1}, 10)
    assert already.skip == {"s@4": (OVERLAP, "s@1")}


def test_buffer_all_waits_in_order_up_to_its_bound() -> None:
    decision = decide(
        [fire(n, "buffer_all") for n in (2, 3, 4)], {("s", None): ["s@1"]}, {("s", None): 1}, 3
    )
    assert list(decision.buffer) == ["s@2", "s@3"]
    assert decision.skip == {"s@4": (BUFFER_FULL, "s@1")}


def test_a_waiting_fire_keeps_its_place_when_the_run_has_ended() -> None:
    """No run open, but a fire still waits (its release is at the next poll): a new fire
    waits behind it rather than overtake it."""
    decision = decide([fire(3, "buffer_all")], {}, {("s", None): 1}, 10)
    assert decision.buffer == {"s@3": ""}
    assert not decision.publish


def test_cancel_other_cancels_the_open_run_and_waits_for_it() -> None:
    decision = decide([fire(2, "cancel_other")], {("s", None): ["s@1"]}, {}, 10)
    assert decision.cancel == {"s@1"}
    assert decision.buffer == {"s@2": "s@1"}
    later = decide([fire(3, "cancel_other")], {("s", None): ["s@1"]}, {("s", None): 1}, 10)
    assert later.skip == {"s@3": (OVERLAP, "s@1")}
    assert not later.cancel


def test_per_tenant_keys_are_separate() -> None:
    a, b = ("s", "a"), ("s", "b")
    candidates = [Candidate("s@2/a", a, T0, "skip"), Candidate("s@2/b", b, T0, "skip")]
    decision = decide(candidates, {a: ["s@1/a"]}, {}, 10)
    assert decision.publish == ["s@2/b"]
    assert decision.skip == {"s@2/a": (OVERLAP, "s@1/a")}
