"""The claims a batch of due fires becomes (core/claims.py): a table of fan-out cases."""

from __future__ import annotations

import datetime as dt

import pytest

from hascheduler.core.claims import Claim, Tenants, expand
from hascheduler.core.entries import Entry
from hascheduler.core.fanout import FanOut
from hascheduler.core.fire_queue import Due
from hascheduler.core.triggers import Interval, fire_id

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
NOMINAL = T0 + dt.timedelta(minutes=1)
DUE = NOMINAL + dt.timedelta(seconds=2)  # two seconds of jitter
TENANTS = FanOut.model_validate({"collection": "tenants"})
ACCOUNTS = FanOut.model_validate({"collection": "accounts"})


def entry(fan_out: FanOut | None = None) -> Entry:
    return Entry(1, False, Interval(60.0, T0), 2.0, "all", 3600.0, "t", fan_out)


ENTRIES = {"plain": entry(), "fans": entry(TENANTS), "big": entry(ACCOUNTS)}
SOURCES: dict[str, list[str] | None] = {"tenants": ["a", "b"], "accounts": ["x", "y", "z"]}


def due(schedule_id: str) -> Due:
    return Due(DUE, NOMINAL, schedule_id, 1)


def tenants_now(sources: dict[str, list[str] | None]) -> Tenants:
    return lambda fan_out: sources[fan_out.collection]


@pytest.mark.parametrize(
    ("schedule", "sources", "may_wait", "claims", "waiting", "refused"),
    [
        # A plain fire is one claim, keyed by its fire id.
        ("plain", SOURCES, True, [fire_id("plain", NOMINAL)], 0, None),
        # A fire whose schedule is gone from the mirror is claimed: the due-time check skips it.
        ("gone", SOURCES, True, [fire_id("gone", NOMINAL)], 0, None),
        # One claim per selected tenant, each keyed <fire id>/<tenant>.
        (
            "fans",
            SOURCES,
            True,
            [f"{fire_id('fans', NOMINAL)}/a", f"{fire_id('fans', NOMINAL)}/b"],
            0,
            None,
        ),
        # No tenant selected: nothing to claim, nothing refused.
        ("fans", {**SOURCES, "tenants": []}, True, [], 0, None),
        # The source's mirror is loading: the fire waits for it...
        ("fans", {**SOURCES, "tenants": None}, True, [], 1, None),
        # ...unless it may not wait any more, when it is refused with the reason.
        ("fans", {**SOURCES, "tenants": None}, False, [], 0, "not in sync within 30 s"),
        # More tenants than the bound: refused whole, never a subset.
        ("big", SOURCES, True, [], 0, "selects 3 tenants at the claim, above the bound of 2"),
    ],
)
def test_expansion(
    schedule: str,
    sources: dict[str, list[str] | None],
    may_wait: bool,
    claims: list[str],
    waiting: int,
    refused: str | None,
) -> None:
    out = expand(
        [due(schedule)],
        ENTRIES,
        tenants_now(sources),
        max_fan_out=2,
        may_wait=may_wait,
        sync_wait_s=30,
    )
    assert [c.fire_id for c in out.claims] == claims
    assert all(
        (c.schedule_id, c.nominal_at, c.due_at) == (schedule, NOMINAL, DUE) for c in out.claims
    )
    assert len(out.waiting) == waiting
    reasons = [reason for _, reason in out.refused]
    if refused is None:
        assert reasons == []
    else:
        assert len(reasons) == 1
        assert refused in reasons[0]


def test_without_sources_a_fan_out_is_refused_and_plain_fires_are_claimed() -> None:
    out = expand(
        [due("plain"), due("fans")], ENTRIES, None, max_fan_out=10, may_wait=False, sync_wait_s=30
    )
    assert [c.fire_id for c in out.claims] == [fire_id("plain", NOMINAL)]
    assert [d.schedule_id for d, _ in out.refused] == ["fans"]


def test_a_claim_names_its_tenant() -> None:
    claim = Claim.of(due("fans"), "a")
    assert (claim.fire_id, claim.tenant, claim.attempts) == (
        f"{fire_id('fans', NOMINAL)}/a",
        "a",
        0,
    )
