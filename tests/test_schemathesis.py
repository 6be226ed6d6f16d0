"""Schemathesis generates requests from /openapi.json: no input may produce a 5xx."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ServerProcess, start_replica, with_database

EXAMPLES = int(os.environ.get("HASCHEDULER_SCHEMATHESIS_EXAMPLES", "15"))


@pytest.fixture
def replica(mongo_uri: str) -> Iterator[ServerProcess]:
    process = start_replica(with_database(mongo_uri, f"st_{uuid.uuid4().hex[:8]}"), "st")
    yield process
    assert process.stop() == 0


@pytest.mark.timeout(300)
def test_no_generated_request_gets_a_server_error(replica: ServerProcess) -> None:
    cli = Path(sys.executable).with_name("schemathesis")
    result = subprocess.run(
        [str(cli), "run", f"{replica.uri}/openapi.json", "--checks", "not_a_server_error",
         "-n", str(EXAMPLES), "--generation-database", "none", "--no-color"],
        capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout
