"""``hascheduler schedules``: the CLI over a running replica's API."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import ServerProcess, start_replica, with_database


@pytest.fixture(scope="module")
def replica(mongo_uri: str) -> Iterator[ServerProcess]:
    process = start_replica(with_database(mongo_uri, f"cli_{uuid.uuid4().hex[:8]}"), "cli")
    yield process
    assert process.stop() == 0


def cli(
    replica: ServerProcess, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", "schedules", "--api", replica.uri, *args],
        capture_output=True,
        text=True,
        timeout=60,
        input=stdin,
        check=False,
    )


def test_add_list_get_update_pause_resume_next_delete(replica: ServerProcess) -> None:
    added = cli(
        replica,
        "add",
        "--id",
        "report",
        "--name",
        "weekly report",
        "--target",
        "reports.weekly",
        "--cron",
        "0 9 * * mon",
        "--timezone",
        "Europe/Paris",
        "--payload",
        '{"format": "pdf"}',
        "--label",
        "team=ops",
    )
    assert added.returncode == 0, added.stderr
    assert "report" in added.stdout
    assert "cron 0 9 * * mon Europe/Paris" in added.stdout

    listed = cli(replica, "list", "--label", "team=ops")
    assert listed.stdout.splitlines()[0].split() == [
        "ID",
        "NAME",
        "TRIGGER",
        "STATE",
        "NEXT",
        "LAST",
        "TARGET",
        "NOTE",
    ]
    assert "report" in listed.stdout

    fanned = cli(
        replica,
        "add",
        "--id",
        "per-tenant",
        "--name",
        "per tenant",
        "--target",
        "reports.tenant",
        "--cron",
        "0 9 * * *",
        "--fan-out",
        '{"collection": "tenants", "filter": {"active": true}}',
    )
    assert fanned.returncode == 0, fanned.stderr
    assert "per tenants" in fanned.stdout
    refused = cli(
        replica,
        "add",
        "--name",
        "bad",
        "--target",
        "x",
        "--cron",
        "0 9 * * *",
        "--fan-out",
        '{"collection": "schedules"}',
    )
    assert refused.returncode == 2
    assert "fan_out.collection" in refused.stderr
    not_json = cli(
        replica, "add", "--name", "bad", "--target", "x", "--cron", "0 9 * * *", "--fan-out", "{"
    )
    assert not_json.returncode == 2
    assert "--fan-out is not valid JSON" in not_json.stderr

    got = json.loads(cli(replica, "get", "report").stdout)
    assert got["payload"] == {"format": "pdf"}

    updated = cli(
        replica, "--json", "update", "report", "--set", '{"jitter": 5}', "--if-match", "1"
    )
    assert json.loads(updated.stdout)["revision"] == 2
    assert json.loads(cli(replica, "--json", "pause", "report").stdout)["paused"] is True
    assert json.loads(cli(replica, "--json", "resume", "report").stdout)["paused"] is False

    preview = json.loads(cli(replica, "--json", "next", "report", "--count", "2").stdout)
    assert len(preview["times"]) == 2
    assert cli(replica, "next", "report").stdout.startswith("NOMINAL")

    assert cli(replica, "delete", "report").returncode == 0
    missing = cli(replica, "get", "report")
    assert missing.returncode == 2
    assert "does not exist" in missing.stderr


def test_add_from_a_file_on_stdin(replica: ServerProcess) -> None:
    body = {
        "id": "from-stdin",
        "name": "n",
        "target": "t",
        "trigger": {"kind": "interval", "every": "PT30S"},
    }
    added = cli(replica, "--json", "add", "--file", "-", stdin=json.dumps(body))
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["trigger"]["every"] == 30.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["add", "--name", "x", "--target", "t", "--cron", "99 * * * *"], "trigger.cron"),
        (["add", "--name", "x", "--target", "t", "--every", "0"], "trigger.every"),
        (
            ["add", "--name", "x", "--target", "t", "--cron", "* * * * *", "--timezone", "Nowhere"],
            "trigger.timezone",
        ),
        (["add", "--name", "x", "--target", "t", "--at", "2001-01-01T00:00:00Z"], "trigger.at"),
        (
            ["add", "--name", "x", "--target", "t", "--cron", "* * * * *", "--payload", "{nope"],
            "--payload is not valid JSON",
        ),
        (["add", "--name", "x", "--cron", "* * * * *"], "--target required"),
        (["add", "--name", "x", "--target", "t"], "give one trigger"),
        (["update", "ghost", "--set", "{}"], "does not exist"),
        (["trigger", "ghost", "--priority", "10"], "--priority"),
    ],
)
def test_refused_input_exits_2_naming_the_field(
    replica: ServerProcess, args: list[str], message: str
) -> None:
    result = cli(replica, *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_unreachable_api_exits_1() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hascheduler.cli",
            "schedules",
            "--api",
            "http://127.0.0.1:9",
            "list",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "cannot reach the API" in result.stderr


def test_a_stored_value_never_reaches_the_terminal_raw(replica: ServerProcess) -> None:
    """An escape sequence in a name and a newline in a pause note or a reason are shown
    escaped: no colour, no retitled terminal, no forged row."""
    forged = "evil\x1b]0;owned\x07\x1b[31mred\nabc  9  fake-row"
    sid = f"tty-{uuid.uuid4().hex[:6]}"
    body = {
        "id": sid,
        "name": forged,
        "target": "t.x",
        "trigger": {"kind": "cron", "cron": "0 3 * * *"},
    }
    made = httpx.post(f"{replica.uri}/schedules", json=body, timeout=10)
    assert made.status_code == 201, made.text
    paused = httpx.post(
        f"{replica.uri}/schedules/{sid}/pause",
        json={"note": "why\nforged  row\x1b[2K"},
        timeout=10,
    )
    assert paused.status_code == 200, paused.text
    audit = [sys.executable, "-m", "hascheduler.cli", "audit-log", "--api", replica.uri]
    for done in (
        cli(replica, "list"),
        subprocess.run(
            [*audit, "--schedule", sid], capture_output=True, text=True, timeout=60, check=False
        ),
    ):
        assert done.returncode == 0, done.stderr
        assert "\x1b" not in done.stdout
        assert "\x07" not in done.stdout
        assert "\\x1b" in done.stdout
        rows = [line for line in done.stdout.splitlines() if sid in line or "forged" in line]
        assert all(sid in row for row in rows), rows  # no line of a value's own


def test_the_cli_a_kubectl_or_temporal_user_expects(replica: ServerProcess, tmp_path: Path) -> None:
    """Durations as typed elsewhere, names as handles, the list's state, next fire, last
    fire and pause note, next fires after an instant, backfills shown, no traceback on a
    closed pipe."""
    tag = uuid.uuid4().hex[:6]
    made = cli(replica, "add", "--name", f"every-{tag}", "--target", "t.x", "--every", "1h30m")
    assert made.returncode == 0, made.stderr
    got = json.loads(cli(replica, "get", f"every-{tag}").stdout)  # the name was its id
    assert (got["id"], got["trigger"]["every"]) == (f"every-{tag}", 5400.0)
    spaced = cli(replica, "add", "--id", f"id-{tag}", "--name", f"nice {tag}", "--target",
                 "t.x", "--every", "5m")  # fmt: skip
    assert spaced.returncode == 0, spaced.stderr
    assert json.loads(cli(replica, "get", f"nice {tag}").stdout)["id"] == f"id-{tag}"
    assert cli(replica, "pause", f"nice {tag}", "--note", "for the release").returncode == 0
    listed = cli(replica, "list").stdout
    header = listed.splitlines()[0].split()
    assert header[:8] == ["ID", "NAME", "TRIGGER", "STATE", "NEXT", "LAST", "TARGET", "NOTE"]
    row = next(line for line in listed.splitlines() if line.startswith(f"id-{tag}"))
    assert "paused" in row
    assert "for the release" in row
    after = (dt.datetime.now(dt.UTC) + dt.timedelta(days=400)).strftime("%Y-%m-%dT%H:%M:%SZ")
    nexts = json.loads(cli(replica, "next", f"every-{tag}", "--after", after, "--json").stdout)
    assert nexts["times"][0]["nominal"] > after
    for hostile in ("5 minutes", "nan", "inf", "0", "-5", "1e400", "1m" * 20_000):
        refused = cli(replica, "add", "--name", "x", "--target", "t.x", "--every", hostile)
        assert refused.returncode == 2, (hostile[:20], refused.stderr[-300:])
        assert len(refused.stderr.splitlines()) == 1, refused.stderr[-300:]  # one line
        assert len(refused.stderr) < 300, hostile[:20]  # the input is not echoed whole
    assert "a duration such as" in refused.stderr
    end = dt.datetime.now(dt.UTC).replace(microsecond=0)
    started = cli(replica, "backfill", f"every-{tag}", "--start",
                  (end - dt.timedelta(hours=6)).isoformat(), "--end", end.isoformat())  # fmt: skip
    assert started.returncode == 0, started.stderr
    backfill = started.stdout.split()[1].rstrip(":")
    assert f"hascheduler backfills show {backfill}" in started.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", "backfills", "--api", replica.uri, "show",
         backfill, "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert json.loads(shown.stdout)["schedule_id"] == f"every-{tag}"
    piped = subprocess.run(
        f"{sys.executable} -m hascheduler.cli schedules --api {replica.uri} list | head -c 1",
        shell=True, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "Traceback" not in piped.stderr
    assert "BrokenPipe" not in piped.stderr


def test_every_option_has_help_and_a_bad_flag_shows_its_commands_usage() -> None:
    from hascheduler.cli.main import build_parser

    def walk(parser: Any, where: str) -> list[str]:
        missing = []
        for action in parser._actions:
            if action.dest in ("help", "version") or action.help == "==SUPPRESS==":
                continue
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                for name, sub in action.choices.items():
                    missing += walk(sub, f"{where} {name}")
                continue
            if not action.help:
                missing.append(f"{where} {'/'.join(action.option_strings) or action.dest}")
        return missing

    assert walk(build_parser([]), "hascheduler") == []
    bad = subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", "schedules", "list", "--bogus"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.startswith("usage: hascheduler schedules list")
    assert "unrecognized arguments: --bogus" in bad.stderr
    version = subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", "--version"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert version.stdout.startswith("hascheduler ")
    for shell in ("bash", "zsh"):
        made = subprocess.run(
            [sys.executable, "-m", "hascheduler.cli", "completion", shell],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert "complete -F _hascheduler hascheduler" in made.stdout
    checked = subprocess.run(
        ["bash", "-n"], input=made.stdout.split("\n", 1)[1], capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
