"""Schemathesis generates requests from /openapi.json and runs every check it has: no 5xx,
status codes and bodies as documented, schema-valid requests accepted and schema-violating
ones refused, 405 with Allow for undeclared methods, stateful sequences (create, read,
delete, read again). tests/schemathesis.toml says where a 422 is allowed for valid shapes."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ServerProcess, start_replica, with_database

ROOT = Path(__file__).resolve().parent.parent
CONFIG = Path(__file__).with_name("schemathesis.toml")
EXAMPLES = int(os.environ.get("HASCHEDULER_SCHEMATHESIS_EXAMPLES", "15"))
# A fixed seed in the suite, so that its result is the same on every run; the long run
# (scripts/schemathesis.sh) draws a new one each time.
SEED = os.environ.get("HASCHEDULER_SCHEMATHESIS_SEED", "14")


@pytest.fixture
def replica(mongo_uri: str) -> Iterator[ServerProcess]:
    process = start_replica(
        with_database(mongo_uri, f"st_{uuid.uuid4().hex[:8]}"), "st", "--write-rate", "0"
    )
    yield process
    assert process.stop() == 0


@pytest.mark.long(39)
@pytest.mark.timeout(300)
def test_every_schemathesis_check_passes(replica: ServerProcess) -> None:
    # In a venv of its own (scripts/_venv.sh, ensure_schemathesis), which scripts/test
    # makes: missing, this test fails rather than skip.
    cli = ROOT / ".venv" / "schemathesis" / "bin" / "schemathesis"
    assert cli.exists(), f"{cli} missing: scripts/test installs it"
    result = subprocess.run(
        [
            str(cli),
            "--config-file",
            str(CONFIG),
            "run",
            f"{replica.uri}/openapi.json",
            "--checks",
            "all",
            "-n",
            str(EXAMPLES),
            *(["--seed", SEED] if SEED else []),
            "--generation-database",
            "none",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout
