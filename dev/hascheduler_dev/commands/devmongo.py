"""``hascheduler devmongo``: the MongoDB-wire compatible development server."""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
from typing import Any

from hascheduler.cli import settings as cli
from hascheduler.core.errors import ConfigError
from hascheduler.process import gcpolicy
from hascheduler_dev.devmongo import native
from hascheduler_dev.devmongo.settings import Settings

_DEFAULTS = Settings()


def _replset(value: str) -> str:
    if not value or any(c in value for c in "/ ,"):
        raise ValueError(f"{value!r} is not a replica set name")
    return value


def _env(flag: str) -> str:
    return "HASCHEDULER_DEVMONGO_" + flag.removeprefix("--").replace("-", "_").upper()


SETTINGS = (
    *(
        cli.Setting(flag, default, parse, help_text, env=_env(flag))
        for flag, default, parse, help_text in (
            ("--host", _DEFAULTS.host, cli.text, "address to listen on and advertise"),
            ("--port", _DEFAULTS.port, cli.port, "TCP port (0: any free port)"),
            ("--replset", _DEFAULTS.replset, _replset, "replica set name"),
            (
                "--oplog-size",
                _DEFAULTS.oplog_size,
                cli.positive_int,
                "change events kept for change streams to resume from",
            ),
            (
                "--cursor-timeout",
                _DEFAULTS.cursor_timeout_s,
                cli.positive_float,
                "seconds before an idle cursor is killed",
            ),
            (
                "--ttl-interval",
                _DEFAULTS.ttl_interval_s,
                cli.positive_float,
                "seconds between TTL index sweeps (mongod: 60)",
            ),
            (
                "--slowms",
                _DEFAULTS.slow_ms,
                cli.whole_number(0),
                "log a command that holds the server this many milliseconds or longer "
                "(as mongod's)",
            ),
            (
                "--tls-certificate-key-file",
                None,
                cli.text,
                "PEM file with the server's certificate and "
                "key: accept TLS connections only (as mongod's option)",
            ),
        )
    ),
    cli.Setting(
        "--from-sources",
        False,
        cli.boolean,
        "run the server's modules from their "
        "sources even when their compiled build exists (to compare the two)",
        env=_env("--from-sources"),
        switch=True,
    ),
)


def add_parser(sub: Any) -> None:
    cli.add_command(
        sub,
        "devmongo",
        SETTINGS,
        run,
        help="run the MongoDB-wire-compatible "
        "development server (single-node replica set, in memory)",
    )


def run(args: argparse.Namespace) -> int:
    v = cli.resolve(args, SETTINGS)
    if not v["from_sources"]:
        native.load()  # before the server's modules are imported, or they run from source
    from hascheduler_dev.devmongo.server import serve_forever, tls_context

    settings = Settings(
        host=v["host"],
        port=v["port"],
        replset=v["replset"],
        oplog_size=v["oplog_size"],
        cursor_timeout_s=v["cursor_timeout"],
        ttl_interval_s=v["ttl_interval"],
        slow_ms=v["slowms"],
        tls_certificate_key_file=v["tls_certificate_key_file"],
    )
    if settings.tls_certificate_key_file:
        try:
            tls_context(settings.tls_certificate_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"--tls-certificate-key-file {settings.tls_certificate_key_file}: {exc}"
            ) from None
    gcpolicy.freeze_survivors(thaw_every_s=None)
    try:
        asyncio.run(serve_forever(settings))
    except OSError as exc:
        print(
            f"hascheduler devmongo: cannot listen on {settings.host}:{settings.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0
