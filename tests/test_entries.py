"""A mirror entry (core/entries.py): compact, and equal to what its document says."""

from __future__ import annotations

import datetime as dt
from typing import Any

import bson
import pytest
from bson.codec_options import CodecOptions

from hascheduler.core import entries
from hascheduler.core.entries import Entry, entry_from_document
from hascheduler.core.fanout import FanOut
from hascheduler.core.triggers import Interval

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def decoded(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as a driver hands it over: every value a new object."""
    return bson.decode(bson.encode(doc), CodecOptions(tz_aware=True))


def document(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "_id": f"s{i}",
        "revision": 1,
        "trigger": {"kind": "interval", "every": 30.0, "start_at": T0},
        "jitter": 5.0,
        "catchup_window": 600.0,
        "target": "jobs.a",
        **extra,
    }


def test_settings_left_at_their_defaults_share_one_object() -> None:
    plain = [entry_from_document(decoded(document(i))) for i in range(3)]
    assert all(e._uncommon is plain[0]._uncommon for e in plain)
    e = plain[0]
    assert (
        e.fan_out,
        e.overlap,
        e.paused_until,
        e.max_fires,
        e.completed,
        e.namespace,
        e.success_within,
    ) == (None, "allow", None, None, False, "default", None)
    assert not e.dormant
    assert not e.paused_at(T0)


def test_settings_a_schedule_sets_are_its_own() -> None:
    until = T0 + dt.timedelta(hours=1)
    doc = document(
        1,
        overlap="skip",
        max_fires=5,
        completed=False,
        namespace="team-a",
        paused=True,
        pause={"until": until},
        expect={"success_within": 90},
        fan_out={"collection": "tenants", "filter": {"plan": "pro"}},
    )
    e = entry_from_document(decoded(doc))
    assert (e.overlap, e.max_fires, e.namespace, e.paused_until, e.success_within) == (
        "skip",
        5,
        "team-a",
        until,
        90.0,
    )
    assert e.fan_out == FanOut.model_validate(doc["fan_out"])
    assert e.paused_at(T0)
    assert not e.paused_at(until)
    assert e._uncommon is not entry_from_document(decoded(document(2)))._uncommon


def test_replace_and_equality_cover_every_setting() -> None:
    e = entry_from_document(decoded(document(1)))
    assert e == entry_from_document(decoded(document(1)))
    skip = e.replace(overlap="skip")
    assert skip.overlap == "skip"
    assert skip != e
    assert skip.replace(overlap="allow") == e
    assert skip.replace(overlap="allow")._uncommon is e._uncommon  # back to the shared one
    assert e.replace(revision=2).revision == 2
    assert e.replace(completed=True).dormant
    assert "overlap='skip'" in repr(skip)
    with pytest.raises(TypeError):
        hash(e)


def test_the_floats_schedules_repeat_are_kept_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decoded document brings new float objects; the entries keep one per value."""
    monkeypatch.setattr(entries, "_floats", {})  # whatever other tests left in it
    a, b = (entry_from_document(decoded(document(i))) for i in range(2))
    assert a.jitter is b.jitter
    assert a.catchup_window is b.catchup_window
    assert isinstance(a.trigger, Interval)
    assert isinstance(b.trigger, Interval)
    assert a.trigger.every is b.trigger.every


def test_the_shared_floats_are_bounded_and_never_hold_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entries, "_floats", {})
    monkeypatch.setattr(entries, "SHARED_FLOATS", 3)
    kept = [entries._shared(float(i)) for i in range(10)]
    assert kept == [float(i) for i in range(10)]
    assert len(entries._floats) == 3
    nan = float("nan")
    assert entries._shared(nan) is nan
    assert all(v == v for v in entries._floats)


def test_the_constructor_takes_what_the_dataclass_took() -> None:
    fan_out = FanOut.model_validate({"collection": "tenants"})
    e = Entry(
        1,
        False,
        entry_from_document(decoded(document(1))).trigger,
        0.0,
        "all",
        3600.0,
        "t",
        fan_out,
        overlap="buffer_one",
        paused_until=None,
        max_fires=3,
        completed=False,
        namespace="n",
        success_within=None,
    )
    assert (e.fan_out, e.overlap, e.max_fires, e.namespace) == (fan_out, "buffer_one", 3, "n")
