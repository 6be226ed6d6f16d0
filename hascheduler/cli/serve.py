"""``hascheduler serve``: one scheduler replica (HTTP API, mirror, and firing while it
leads)."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from typing import Any

from hascheduler.api.access import (
    Access,
    AccessConfigError,
    JwtKeys,
    WriteLimit,
    legacy_grants,
)
from hascheduler.api.access_file import with_file
from hascheduler.brokers.registry import parse_broker_url
from hascheduler.cli.settings import (
    Setting,
    add_command,
    boolean,
    mongodb_uri,
    number,
    port,
    positive_float,
    positive_int,
    resolve,
    text,
)
from hascheduler.core.clock import DEFAULT_TOLERANCE_S
from hascheduler.core.constants import (
    DEFAULT_MAX_BACKFILL,
    DEFAULT_MAX_BUFFERED,
    DEFAULT_MAX_FAN_OUT,
    DEFAULT_MIN_FIRE_INTERVAL_S,
    DEFAULT_RUN_RETENTION_S,
)
from hascheduler.core.egress import PUBLIC_ONLY, EgressPolicy
from hascheduler.core.errors import ConfigError
from hascheduler.core.health import DEFAULT_LATE_AFTER_S
from hascheduler.process import gcpolicy
from hascheduler.replica.publishing import DispatchSettings
from hascheduler.replica.service import ReplicaSettings, api_tls_context, run_replica
from hascheduler.storage.audit_log import DEFAULT_RETENTION_DAYS
from hascheduler.storage.lease import LeaseSettingsError, LeaseTimings

_LEASE = LeaseTimings()
_WRITES = WriteLimit()


def trace_url(value: str) -> str:
    if not value.startswith(("http://", "https://")) or "{trace_id}" not in value:
        raise ValueError("an http(s) URL with {trace_id} in it")
    return value


def egress_policy(value: str) -> EgressPolicy:
    return EgressPolicy.parse(value)


SETTINGS = (
    Setting("--mongodb-uri", None, mongodb_uri, "MongoDB replica set URI", required=True),
    Setting("--http-host", "127.0.0.1", text, "address to serve the API on"),
    Setting("--http-port", 8080, port, "API port, 0 for any free one"),
    Setting(
        "--replica-id",
        None,
        text,
        "this replica's name, default host name and pid",
        fallback_env="POD_NAME",
    ),
    Setting(
        "--broker",
        parse_broker_url("log:"),
        parse_broker_url,
        "where fires go: nats://host:port, amqp://user:password@host:port/vhost or log:",
    ),
    Setting("--lease-ttl", _LEASE.ttl, positive_float, "seconds a lease lasts unrenewed"),
    Setting(
        "--renew-deadline",
        _LEASE.renew_deadline,
        positive_float,
        "seconds after its last renewal a leader stops firing",
    ),
    Setting("--renew-interval", _LEASE.renew_interval, positive_float, "seconds between renewals"),
    Setting(
        "--tls-cert-file",
        None,
        text,
        "serve the API over HTTPS with this PEM certificate (chain), with --tls-key-file",
    ),
    Setting("--tls-key-file", None, text, "the certificate's PEM private key"),
    Setting(
        "--write-rate",
        _WRITES.per_second,
        number,
        "writes per second one client address may make on average, 0 for no limit",
    ),
    Setting("--write-burst", _WRITES.burst, positive_int, "writes one client may make at once"),
    Setting(
        "--fire-retention",
        DispatchSettings().retention_s,
        positive_float,
        "seconds the fire ledger keeps a fire",
    ),
    Setting(
        "--run-retention",
        DEFAULT_RUN_RETENTION_S,
        positive_float,
        "seconds the runs ledger keeps a run after its last change",
    ),
    Setting(
        "--max-fan-out",
        DEFAULT_MAX_FAN_OUT,
        positive_int,
        "the most tenants one schedule's fan_out may select (checked when written)",
    ),
    Setting(
        "--max-backfill",
        DEFAULT_MAX_BACKFILL,
        positive_int,
        "the most nominal times one backfill may fire (more is refused with 422)",
    ),
    Setting(
        "--max-buffered",
        DEFAULT_MAX_BUFFERED,
        positive_int,
        "the most fires one schedule (or tenant) may hold waiting under overlap "
        "buffer_all; more are recorded skipped",
    ),
    Setting(
        "--clock-tolerance",
        DEFAULT_TOLERANCE_S,
        positive_float,
        "seconds within which this replica must know the database's clock to lead",
    ),
    Setting(
        "--late-after",
        DEFAULT_LATE_AFTER_S,
        positive_float,
        "seconds past its due time (plus jitter) a fire may be missing from the ledger "
        "before its schedule's health says late",
    ),
    Setting(
        "--trace-url",
        None,
        trace_url,
        "the dashboard links a run to its trace at this "
        "URL, {trace_id} replaced (e.g. https://jaeger.example/trace/{trace_id})",
    ),
    Setting(
        "--min-fire-interval",
        DEFAULT_MIN_FIRE_INTERVAL_S,
        positive_float,
        "the fewest seconds between two fires of one schedule that a write may ask for",
    ),
    Setting(
        "--access-file",
        None,
        text,
        "named tokens (as `hascheduler token create` "
        "prints them) and namespace rules; read again when it changes",
    ),
    Setting(
        "--jwks-file",
        None,
        text,
        "accept bearer JWTs (RS256, ES256) signed by a key of this JWKS file, with --jwt-audience",
    ),
    Setting("--jwt-audience", None, text, "the aud a JWT must carry to be accepted here"),
    Setting("--jwt-issuer", None, text, "the iss a JWT must carry, when set"),
    Setting(
        "--audit-retention-days",
        DEFAULT_RETENTION_DAYS,
        positive_float,
        "days the audit trail keeps a record",
    ),
    Setting(
        "--egress-allow",
        PUBLIC_ONLY,
        egress_policy,
        "comma-separated address ranges and host names webhooks may reach besides "
        "public addresses (loopback, link-local and private ones are refused otherwise)",
    ),
    Setting(
        "--metrics-need-token",
        False,
        boolean,
        "serve GET /metrics only to a token that may read (off: scrapers on a private "
        "network read it without one)",
        switch=True,
    ),
    Setting(
        "--audit-redact-payloads",
        False,
        boolean,
        "record payload values in the audit trail as digests, not as written",
        switch=True,
    ),
)


def add_parser(sub: Any) -> None:
    add_command(
        sub,
        "serve",
        SETTINGS,
        run,
        help="run one scheduler replica (HTTP API + mirror)",
        epilog="API tokens: HASCHEDULER_WRITE_TOKENS and HASCHEDULER_READ_TOKENS "
        "(comma-separated), or HASCHEDULER_WRITE_TOKENS_FILE and "
        "HASCHEDULER_READ_TOKENS_FILE (one per line). Without any token the "
        "API serves 127.0.0.1 only, whatever --http-host says.",
    )


def replica_settings(args: argparse.Namespace) -> ReplicaSettings:
    """The replica's settings from flags and environment. Raises ConfigError."""
    v = resolve(args, SETTINGS)
    try:
        timings = LeaseTimings(
            ttl=v["lease_ttl"],
            renew_deadline=v["renew_deadline"],
            renew_interval=v["renew_interval"],
        )
    except LeaseSettingsError as exc:
        raise ConfigError(f"--lease-ttl / --renew-deadline / --renew-interval: {exc}") from None
    try:
        write_limit = WriteLimit(per_second=v["write_rate"], burst=v["write_burst"])
    except AccessConfigError as exc:
        raise ConfigError(f"--write-rate / HASCHEDULER_WRITE_RATE: {exc}") from None
    api_tls_context(v["tls_cert_file"], v["tls_key_file"])  # checked now, built at start
    try:
        jwt_keys = (
            None
            if v["jwks_file"] is None
            else JwtKeys.load(v["jwks_file"], v["jwt_audience"] or "", v["jwt_issuer"])
        )
        access = Access(legacy=legacy_grants(os.environ), jwt_keys=jwt_keys)
        with_file(access, v["access_file"])  # refused now rather than served
    except AccessConfigError as exc:
        raise ConfigError(str(exc)) from None
    return ReplicaSettings(
        mongodb_uri=v["mongodb_uri"],
        http_host=v["http_host"],
        http_port=v["http_port"],
        replica_id=v["replica_id"] or f"{socket.gethostname()}-{os.getpid()}",
        broker=v["broker"],
        timings=timings,
        dispatch=DispatchSettings(
            retention_s=v["fire_retention"],
            max_fan_out=v["max_fan_out"],
            max_buffered=v["max_buffered"],
        ),
        max_backfill=v["max_backfill"],
        access=access,
        access_file=v["access_file"],
        audit_retention_days=v["audit_retention_days"],
        redact_payloads=v["audit_redact_payloads"],
        write_limit=write_limit,
        min_fire_interval_s=v["min_fire_interval"],
        run_retention_s=v["run_retention"],
        clock_tolerance_s=v["clock_tolerance"],
        late_after_s=v["late_after"],
        trace_url=v["trace_url"],
        tls_cert_file=v["tls_cert_file"],
        tls_key_file=v["tls_key_file"],
        egress=v["egress_allow"],
        metrics_need_token=v["metrics_need_token"],
    )


def run(args: argparse.Namespace) -> int:
    replica = replica_settings(args)
    gcpolicy.freeze_survivors()
    try:
        asyncio.run(run_replica(replica))
    except OSError as exc:
        print(
            f"hascheduler serve: cannot serve on {replica.http_host}:{replica.http_port}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0
