"""The scripts users run, run as users run them."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.devmongo_only
@pytest.mark.timeout(180)
def test_schedules_demo_passes_its_own_checks() -> None:
    result = subprocess.run(["bash", str(ROOT / "scripts" / "schedules-demo.sh")],
                            capture_output=True, text=True, timeout=170, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "demo passed" in result.stdout
    assert "mirror digests equal" in result.stdout
    # It stops everything it started.
    ports = re.findall(r"127\.0\.0\.1:(\d+)", result.stdout)
    assert ports
    for port in set(ports):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", int(port))) != 0, f"port {port} still open"
