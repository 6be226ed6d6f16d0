"""The examples of docs/SCHEDULES_AS_CODE.md, run as written against a real replica."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from hascheduler.cli.apply import sync_app
from hascheduler.client import Client
from tests.conftest import API_WRITE_TOKEN, ApiReplica

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
