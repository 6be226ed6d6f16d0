"""The examples of the docs run as written: docs/SCHEDULES_AS_CODE.md's against a real
replica, the README's quickstart against the local cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from hascheduler.cli.apply import sync_app
from hascheduler.client import Client
from tests.conftest import API_WRITE_TOKEN, ApiReplica
from tests.servers import DevCluster
from tests.waiting import wait_until_sync

DOC = Path(__file__).resolve().parent.parent / "docs" / "SCHEDULES_AS_CODE.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)


def test_the_yaml_file_applies_and_then_has_nothing_to_do(
    api_replica: ApiReplica, tmp_path: Path
) -> None:
    billing = next(b for b in blocks("yaml") if b.startswith("# schedules/billing.yaml"))
    path = tmp_path / "billing.yaml"
    path.write_text(billing)
    command = [
        sys.executable,
        "-m",
        "hascheduler.cli",
        "apply",
        "--api",
        api_replica.url,
        "--token",
        API_WRITE_TOKEN,
        "-f",
        str(path),
        "--prune",
        "--selector",
        "team=billing",
    ]
    for expected in ("applied: 2 written, 0 failed", "nothing to do"):
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == expected
    with Client(api_replica.url, API_WRITE_TOKEN) as api:
        dunning = api.get_schedule("billing-dunning")
    assert dunning.payload == {"grace_days": 14}


def test_the_declared_app_syncs(api_replica: ApiReplica) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(blocks("python")[0], str(DOC), "exec"), namespace)
    assert sync_app(namespace["app"], api_replica.url, API_WRITE_TOKEN) == 0
    with Client(api_replica.url, API_WRITE_TOKEN) as api:
        found = {s.id: s for s in api.schedules(labels={"app": "imports"})}
    assert set(found) == {"imports-nightly", "imports-poll"}
    assert found["imports-nightly"].target == "imports.nightly"


README = Path(__file__).resolve().parent.parent / "README.md"


def _readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def _commands(block: str) -> list[str]:
    """A bash block's commands, continuation lines joined."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


@pytest.mark.long(40)
@pytest.mark.timeout(240)
def test_the_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    """The README's handler, in myjobs.py, and its quickstart's commands, each run as
    written (``./scripts/hascheduler`` being the command on this machine's PATH): the
    handler runs the schedule's fires, the leader is killed, and the audit of the last
    minute says every fire once."""
    (tmp_path / "myjobs.py").write_text(_readme_blocks("python")[0])
    blocks = [_commands(b) for b in _readme_blocks("bash")]
    start = next(c for b in blocks for c in b if c.startswith("./scripts/hascheduler dev --app"))
    then = next(b for b in blocks if any("dev kill-leader" in c for c in b))
    env = {k: v for k, v in os.environ.items() if k not in ("HASCHEDULER_API", "PYTHONPATH")}
    args = start.split("#")[0].split()[2:]  # after ./scripts/hascheduler dev
    dev = DevCluster(str(tmp_path / ".hascheduler-dev"), *args, env=env, cwd=tmp_path)

    def run(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command.replace("./scripts/hascheduler", f"{sys.executable} -m hascheduler.cli"),
            shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=90,
            check=False, env=env, executable="/bin/bash",
        )  # fmt: skip

    def succeeded() -> bool:
        listed = run("./scripts/hascheduler runs list --schedule daily --json")
        runs = json.loads(listed.stdout)["items"] if listed.returncode == 0 else []
        return bool(sum(r["state"] == "succeeded" for r in runs) >= 3)

    try:
        for command in then:
            if "dev kill-leader" in command:  # a user reads the runs first
                wait_until_sync(succeeded, 60, "three runs by the README's handler", 0.5)
            done = run(command)
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            if "dev kill-leader" in command:  # the dashboard's URL outlives the leader
                assert httpx.get(dev.dashboard, timeout=10).status_code == 200
                assert httpx.get(dev.dashboard.removesuffix("/ui") + "/leader").json()["holder"]
        # Client() finds the cluster of the directory it runs in, as the CLI does.
        found = run(f"{sys.executable} -c 'from hascheduler.client import Client; "
                    "print([s.id for s in Client().schedules()])'")  # fmt: skip
        assert found.stdout.strip() == "['daily']", found.stderr
        printed = (tmp_path / ".hascheduler-dev" / "logs").glob("w*.out")
        assert any("report reports.daily" in p.read_text() for p in printed)
    finally:
        assert dev.stop() == 0
