"""The chaos soak: its independent auditor (pure) and a short soak of the real cluster."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hascheduler_dev.devcluster.supervisor import DevSettings, Supervisor

from bench.chaos import KINDS, PARTITIONS, Soak, failover_gaps
from bench.chaos_audit import (
    SoakBackfill,
    SoakSchedule,
    audit,
    audit_backfills,
    audit_runs,
    streamed_fire,
)
from bench.chaos_records import Fault, LeaseSample
from hascheduler.core.models import ScheduleIn
from hascheduler.core.triggers import iso_utc

ROOT = Path(__file__).resolve().parent.parent
UTC = dt.UTC
# Five seconds before a whole minute, an hour from now: the audit's arithmetic crosses a
# minute, and the soak's one-off instants stay in the future whatever the date.
T0 = (dt.datetime.now(UTC) + dt.timedelta(hours=1)).replace(minute=0, second=55, microsecond=0)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def message(
    sid: str, nominal: dt.datetime, stored: dt.datetime, term: int = 1, tenant: str | None = None
) -> tuple[dict[str, Any], dt.datetime]:
    iso = nominal.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    data: dict[str, Any] = {"schedule_id": sid, "nominal_at": iso, "term": term}
    if tenant is None:
        return {"id": f"{sid}@{iso}", "data": data}, stored
    return {"id": f"{sid}@{iso}/{tenant}", "data": {**data, "tenant": tenant}}, stored


def test_nominal_times_by_arithmetic() -> None:
    step = SoakSchedule("s", "second_step", step_s=5)
    # 10:00:55 .. 10:01:12 crosses the minute: seconds 55, 00, 05, 10.
    assert step.nominal_times(at(0), at(17)) == [at(0), at(5), at(10), at(15)]
    assert SoakSchedule("e", "second_step").nominal_times(at(0.5), at(3)) == [at(1), at(2), at(3)]
    interval = SoakSchedule("i", "interval", every_s=3, anchor=at(2))
    assert interval.nominal_times(at(0), at(9)) == [at(2), at(5), at(8)]
    assert interval.nominal_times(at(6), at(11)) == [at(8), at(11)]
    once = SoakSchedule("o", "at", instants=(at(-1), at(1.25), at(30)))
    assert once.nominal_times(at(0), at(10)) == [at(1.25)]


def test_soak_schedules_are_valid_api_bodies() -> None:
    for s in (
        SoakSchedule("s", "second_step", step_s=5, jitter_s=1.5),
        SoakSchedule("e", "second_step"),
        SoakSchedule("i", "interval", every_s=3, anchor=at(2)),
        SoakSchedule("o", "at", instants=(at(1.25),)),
    ):
        # Validated as of a moment before T0: T0 is "an hour ahead" rounded down to its
        # hour, which a slow run can overtake.
        body = ScheduleIn.model_validate(s.api_body("chaos"), context={"now": at(-60)})
        assert body.catchup == "all"
        assert body.id == s.id


def test_audit_passes_a_clean_stream_and_measures_lateness() -> None:
    s = SoakSchedule("e", "second_step")
    stream = [message("e", at(i), at(i + 0.01 * i)) for i in range(5)]
    report = audit([s], stream, at(0), at(4), [], late_bound_s=1.0)
    assert report.ok
    assert report.expected == report.delivered == 5
    assert sorted(round(v, 3) for v in report.lateness_clear) == [0, 0.01, 0.02, 0.03, 0.04]


def test_audit_catches_missing_duplicated_unexpected_early_and_malformed() -> None:
    e, f = SoakSchedule("e", "second_step"), SoakSchedule("f", "second_step", step_s=5)
    stream = [
        message("e", at(0), at(0.1)),
        message("e", at(1), at(1.1)),
        message("e", at(1), at(1.9)),  # a second copy
        message("e", at(3), at(2.9)),  # stored before it was due
        message("f", at(0), at(0.1)),
        message("f", at(1), at(1.1)),  # not a nominal time
        message("other", at(1), at(1.1)),  # not ours: ignored
        message("e", at(60), at(60.1)),  # outside the window: ignored
        (
            {
                "id": "e@wrong",
                "data": {"schedule_id": "e", "nominal_at": iso_utc(at(2)), "term": 1},
            },
            at(2.1),
        ),
    ]
    report = audit([e, f], stream, at(0), at(4), [], late_bound_s=1.0)
    assert report.missing == [("e", at(2)), ("e", at(4))]
    assert report.duplicated == [(("e", at(1)), 2)]
    assert report.unexpected == [("f", at(1))]
    assert report.early == [("e", at(3))]
    assert report.malformed == 1
    assert not report.exactly_once
    assert not report.ok


def test_a_fan_out_is_audited_per_tenant() -> None:
    fan = SoakSchedule("f", "second_step", tenants=("a", "b"))
    assert fan.api_body("chaos")["fan_out"]["filter"] == {"_id": {"$in": ["a", "b"]}}
    stream = [
        message("f", at(0), at(0.1), tenant="a"),
        message("f", at(0), at(0.2), tenant="b"),
        message("f", at(1), at(1.1), tenant="a"),
        message("f", at(1), at(1.2), tenant="a"),
        message("f", at(0), at(0.1)),  # the schedule's fire without a tenant
        message("f", at(1), at(1.1), tenant="c"),  # a tenant it does not select
        (
            {
                "id": f"f@{iso_utc(at(1))}/b",
                "data": {  # the id names another tenant
                    "schedule_id": "f",
                    "nominal_at": iso_utc(at(1)),
                    "term": 1,
                    "tenant": "a",
                },
            },
            at(1.3),
        ),
    ]
    report = audit([fan], stream, at(0), at(1), [], late_bound_s=1.0)
    assert report.expected == 4
    assert report.missing == [("f/b", at(1))]
    assert report.duplicated == [(("f/a", at(1)), 2)]
    assert sorted(report.unexpected) == [("f", at(0)), ("f/c", at(1))]
    assert report.malformed == 1


def test_lateness_bound_applies_outside_fault_windows_only() -> None:
    e = SoakSchedule("e", "second_step")
    j = SoakSchedule("j", "second_step", jitter_s=0.5)
    stream = [
        message("e", at(0), at(0.1)),
        message("e", at(1), at(4.0)),
        message("e", at(2), at(6.0)),
        message("j", at(0), at(1.2)),  # 0.7 s past its latest due time: within 1 s
        message("j", at(1), at(3.0)),
        message("j", at(2), at(5.0)),
    ]
    report = audit([e, j], stream, at(0), at(2), [(at(1.8), at(2.2))], late_bound_s=1.0)
    assert report.exactly_once
    assert [(k, round(v, 3)) for k, v in report.over_bound] == [
        (("e", at(1)), 3.0),
        (("j", at(1)), 1.5),
    ]
    assert report.lateness_faulted == [4.0]  # e@2 is in the window; j's are left out
    assert not report.ok


def test_a_streamed_fire_is_only_a_fire_event() -> None:
    assert streamed_fire({"data": "x"}, at(0)) is None
    assert (
        streamed_fire(
            {"id": "a@b", "data": {"schedule_id": "a", "nominal_at": "b", "term": 1}}, at(0)
        )
        is None
    )
    event, stored = message("a", at(0), at(0.5), term=7)
    fire = streamed_fire(event, stored)
    assert fire is not None
    assert (fire.schedule_id, fire.nominal, fire.term) == ("a", at(0), 7)


def test_failover_gap_runs_from_the_fault_to_the_newer_term() -> None:
    kill = Fault("leader-kill", "r1", at(10), 0.0, term=3, leader=True, settle_s=7)
    standby = Fault("standby-kill", "r3", at(12), 0.0, term=3, leader=False, settle_s=2)
    # r2 pauses shorter than its renew deadline and keeps the lease; the takeover after
    # the later cut-off belongs to the cut-off, not to the pause.
    short_stop = Fault("leader-stop", "r2", at(30), 1.0, term=4, leader=True, settle_s=7)
    cutoff = Fault("db-cutoff", "r2", at(40), 5.0, term=4, leader=True, settle_s=7)
    samples = [
        LeaseSample(at(9), "r1", 3),
        LeaseSample(at(13.5), "r2", 4),
        LeaseSample(at(31), "r2", 4),
        LeaseSample(at(44), "r4", 5),
    ]
    fires = [(3, at(9.5)), (4, at(14.0)), (4, at(15.0)), (4, at(32)), (5, at(44.5))]
    gaps = failover_gaps([kill, short_stop, standby, cutoff], samples, fires)
    assert gaps == [
        {"kind": "leader-kill", "takeover_s": 3.5, "gap_s": 4.0},
        {"kind": "db-cutoff", "takeover_s": 4.0, "gap_s": 4.5},
    ]


def soak_met(kinds: set[str], partitions: bool = True) -> Soak:
    """A soak of three replicas (r1 leading), two workers and a 3-node NATS cluster, all
    up, that has injected each of ``kinds`` once."""

    def child(name: str, role: str = "replica") -> SimpleNamespace:
        return SimpleNamespace(name=name, role=role, alive=True, retiring=False)

    supervisor = SimpleNamespace(
        replicas=[child("r1"), child("r2"), child("r3")],
        workers=[child("w1"), child("w2")],
        others=[child(f"nats-{i}", "nats") for i in (1, 2, 3)],
    )
    soak = Soak(
        argparse.Namespace(partitions=partitions),
        cast(DevSettings, SimpleNamespace(nats_cluster=3)),  # what the checks read of them
        random.Random(1),
        cast(Supervisor, supervisor),
    )
    soak.samples.append(LeaseSample(at(0), "r1", 1))
    soak.faults = [Fault(kind, "x", at(0), 0.0, 1, False, 0.0) for kind in sorted(kinds)]
    return soak


def test_a_fault_kind_still_to_come_is_waited_for_rather_than_one_repeated() -> None:
    """Each kind the soak can inject comes once before any repeats: with one to come that
    does not apply now (the leader stopped: its partitions wait for it), the turn passes
    with no fault, where a repeat took it and a short soak on a slow machine ended without
    that kind (the soak in CI could then miss a partition)."""
    soak = soak_met(set(KINDS) - {"leader-one-way-db"})
    soak.busy.add("r1")
    assert soak._pick() is None
    soak.busy.clear()
    assert soak._pick() == ("leader-one-way-db", "r1")
    soak.faults.append(Fault("leader-one-way-db", "r1", at(1), 0.0, 1, True, 0.0))
    assert soak._pick() is not None  # every kind met: repeats, weighted
    # Without partitions, those kinds are not to come: the others repeat.
    soak = soak_met(set(KINDS) - set(PARTITIONS), partitions=False)
    assert soak._pick() is not None


def run_chaos(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "chaos.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_chaos_refuses_bad_arguments() -> None:
    done = run_chaos("--duration", "5", timeout=60)
    assert done.returncode == 2
    assert "--duration" in done.stderr
    assert "at least 10" in done.stderr


@pytest.mark.long(75)
@pytest.mark.timeout(420)
def test_short_soak_loses_duplicates_and_fires_early_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    # Every process in a network namespace of its own (--partitions, the default): the
    # soak meets clock skew and every partition kind too, beside pauses until an instant,
    # backfills, buffer_one schedules and schedules created while faulted.
    done = run_chaos(
        "--duration",
        "50",
        "--fault-every",
        "1.6",
        "--calm",
        "5",
        "--replicas",
        "3",
        "--schedules",
        "40",
        "--seed",
        "11",
        "--min-faults",
        str(len(KINDS)),
        "--pauses-every",
        "6",
        "--backfills-every",
        "8",
        "--out",
        str(out),
        timeout=400,
    )
    print(done.stdout[-4000:], done.stderr[-4000:])
    report = json.loads((out / "report.json").read_text())
    assert report["expected"] > 1000
    assert report["tenant_fires"] > 100, "no fan-out fire was audited"
    assert report["paused_optional"] > 0, "no pause until an instant met the faults"
    assert report["backfills"]["answered"] > 0, "no backfill met the faults"
    assert report["backfills"]["missing"] == report["backfills"]["duplicated"] == 0
    assert report["backfills"]["miscounted"] == 0
    assert report["missing"] == 0, report["table"]
    assert report["duplicated"] == 0, report["table"]
    assert report["unexpected"] == 0
    assert report["early"] == 0
    kinds = {f["kind"] for f in report["faults"]}
    assert len(report["faults"]) >= len(KINDS)
    assert {"clock-skew", *PARTITIONS} <= kinds, kinds
    history = report["lease_history"]
    assert history["violations"] == history["stale_unexplained"] == 0, history
    assert history["terms"] > 1
    assert history["acts"] > 1000
    assert {"leader-kill", "leader-term"} & kinds, kinds
    assert "nats-restart" in kinds, kinds
    assert {"nats-node-kill", "db-step-down"} <= kinds, kinds
    assert report["gaps"], "no leader fault was followed by a takeover"
    assert {"worker-kill", "worker-stop"} & kinds, kinds
    assert kinds == set(KINDS), "every kind once before any repeats"
    runs = report["runs"]
    assert runs["fires"] >= report["delivered"]
    assert runs["succeeded"] + runs["dead"] == runs["fires"], runs
    assert runs["dead"] > 0, "no doomed fire: the dead path went untested"
    assert runs["lost"] == runs["unsettled"] == runs["unexplained"] == 0, runs
    assert any(n > 1 for n in map(int, runs["attempts"])), "no retry happened"
    assert done.returncode == 0, report["checks"]
    for png in ("timeline.png", "failover-gaps.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_audit_catches_lost_unsettled_wrong_and_unexplained_runs() -> None:
    fires = {f"f{i}" for i in range(7)}
    runs = {
        "f0": {"state": "succeeded", "attempts": 1},
        "f1": {"state": "dead", "attempts": 1, "last_error": "PermanentFailure: x"},
        "f2": {"state": "running", "attempts": 1},
        "f3": {"state": "dead", "attempts": 10, "last_error": "E"},  # not doomed
        "f4": {"state": "succeeded", "attempts": 2},  # done twice by w2, interrupted
        "f5": {"state": "succeeded", "attempts": 2},
    }  # done twice, nobody interrupted
    effects = [
        ("f0", "w1", 1, "start"),
        ("f0", "w1", 1, "done"),
        ("f4", "w2", 1, "done"),
        ("f4", "w1", 2, "done"),
        ("f5", "w1", 1, "done"),
        ("f5", "w1", 2, "done"),
    ]
    report = audit_runs(fires, runs, effects, lambda f: f == "f1", interrupted={"w2"})
    assert (report.succeeded, report.dead) == (3, 2)
    assert report.lost == ["f6"]
    assert report.unsettled == ["f2"]
    assert report.wrongly_dead == ["f3"]
    assert report.repeated == [("f4", 2), ("f5", 2)]
    assert report.unexplained == ["f5"]
    assert not report.ok


def test_a_pause_makes_the_instants_it_covers_optional_and_every_later_one_due() -> None:
    """Paused from 1 s to 3.5 s: 1, 2 and 3 may be in the stream (at most once) or not;
    0 and 4 must be there once; a lost instant after the pause's end is missing."""
    paused = SoakSchedule("p", "second_step", pauses=((at(1), at(3.5)),))
    stream = [
        message("p", at(0), at(0.1)),
        message("p", at(1), at(1.1)),
        message("p", at(4), at(4.1)),
    ]
    report = audit([paused], stream, at(0), at(5), [], late_bound_s=1.0)
    assert (report.expected, report.paused_optional) == (3, 3)
    assert report.missing == [("p", at(5))]
    twice = audit(
        [paused],
        [*stream, message("p", at(2), at(2.1)), message("p", at(2), at(2.2))],
        at(0),
        at(4),
        [],
        1.0,
    )
    assert twice.duplicated == [(("p", at(2)), 2)]
    assert twice.missing == []


