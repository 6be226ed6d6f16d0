"""``hascheduler apply`` and ``export`` against a real replica: declarations made real,
idempotently, pruned by selector, planned exactly, refused whole, never lost to a
concurrent edit."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hascheduler.cli.apply import READ_AHEAD_BYTES
from hascheduler.client import Client
from hascheduler.client.apply import declare, execute, read_plan
from tests.conftest import API_WRITE_TOKEN as WRITE
from tests.conftest import ApiReplica

pytestmark = [pytest.mark.timeout(180)]


def hascheduler(
    replica: ApiReplica, *args: str, stdin: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hascheduler.cli",
            args[0],
            "--api",
            replica.url,
            "--token",
            WRITE,
            *args[1:],
        ],
        input=stdin,
        capture_output=True,
        timeout=120,
        check=False,
    )
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(), done.stderr.decode()
    )


def schedule(schedule_id: str, team: str = "billing", **extra: Any) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "name": schedule_id,
        "target": f"{team}.{schedule_id}",
        "trigger": {"kind": "cron", "cron": "0 6 * * *", "timezone": "Europe/Paris"},
        "labels": {"team": team},
        **extra,
    }


def write(path: Path, *documents: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump_all(list(documents), sort_keys=False))
    return path


def test_apply_creates_then_changes_nothing_then_updates_and_prunes(
    api_replica: ApiReplica, tmp_path: Path
) -> None:
    billing = write(tmp_path / "billing.yaml", schedule("invoices"), schedule("dunning"))
    first = hascheduler(api_replica, "apply", "-f", str(billing))
    assert first.returncode == 0, first.stderr
    assert "+ create invoices" in first.stdout
    assert "applied: 2 written, 0 failed" in first.stdout
    again = hascheduler(api_replica, "apply", "-f", str(billing))
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [
        "= unchanged invoices",
        "= unchanged dunning",
        "0 to create, 0 to update, 2 unchanged, 0 to delete",
        "nothing to do",
    ]

    # Another team's schedule, made by hand: a prune by the billing selector never sees it.
    with Client(api_replica.url, WRITE) as api:
        api.create_schedule(schedule("deploys", team="ops"))
    write(billing, schedule("invoices", jitter=5))  # dunning deleted, invoices changed
    plan = hascheduler(
        api_replica,
        "apply",
        "-f",
        str(billing),
        "--prune",
        "--selector",
        "team=billing",
        "--dry-run",
    )
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.splitlines() == [
        "prune: schedules labelled team=billing that no file declares, in default",
        f"~ update invoices  ({billing}#1)",
        "    jitter: 0.0 -> 5.0",
        "- delete dunning",
        "0 to create, 1 to update, 0 unchanged, 1 to delete",
    ]
    with Client(api_replica.url, WRITE) as api:
        assert {s.id for s in api.schedules()} == {"invoices", "dunning", "deploys"}
        applied = hascheduler(
            api_replica, "apply", "-f", str(billing), "--prune", "--selector", "team=billing"
        )
        assert applied.returncode == 0, applied.stderr
        assert {s.id: s.jitter for s in api.schedules()} == {"invoices": 5.0, "deploys": 0.0}


def test_export_then_apply_is_a_no_op(api_replica: ApiReplica, tmp_path: Path) -> None:
    with Client(api_replica.url, WRITE) as api:
        api.create_schedule(schedule("a", payload={"n": 1}, overlap="skip"))
        api.create_schedule({**schedule("b"), "trigger": {"kind": "interval", "every": 30}})
        api.create_schedule(schedule("c", team="ops"))
    exported = hascheduler(api_replica, "export", "--selector", "team=billing")
    assert exported.returncode == 0, exported.stderr
    assert [d["id"] for d in yaml.safe_load_all(exported.stdout)] == ["a", "b"]
    back = hascheduler(
        api_replica,
        "apply",
        "-f",
        "-",
        "--prune",
        "--selector",
        "team=billing",
        stdin=exported.stdout.encode(),
    )
    assert back.returncode == 0, back.stderr
    assert back.stdout.splitlines()[-1] == "nothing to do"
    as_json = hascheduler(api_replica, "export", "--format", "json")
    (tmp_path / "all.json").write_text(as_json.stdout)
    assert (
        hascheduler(api_replica, "apply", "-f", str(tmp_path)).stdout.splitlines()[-1]
        == "nothing to do"
    )


def test_apply_carries_a_pause_until_an_instant_and_a_file_saying_unpaused_resumes(
    api_replica: ApiReplica, tmp_path: Path
) -> None:
    """A schedule an operator paused until an instant: a file saying `paused: true` leaves
    it so (unchanged: the pause route owns the instant, and it still resumes by itself
    then), export then apply stays a no-op; a file saying `paused: false` resumes it now."""
    path = write(tmp_path / "s.yaml", schedule("nightly", paused=True))
    assert hascheduler(api_replica, "apply", "-f", str(path)).returncode == 0
    until = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    with Client(api_replica.url, WRITE) as api:
        api.pause("nightly", "partner maintenance", until)
        again = hascheduler(api_replica, "apply", "-f", str(path))
        assert again.stdout.splitlines()[-1] == "nothing to do", again.stdout
        kept = api.get_schedule("nightly")
        assert kept.pause is not None
        assert kept.pause.until is not None
        assert abs(kept.pause.until - until) < dt.timedelta(milliseconds=2)
        exported = hascheduler(api_replica, "export")
        back = hascheduler(api_replica, "apply", "-f", "-", stdin=exported.stdout.encode())
        assert back.stdout.splitlines()[-1] == "nothing to do", back.stdout
        write(path, schedule("nightly", paused=False))
        resumed = hascheduler(api_replica, "apply", "-f", str(path))
        assert resumed.returncode == 0, resumed.stderr
        assert "paused: true -> false" in resumed.stdout
        after = api.get_schedule("nightly")
        assert (after.paused, after.pause) == (False, None)


def test_one_invalid_document_among_a_hundred_writes_nothing(
    api_replica: ApiReplica, tmp_path: Path
) -> None:
    documents = [schedule(f"s{i:03d}") for i in range(100)]
    documents[57]["trigger"] = {"kind": "cron", "cron": "61 * * * *"}
    documents[81]["jitter"] = -1
    done = hascheduler(api_replica, "apply", "-f", str(write(tmp_path / "many.yaml", *documents)))
    assert done.returncode == 2
    assert "nothing written" in done.stderr
    assert "many.yaml#58 (s057): trigger" in done.stderr
    assert "many.yaml#82 (s081): jitter" in done.stderr
    with Client(api_replica.url, WRITE) as api:
        assert list(api.schedules()) == []


@pytest.mark.parametrize(
    ("name", "content", "complaint"),
    [
        (
            "twice.yaml",
            yaml.safe_dump_all([schedule("x"), schedule("x")]).encode(),
            "'x' is declared twice",
        ),
        (
            "bomb.yaml",
            b"a: &a [x, x, x, x, x, x, x, x, x]\n"
            + b"".join(
                f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}]\n".encode()
                for p, c in zip("abcdefgh", "bcdefghi", strict=True)
            )
            + b"id: z\n",
            "aliases (*name) are not accepted",
        ),
        ("latin1.yaml", "name: caf\xe9\n".encode("latin-1"), "not UTF-8"),
        (
            "noid.yaml",
            yaml.safe_dump({k: v for k, v in schedule("y").items() if k != "id"}).encode(),
            "id: required",
        ),
        ("list.yaml", b"- 1\n- 2\n", "a schedule is a mapping"),
        ("broken.json", b'{"id": "j", ', "broken.json"),
    ],
)
def test_hostile_input_is_refused_whole(
    api_replica: ApiReplica, tmp_path: Path, name: str, content: bytes, complaint: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    done = hascheduler(
        api_replica,
        "apply",
        "-f",
        str(path),
        "-f",
        str(write(tmp_path / "good.yaml", schedule("good"))),
    )
    assert done.returncode == 2, done.stdout
    assert complaint in done.stderr
    with Client(api_replica.url, WRITE) as api:
        assert list(api.schedules()) == []


def test_input_past_the_bound_is_refused_before_it_is_read(
    api_replica: ApiReplica, tmp_path: Path
) -> None:
    big = tmp_path / "big.yaml"
    with open(big, "wb") as out:
        out.truncate(17 * 1024 * 1024)  # sparse: 17 MiB of nothing, made at once
    done = hascheduler(api_replica, "apply", "-f", str(big))
    assert done.returncode == 2
    assert "more than 16 MiB" in done.stderr
    stdin = hascheduler(api_replica, "apply", "-f", "-", stdin=b"#" * (17 * 1024 * 1024))
    assert stdin.returncode == 2
    assert "more than 16 MiB" in stdin.stderr


def test_prune_needs_a_selector_and_declarations_must_carry_it(
    api_replica: ApiReplica, tmp_path: Path
) -> None:
    path = write(tmp_path / "s.yaml", schedule("s", team="ops"))
    alone = hascheduler(api_replica, "apply", "-f", str(path), "--prune")
    assert alone.returncode == 2
    assert "--prune needs --selector" in alone.stderr
    other = hascheduler(
        api_replica, "apply", "-f", str(path), "--prune", "--selector", "team=billing"
    )
    assert other.returncode == 2
    assert "lacks team=billing" in other.stderr


def test_a_schedule_edited_between_plan_and_write_is_reported_not_overwritten(
    api_replica: ApiReplica,
) -> None:
    with Client(api_replica.url, WRITE) as api:
        api.create_schedule(schedule("contested"))
        api.create_schedule(schedule("calm"))
        declared = declare(
            [("file#1", schedule("contested", jitter=3)), ("file#2", schedule("calm", jitter=4))],
            dt.datetime.now(dt.UTC),
        )
        steps = read_plan(api, declared, None)
        api.patch_schedule("contested", {"jitter": 9})  # someone else, meanwhile
        outcome = execute(api, steps)
        assert [s.schedule_id for s, _ in outcome.failed] == ["contested"]
        assert "changed since the plan read it" in outcome.failed[0][1]
        assert [s.schedule_id for s in outcome.done] == ["calm"]
        assert api.get_schedule("contested").jitter == 9  # not lost
        assert api.get_schedule("calm").jitter == 4


def test_an_unreachable_api_exits_1(tmp_path: Path) -> None:
    path = write(tmp_path / "s.yaml", schedule("s"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hascheduler.cli",
            "apply",
            "--api",
            "http://127.0.0.1:9",
            "-f",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "cannot reach the API" in done.stderr


def test_a_large_invalid_input_is_refused_though_the_read_ahead_fails(tmp_path: Path) -> None:
    """Past READ_AHEAD_BYTES the cluster is read while the input is parsed; the input's
    problems still come first, and the read (here failing) is not waited for."""
    documents = [schedule(f"s{i:04d}", description="x" * 200) for i in range(400)]
    documents[399]["trigger"] = {"kind": "cron", "cron": "61 * * * *"}
    path = write(tmp_path / "large.yaml", *documents)
    assert path.stat().st_size >= READ_AHEAD_BYTES
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hascheduler.cli",
            "apply",
            "--api",
            "http://127.0.0.1:9",
            "-f",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "large.yaml#400 (s0399): trigger" in done.stderr


def test_json_lists_and_directories_are_read_alike(api_replica: ApiReplica, tmp_path: Path) -> None:
    folder = tmp_path / "schedules"
    (folder / "nested").mkdir(parents=True)
    (folder / "one.json").write_text(json.dumps([schedule("j1"), schedule("j2")]))
    write(folder / "nested" / "two.yml", schedule("y1"))
    (folder / "notes.txt").write_text("not a schedule")
    done = hascheduler(api_replica, "apply", "-f", str(folder))
    assert done.returncode == 0, done.stderr
    with Client(api_replica.url, WRITE) as api:
        assert {s.id for s in api.schedules()} == {"j1", "j2", "y1"}


@pytest.mark.long(15)
def test_a_file_of_ten_thousand_schedules(api_replica: ApiReplica, tmp_path: Path) -> None:
    path = write(
        tmp_path / "many.yaml", *[schedule(f"m{i:05d}", jitter=i % 7) for i in range(10_000)]
    )
    first = hascheduler(
        api_replica, "apply", "-f", str(path), "--prune", "--selector", "team=billing"
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[-1] == "applied: 10000 written, 0 failed"
    again = hascheduler(
        api_replica, "apply", "-f", str(path), "--prune", "--selector", "team=billing"
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-2:] == [
        "0 to create, 0 to update, 10000 unchanged, 0 to delete",
        "nothing to do",
    ]
    with Client(api_replica.url, WRITE) as api:
        assert sum(1 for _ in api.schedules(page_size=500)) == 10_000
