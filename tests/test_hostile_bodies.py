"""Bodies no input path may take: nested past what a parser's stack or BSON holds, numbers
that are not numbers. A clear 4xx naming the body on every route that takes one (never a
5xx), exit 2 from the CLI, a message that is no fire for a worker."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hascheduler.api.routes import ROUTES
from hascheduler.core.fields import MAX_JSON_DEPTH, json_depth, loads
from hascheduler.worker.delivery import NotAFire, read_delivery
from tests.servers import ServerProcess, start_replica, with_database

DEEP = b"[" * 60_000


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = {"k": value}
    return value


def test_depth_is_counted_without_parsing_and_strings_do_not_count() -> None:
    assert json_depth(b'{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert json_depth(b'"\\"[["') == 0
    assert json_depth(DEEP) == MAX_JSON_DEPTH + 1  # stops counting past the limit
    for bad in (DEEP, b'{"x": NaN}', b'{"x": Infinity}', b'{"x": -Infinity}'):
        with pytest.raises(ValueError, match=r"levels deep|not a JSON number"):
            loads(bad)


@pytest.fixture(scope="module")
def replica(mongo_uri: str) -> Iterator[ServerProcess]:
    started = start_replica(
        with_database(mongo_uri, f"bodies_{uuid.uuid4().hex[:8]}"), "bodies", "--write-rate", "0"
    )
    try:
        yield started
    finally:
        started.stop(signal.SIGKILL)


def _schedule(schedule_id: str, payload: object = None) -> dict[str, object]:
    return {
        "id": schedule_id,
        "name": schedule_id,
        "target": "bodies.job",
        "trigger": {"kind": "cron", "cron": "0 3 * * *", "timezone": "UTC"},
        **({"payload": payload} if payload is not None else {}),
    }


def test_every_route_taking_a_body_refuses_a_deep_one_naming_the_body(
    replica: ServerProcess,
) -> None:
    with httpx.Client(base_url=replica.uri, timeout=30) as http:
        assert http.post("/schedules", json=_schedule("s")).status_code == 201
        posted = 0
        for route in ROUTES:
            if "requestBody" not in route.operation:
                continue
            path = route.path.replace("{id}", "s")
            for body in (DEEP, b'{"payload": {"x": NaN}}', b'{"x": Infinity}'):
                answer = http.request(
                    route.method, path, content=body, headers={"Content-Type": "application/json"}
                )
                where = f"{route.method} {route.path}"
                assert answer.status_code == 400, f"{where}: {answer.status_code} {answer.text}"
                assert answer.json()["errors"][0]["field"] == "body", where
            posted += 1
        assert posted >= 7  # create, batch, replace, patch, trigger, backfill, restore, ...


def test_a_payload_past_what_mongodb_stores_is_refused_and_one_within_is_kept(
    replica: ServerProcess,
) -> None:
    with httpx.Client(base_url=replica.uri, timeout=30) as http:
        deep = http.post("/schedules", json=_schedule("deep", _nested(MAX_JSON_DEPTH + 5)))
        assert deep.status_code == 400, deep.text
        within = _nested(MAX_JSON_DEPTH - 4)
        kept = http.post("/schedules", json=_schedule("within", within))
        assert kept.status_code == 201, kept.text
        assert http.get("/schedules/within").json()["payload"] == within


def test_the_cli_refuses_deep_and_not_a_number_input_with_one_line(tmp_path: Path) -> None:
    cases = {
        "deep.json": DEEP.decode(),
        "flow.yaml": "[" * 60_000,
        "nan.json": '{"id": "x", "payload": {"v": NaN}}',
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        done = subprocess.run(
            [sys.executable, "-m", "hascheduler.cli", "apply", "-f", str(path), "--dry-run"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={"HASCHEDULER_API": "http://127.0.0.1:9", "PATH": "/usr/bin:/bin"},
        )
        assert done.returncode == 2, (name, done.stderr)
        assert "Traceback" not in done.stderr, name
    added = subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", "schedules", "trigger", "x", "--payload",
         "[" * 60_000, "--api", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert added.returncode == 2, added.stderr
    assert "Traceback" not in added.stderr


def test_a_deep_broker_message_is_no_fire() -> None:
    with pytest.raises(NotAFire, match="levels deep"):
        read_delivery("hascheduler.fire.t", DEEP)
    with pytest.raises(NotAFire, match="not a JSON number"):
        read_delivery("hascheduler.fire.t", json.dumps({"data": {}}).encode()[:-1] + b', "x": NaN}')
