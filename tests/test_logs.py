"""Log lines: JSON, replica id and term on every line, credentials never written."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import aiohttp
import pytest
import structlog

from hascheduler.process import logs
from tests.servers import start_replica, with_database
from tests.waiting import wait_until


@pytest.fixture(autouse=True)
def own_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Identity and configuration are process-wide: keep these tests' out of the others'
    (the configuration holds the captured stderr, closed after the test)."""
    monkeypatch.setattr(logs, "_identity", {})
    yield
    structlog.reset_defaults()


def json_lines(path: str) -> list[dict[str, object]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def test_every_line_has_identity_and_uris_lose_their_passwords(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.configure("info", json=True)
    logs.identify("r-test")
    logs.set_term(7)
    structlog.get_logger("t").info(
        "connecting",
        uri="mongodb://app:s3cret@db:27017/x?replicaSet=rs0",
        nats="nats://u:p%40ss@broker:4222",
        plain="mongodb://db:27017/x",
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    event = json.loads(line)
    assert event["replica_id"] == "r-test"
    assert event["term"] == 7
    assert event["uri"] == "mongodb://app:***@db:27017/x?replicaSet=rs0"
    assert event["nats"] == "nats://u:***@broker:4222"
    assert event["plain"] == "mongodb://db:27017/x"
    assert "s3cret" not in line


def test_console_rendering_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("info", json=False)
    logs.identify("r-console")
    structlog.get_logger("t").info("hello", uri="nats://u:pw@h:1")
    out = capsys.readouterr().err
    assert "hello" in out
    assert "r-console" in out
    assert "pw@" not in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.strip().splitlines()[-1])


async def test_a_replica_logs_json_with_its_id_and_term_on_every_line(mongo_uri: str) -> None:
    replica = start_replica(
        with_database(mongo_uri, f"logs_{uuid.uuid4().hex[:8]}"), "logr", "--broker", "log:"
    )
    try:
        async with aiohttp.ClientSession() as http:

            async def leading() -> bool:
                async with http.get(replica.uri + "/leader") as r:
                    return bool((await r.json()).get("answered_by_leader"))

            await wait_until(leading, 20, "the replica to lead")
    finally:
        assert replica.stop() == 0
    assert replica.log_path is not None
    lines = json_lines(replica.log_path)
    assert lines
    assert all(line.get("replica_id") == "logr" for line in lines)
    led_from = next(i for i, line in enumerate(lines) if line["event"] == "became_leader")
    assert all(isinstance(line.get("term"), int) for line in lines[led_from:])
    assert all("password" not in json.dumps(line) for line in lines)
