"""The ``hascheduler`` command line: arguments, exit codes, signals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pymongo import AsyncMongoClient

from tests.servers import free_port, start_devmongo
from tests.waiting import wait_until_sync


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["devmongo", "--port", "http"], "not a port number"),
        (["devmongo", "--port", "70000"], "not a port number"),
        (["devmongo", "--oplog-size", "0"], "must be at least 1"),
        (["devmongo", "--slowms", "-1"], "must be at least 0"),
        (["devmongo", "--slowms", "0.5"], "is not a whole number"),
        (["devmongo", "--replset", "a b"], "is not a replica set name"),
        (["nonsense"], "invalid choice"),
        (["serve"], "--mongodb-uri (or HASCHEDULER_MONGODB_URI) is required"),
        (["serve", "--mongodb-uri", "http://x"], "is not a MongoDB URI"),
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0", "--http-port", "x"],
            "--http-port",
        ),
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0", "--broker", "kafka://x"],
            "--broker / HASCHEDULER_BROKER: unsupported broker URL",
        ),
        (
            [
                "serve",
                "--mongodb-uri",
                "mongodb://h/?replicaSet=rs0",
                "--lease-ttl",
                "5",
                "--renew-deadline",
                "7",
            ],
            "must exceed the renew deadline",
        ),
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0", "--renew-interval", "6"],
            "must exceed 1.2 x renew interval",
        ),
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0", "--lease-ttl", "-1"],
            "--lease-ttl / HASCHEDULER_LEASE_TTL",
        ),
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0", "--min-fire-interval", "0"],
            "--min-fire-interval / HASCHEDULER_MIN_FIRE_INTERVAL",
        ),
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0", "--min-fire-interval", "1s"],
            "--min-fire-interval / HASCHEDULER_MIN_FIRE_INTERVAL",
        ),
        (["worker", "--broker", "nats://127.0.0.1:4222"], "--mongodb-uri"),
        (
            [
                "worker",
                "--broker",
                "nats://127.0.0.1:4222",
                "--mongodb-uri",
                "mongodb://h",
                "--target",
                "t",
                "--handler",
                "nope",
            ],
            "module:attribute",
        ),
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0", "--clock-tolerance", "0"],
            "--clock-tolerance / HASCHEDULER_CLOCK_TOLERANCE",
        ),
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0", "--clock-tolerance", "nan?"],
            "--clock-tolerance / HASCHEDULER_CLOCK_TOLERANCE",
        ),
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0", "--late-after", "-1"],
            "--late-after / HASCHEDULER_LATE_AFTER",
        ),
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0", "--late-after", "1m"],
            "--late-after / HASCHEDULER_LATE_AFTER",
        ),
        (
            [
                "worker",
                "--broker",
                "nats://127.0.0.1:4222",
                "--mongodb-uri",
                "mongodb://h",
                "--sync-schedules",
                "--api",
                "http://127.0.0.1:9",
            ],
            "need a named app",
        ),
        (["apply", "--api", "http://127.0.0.1:9"], "-f PATH (or --app) is required"),
        (
            ["apply", "--api", "http://127.0.0.1:9", "-f", "x.yaml", "--selector", "noequals"],
            "--selector 'noequals': write it as key=value",
        ),
        (
            [
                "apply",
                "--api",
                "http://127.0.0.1:9",
                "--app",
                "tests.helpers.declared_app:alpha",
                "-f",
                "x.yaml",
            ],
            "--app applies what the app declares",
        ),
        (["export", "--api", "http://127.0.0.1:9", "--selector", "=v"], "write it as key=value"),
        (["runs", "list", "--limit", "0", "--api", "http://127.0.0.1:9"], "--limit"),
        (
            ["runs", "list", "--schedule", "s", "--state", "dead", "--api", "http://127.0.0.1:9"],
            "--schedule lists one schedule's runs",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_setting(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        # A bad value from the environment is refused as one from a flag, naming both.
        (
            ["serve", "--mongodb-uri", "mongodb://h/?replicaSet=rs0"],
            {"HASCHEDULER_LEASE_TTL": "x"},
            "--lease-ttl / HASCHEDULER_LEASE_TTL: 'x' is not a number",
        ),
        (
            ["serve"],
            {
                "HASCHEDULER_MONGODB_URI": "mongodb://h/?replicaSet=rs0",
                "HASCHEDULER_BROKER": "kafka://x",
            },
            "--broker / HASCHEDULER_BROKER",
        ),
        (
            ["worker"],
            {"HASCHEDULER_WORKER_CONCURRENCY": "many"},
            "--concurrency / HASCHEDULER_WORKER_CONCURRENCY: 'many' is not a whole number",
        ),
        (
            ["worker", "--broker", "nats://127.0.0.1:4222", "--mongodb-uri", "mongodb://h"],
            {"HASCHEDULER_WORKER_ACK_WAIT": "-1"},
            "--ack-wait / HASCHEDULER_WORKER_ACK_WAIT: '-1' must be greater than 0",
        ),
        (
            ["worker", "--mongodb-uri", "mongodb://h"],
            {"HASCHEDULER_BROKER": "log:"},
            "log has nothing for a worker to consume",
        ),
        (
            ["worker", "--broker", "nats://127.0.0.1:4222", "--mongodb-uri", "mongodb://h"],
            {"HASCHEDULER_WORKER_SYNC_SCHEDULES": "perhaps"},
            "--sync-schedules / HASCHEDULER_WORKER_SYNC_SCHEDULES: 'perhaps' is not true or false",
        ),
        (
            ["devmongo"],
            {"HASCHEDULER_DEVMONGO_PORT": "99999"},
            "--port / HASCHEDULER_DEVMONGO_PORT: 99999 is not a port number",
        ),
        (
            ["devmongo"],
            {"HASCHEDULER_DEVMONGO_FROM_SOURCES": "maybe"},
            "--from-sources / HASCHEDULER_DEVMONGO_FROM_SOURCES: 'maybe' is not true or false",
        ),
        # The flag wins over the environment.
        (
            ["worker", "--concurrency", "0"],
            {"HASCHEDULER_WORKER_CONCURRENCY": "4"},
            "--concurrency / HASCHEDULER_WORKER_CONCURRENCY: '0' must be at least 1",
        ),
    ],
)
def test_bad_settings_from_the_environment_exit_2_on_one_line(
    args: list[str], env: dict[str, str], message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, **env},
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # one line, no traceback


@pytest.mark.parametrize(
    "args",
    [
        ["--log-level"],
        ["serve", "--log-level"],
        ["--bogus"],
        [""],
        ["--log-level", "loud"],
        ["serve", "--http-port", "8080", "extra"],
        ["devmongo", "--port"],
        ["worker", "--broker", "nats://" + "h" * 100_000],  # valid text, absurd size
    ],
)
def test_hostile_command_lines_get_the_commands_usage_and_exit_2(args: list[str]) -> None:
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    first, last = result.stderr.splitlines()[0], result.stderr.splitlines()[-1]
    assert first.startswith("usage: hascheduler") or last.startswith("hascheduler "), result.stderr[
        :500
    ]
    assert "[command]" not in result.stderr  # never the first look's own usage


def test_the_help_states_each_default_once() -> None:
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "HASCHEDULER_LEASE_TTL; default 10.0" in text
    assert "HASCHEDULER_BROKER; default log:" in text
    assert "amqp://" in text


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("devmongo", "--port", str(port))
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


@pytest.mark.devmongo_only
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_devmongo_prints_its_uri_and_stops_cleanly_on_signal(sig: int) -> None:
    server = start_devmongo("--replset", "rs7")
    assert server.uri.endswith("/?replicaSet=rs7")
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(server.uri)
    try:
        hello = await client.admin.command("hello")
        assert hello["setName"] == "rs7"
        await client.t.c.insert_one({"ok": True})
    finally:
        await client.close()
    assert server.stop(sig) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_replica_waiting_for_its_database_stops_on_signal(sig: int, tmp_path: Path) -> None:
    """A replica started before its database (nothing listens there) waits for it without
    end; a stop asked for meanwhile ends it within seconds, as it would once started."""
    port = free_port()  # nothing listens there: every connection is refused
    log = tmp_path / "replica.log"
    with open(log, "w") as err:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hascheduler.cli",
                "serve",
                "--mongodb-uri",
                f"mongodb://127.0.0.1:{port}/x?directConnection=true",
                "--http-port",
                "0",
                "--broker",
                "log:",
                "--replica-id",
                "early",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
    try:
        # Its API is up; next it creates its indexes, waiting for the database.
        wait_until_sync(
            lambda: "replica_listening" in log.read_text(),
            60,
            "the replica waiting for its database",
        )
        process.send_signal(sig)
        assert process.wait(timeout=15) == 0, log.read_text()[-2000:]
        assert "stopped_while_starting" in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
