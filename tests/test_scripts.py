"""The scripts users run, run as users run them."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.devmongo_only
@pytest.mark.timeout(180)
def test_schedules_demo_passes_its_own_checks() -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "schedules-demo.sh")],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "demo passed" in result.stdout
    assert "mirror digests equal" in result.stdout
    # It stops everything it started, each within its grace.
    assert "did not stop within" not in result.stderr
    ports = re.findall(r"127\.0\.0\.1:(\d+)", result.stdout)
    assert ports
    for port in set(ports):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", int(port))) != 0, f"port {port} still open"


@pytest.mark.long(22)
@pytest.mark.devmongo_only
@pytest.mark.timeout(240)
def test_local_demo_shows_takeover_and_no_fire_missed_or_duplicated(tmp_path: Path) -> None:
    supervisor_log = tmp_path / "dev.log"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "local-demo.sh")],
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
        env={**os.environ, "DEMO_SHORT": "1", "DEMO_LOG": str(supervisor_log)},
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert re.search(r"takeover time: \d+(\.\d+)? ms", out)
    assert re.search(r"expected [1-9]\d*, delivered [1-9]\d*, missing 0, duplicated 0", out)
    assert "scale to 5 replicas" in out
    assert "replicas: r" in out
    assert "demo passed" in out
    # Every child was stopped: their ports are closed.
    ports = re.findall(r"127\.0\.0\.1:(\d+)", out)
    assert len(set(ports)) >= 5
    for port in set(ports):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", int(port))) != 0, f"port {port} still open"
    assert "child_stopped" in supervisor_log.read_text()
