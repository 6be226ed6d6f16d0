"""Servers the tests run in their own processes, found or started, and stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REAL_MONGODB_ENV = "HASCHEDULER_TEST_MONGODB_URI"


@dataclass
class ServerProcess:
    uri: str
    process: subprocess.Popen[str] | None  # None: an external server we do not own

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 10.0) -> int | None:
        if self.process is None:
            return None
        try:
            if self.process.poll() is None:
                os.kill(self.process.pid, sig)
                try:
                    self.process.wait(wait_s)
                except subprocess.TimeoutExpired:
                    os.kill(self.process.pid, signal.SIGKILL)
                    self.process.wait(wait_s)
            return self.process.returncode
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()


def start_devmongo(*args: str, startup_s: float = 20.0) -> ServerProcess:
    """Start ``hascheduler devmongo --port 0`` and read the URI it prints on one line."""
    # stderr goes to a file: a pipe nobody reads would block the server once full.
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the process
        prefix="devmongo-", suffix=".log", delete=False)
    process = subprocess.Popen(
        [sys.executable, "-m", "hascheduler.cli", "--log-level", "warning", "devmongo",
         "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=log, text=True)
    log.close()
    assert process.stdout is not None
    deadline = time.monotonic() + startup_s
    line = ""
    while time.monotonic() < deadline:
        line = process.stdout.readline().strip()
        if line.startswith("mongodb://") or process.poll() is not None:
            break
    if not line.startswith("mongodb://"):
        process.kill()
        process.communicate(timeout=5)
        with open(log.name) as f:
            raise RuntimeError(f"devmongo did not start: {line!r} {f.read()}")
    return ServerProcess(line, process)


def external_uri() -> str | None:
    return os.environ.get(REAL_MONGODB_ENV) or None