def test_an_overlap_schedules_instant_is_fired_or_recorded_skipped_never_both() -> None:
    buffered = SoakSchedule("b", "second_step", overlap="buffer_one")
    plain = SoakSchedule("e", "second_step")
    assert buffered.api_body("chaos")["overlap"] == "buffer_one"
    stream = [
        message("b", at(0), at(0.1)),
        message("b", at(2), at(5.0)),  # held back
        message("e", at(0), at(0.1)),
        message("e", at(1), at(1.1)),
        message("e", at(2), at(2.1)),
    ]
    skipped = frozenset({("b", at(1)), ("b", at(2)), ("e", at(1))})
    report = audit([buffered, plain], stream, at(0), at(2), [], 1.0, skipped)
    assert report.skipped_accounted == 1  # b at 1
    assert report.fired_and_skipped == [("b", at(2)), ("e", at(1))]
    assert report.missing == []
    assert report.over_bound == []  # a held-back fire is late by design
    assert not report.exactly_once
    # A plain schedule's instant recorded skipped is still missing: only a policy's count.
    lost = audit(
        [plain], [message("e", at(0), at(0.1))], at(0), at(1), [], 1.0, frozenset({("e", at(1))})
    )
    assert lost.missing == [("e", at(1))]


def test_backfills_are_audited_instant_by_instant_and_by_their_record() -> None:
    answered = SoakBackfill("e", at(-600), at(-597), "b1")
    lost = SoakBackfill("e", at(-500), at(-498))  # its answer lost: may or may not exist
    stream = [
        message("e", at(-600), at(1)),
        message("e", at(-599), at(1)),
        message("e", at(-599), at(2)),  # twice
        message("e", at(-500), at(1)),
        message("e", at(-499), at(1)),
        message("e", at(-499), at(2)),
    ]  # the unanswered one's, twice
    exact = {"state": "done", "fired": 3, "skipped": 0, "withdrawn": 0}
    report = audit_backfills([answered, lost], stream, {"b1": exact})
    assert (report.asked, report.answered, report.expected, report.delivered) == (2, 1, 3, 2)
    assert report.missing == [("e", at(-598))]
    assert report.duplicated == [(("e", at(-599)), 2), (("e", at(-499)), 2)]
    assert report.miscounted == []
    assert not report.ok
    wrong = audit_backfills([answered], [], {"b1": {**exact, "skipped": 1}})
    assert wrong.miscounted == [("b1", {**exact, "skipped": 1})]
