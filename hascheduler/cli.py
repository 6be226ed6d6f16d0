"""The ``hascheduler`` command: the one place that builds and wires components."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import ssl
import sys
from collections.abc import Sequence

from pymongo import uri_parser
from pymongo.errors import ConfigurationError, InvalidURI

from . import audit_cli, gcpolicy, logs, schedules_cli
from .api.access import AccessConfigError, WriteLimit, load_tokens
from .brokers import broker_from_url
from .constants import (
    DEFAULT_MAX_FAN_OUT,
    DEFAULT_MIN_FIRE_INTERVAL_S,
    DEFAULT_RUN_RETENTION_S,
)
from .dispatch import DispatchSettings
from .errors import ConfigError
from .lease import LeaseSettingsError, LeaseTimings
from .replica import ReplicaSettings, api_tls_context, run_replica


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535; 0 picks "
                                         "a free one)")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hascheduler", description=__doc__)
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    dm = sub.add_parser("devmongo", help="run the MongoDB-wire-compatible development server "
                                         "(single-node replica set, in memory)")
    dm.add_argument("--host", default="127.0.0.1", help="address to listen on and advertise")
    dm.add_argument("--port", type=_port, default=27017, help="TCP port (0: any free port)")
    dm.add_argument("--replset", default="rs0", help="replica set name")
    dm.add_argument("--oplog-size", type=_positive_int, default=1_000_000,
                    help="change events kept for change streams to resume from")
    dm.add_argument("--cursor-timeout", type=_positive_float, default=600.0,
                    help="seconds before an idle cursor is killed")
    dm.add_argument("--ttl-interval", type=_positive_float, default=1.0,
                    help="seconds between TTL index sweeps (mongod: 60)")
    dm.add_argument("--tls-certificate-key-file", help="PEM file with the server's "
                    "certificate and key: accept TLS connections only (as mongod's option)")
    sv = sub.add_parser(
        "serve", help="run one scheduler replica (HTTP API + mirror)",
        epilog="API tokens: HASCHEDULER_WRITE_TOKENS and HASCHEDULER_READ_TOKENS "
               "(comma-separated), or HASCHEDULER_WRITE_TOKENS_FILE and "
               "HASCHEDULER_READ_TOKENS_FILE (one per line). Without any token the API "
               "serves 127.0.0.1 only, whatever --http-host says.")
    def setting(flag: str, default: str | None, text: str, *, env_also: str = "") -> None:
        """A serve option that the environment can also set (HASCHEDULER_<FLAG>)."""
        name = "HASCHEDULER_" + flag.removeprefix("--").replace("-", "_").upper()
        sv.add_argument(flag, default=os.environ.get(name, default),
                        help=f"{text} (env {name}{env_also})")

    setting("--mongodb-uri", None, "MongoDB replica set URI")
    setting("--http-host", "127.0.0.1", "address to serve the API on")
    setting("--http-port", "8080", "API port, 0 for any free one")
    setting("--replica-id", os.environ.get("POD_NAME"),
            "this replica's name, default host name and pid", env_also=" or POD_NAME")
    setting("--broker", "log:", "where fires go: nats://host:port or log:")
    setting("--lease-ttl", "10", "seconds a lease lasts unrenewed")
    setting("--renew-deadline", "7", "seconds after its last renewal a leader stops firing")
    setting("--renew-interval", "2", "seconds between renewals")
    setting("--tls-cert-file", None, "serve the API over HTTPS with this PEM certificate "
                                     "(chain), with --tls-key-file")
    setting("--tls-key-file", None, "the certificate's PEM private key")
    setting("--write-rate", "50", "writes per second one client address may make on "
                                  "average, 0 for no limit")
    setting("--write-burst", "100", "writes one client may make at once")
    setting("--fire-retention", str(7 * 86400), "seconds the fire ledger keeps a fire")
    setting("--run-retention", str(DEFAULT_RUN_RETENTION_S),
            "seconds the runs ledger keeps a run after its last change")
    setting("--max-fan-out", str(DEFAULT_MAX_FAN_OUT),
            "the most tenants one schedule's fan_out may select (checked when written)")
    setting("--min-fire-interval", str(DEFAULT_MIN_FIRE_INTERVAL_S),
            "the fewest seconds between two fires of one schedule that a write may ask for")

    wk = sub.add_parser(
        "worker", help="run fires: consume them from the broker, claim each in the runs "
                       "ledger, run a handler with retries, record the outcome")
    wk.add_argument("--broker", default=_env("BROKER"), help="nats://host:port")
    wk.add_argument("--mongodb-uri", default=_env("MONGODB_URI"),
                    help="the cluster's MongoDB URI: the runs ledger")
    wk.add_argument("--app", default=_env("WORKER_APP"), help="module:attribute naming a "
                    "hascheduler.worker.WorkerApp (handlers per target pattern)")
    wk.add_argument("--handler", default=_env("WORKER_HANDLER"),
                    help="module:function called with each Run (default: log it); "
                         "instead of --app")
    wk.add_argument("--target", default=_env("WORKER_TARGET"), help="with --handler: the "
                    "target pattern to consume (tokens, * for one, a last > for the rest; "
                    "default >)")
    wk.add_argument("--durable", default=None, help="durable consumer name, shared by the "
                    "workers that split the work (default from the target patterns)")
    wk.add_argument("--worker-id", default=_env("WORKER_ID", os.environ.get("POD_NAME")),
                    help="this worker's name in the runs ledger (default host name and pid)")
    wk.add_argument("--concurrency", type=_positive_int,
                    default=int(_env("WORKER_CONCURRENCY", "8") or 8),
                    help="runs at once (default 8)")
    wk.add_argument("--ack-wait", type=_positive_float, default=30.0,
                    help="seconds without a heartbeat before a run is redelivered and its "
                         "ledger claim may be taken over (default 30)")
    wk.add_argument("--drain-timeout", type=_positive_float, default=30.0,
                    help="on SIGTERM, seconds runs in flight may take to finish before they "
                         "are given back (default 30)")
    wk.add_argument("--run-retention", type=_positive_float,
                    default=DEFAULT_RUN_RETENTION_S,
                    help="seconds the runs ledger keeps a run after its last change")
    wk.add_argument("--metrics-port", type=_port, default=None,
                    help="serve Prometheus metrics on this port")
    wk.add_argument("--max-attempts", type=_positive_int, default=5,
                    help="with --handler: attempts before a run is dead (default 5)")
    wk.add_argument("--backoff-base", type=_positive_float, default=1.0,
                    help="with --handler: the first retry waits up to this many seconds, "
                         "doubling per attempt (full jitter; default 1)")
    wk.add_argument("--backoff-cap", type=_positive_float, default=300.0,
                    help="with --handler: the longest wait between attempts (default 300)")
    wk.add_argument("--timeout", type=_positive_float, default=600.0,
                    help="with --handler: seconds one attempt may run (default 600)")
    schedules_cli.add_parser(sub)
    audit_cli.add_parser(sub)
    from .devcluster import control

    control.add_parser(sub)
    return parser


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"HASCHEDULER_{name}", default)


def replica_settings(args: argparse.Namespace) -> ReplicaSettings:
    if not args.mongodb_uri:
        raise ConfigError("--mongodb-uri (or HASCHEDULER_MONGODB_URI) is required")
    try:
        uri_parser.parse_uri(args.mongodb_uri)
    except (InvalidURI, ValueError, ConfigurationError) as exc:
        raise ConfigError(f"--mongodb-uri / HASCHEDULER_MONGODB_URI is not a MongoDB URI: "
                          f"{exc}") from None
    try:
        port = _port(str(args.http_port))
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"--http-port / HASCHEDULER_HTTP_PORT: {exc}") from None
    replica_id = args.replica_id or f"{socket.gethostname()}-{os.getpid()}"
    seconds = {}
    for option in ("lease_ttl", "renew_deadline", "renew_interval", "fire_retention",
                   "min_fire_interval", "run_retention"):
        flag = "--" + option.replace("_", "-")
        try:
            seconds[option] = _positive_float(str(getattr(args, option)))
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{flag} / HASCHEDULER_{option.upper()}: {exc}") from None
    try:
        timings = LeaseTimings(ttl=seconds["lease_ttl"],
                               renew_deadline=seconds["renew_deadline"],
                               renew_interval=seconds["renew_interval"])
    except LeaseSettingsError as exc:
        raise ConfigError(f"--lease-ttl / --renew-deadline / --renew-interval: {exc}") from None
    try:
        max_fan_out = _positive_int(str(args.max_fan_out))
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"--max-fan-out / HASCHEDULER_MAX_FAN_OUT: {exc}") from None
    try:
        broker_from_url(args.broker)  # checked now; built when the replica starts
    except ValueError as exc:
        raise ConfigError(f"--broker / HASCHEDULER_BROKER: {exc}") from None
    api_tls_context(args.tls_cert_file, args.tls_key_file)  # checked now, built at start
    try:
        tokens = load_tokens(os.environ)
    except AccessConfigError as exc:
        raise ConfigError(str(exc)) from None
    return ReplicaSettings(mongodb_uri=args.mongodb_uri, http_host=args.http_host,
                           http_port=port, replica_id=replica_id, broker_url=args.broker,
                           timings=timings,
                           dispatch=DispatchSettings(retention_s=seconds["fire_retention"],
                                                     max_fan_out=max_fan_out),
                           tokens=tokens, write_limit=_write_limit(args),
                           min_fire_interval_s=seconds["min_fire_interval"],
                           run_retention_s=seconds["run_retention"],
                           tls_cert_file=args.tls_cert_file, tls_key_file=args.tls_key_file)


def _write_limit(args: argparse.Namespace) -> WriteLimit:
    try:
        rate = float(args.write_rate)
    except ValueError:
        raise ConfigError(f"--write-rate / HASCHEDULER_WRITE_RATE: {args.write_rate!r} is not "
                          "a number") from None
    try:
        burst = _positive_int(str(args.write_burst))
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"--write-burst / HASCHEDULER_WRITE_BURST: {exc}") from None
    try:
        return WriteLimit(per_second=rate, burst=burst)
    except AccessConfigError as exc:
        raise ConfigError(f"--write-rate / HASCHEDULER_WRITE_RATE: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        return _run(args)
    except ConfigError as exc:  # every command reports a wrong setting the same way
        print(f"hascheduler {args.command}: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "devmongo":
        from .devmongo import Settings, serve_forever

        if not args.replset or any(c in args.replset for c in "/ ,"):
            raise ConfigError(f"--replset {args.replset!r} is not a replica set name")
        settings = Settings(host=args.host, port=args.port, replset=args.replset,
                            oplog_size=args.oplog_size, cursor_timeout_s=args.cursor_timeout,
                            ttl_interval_s=args.ttl_interval,
                            tls_certificate_key_file=args.tls_certificate_key_file)
        if args.tls_certificate_key_file:
            from .devmongo.server import tls_context

            try:
                tls_context(args.tls_certificate_key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"--tls-certificate-key-file "
                                  f"{args.tls_certificate_key_file}: {exc}") from None
        gcpolicy.freeze_survivors()
        try:
            asyncio.run(serve_forever(settings))
        except OSError as exc:
            print(f"hascheduler devmongo: cannot listen on {args.host}:{args.port}: {exc}",
                  file=sys.stderr)
            return 1
        return 0
    if args.command == "serve":
        replica = replica_settings(args)
        gcpolicy.freeze_survivors()
        try:
            asyncio.run(run_replica(replica))
        except OSError as exc:
            print(f"hascheduler serve: cannot serve on {replica.http_host}:"
                  f"{replica.http_port}: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "worker":
        from .worker import RetryPolicy, WorkerSettings, run_worker
        from .worker.policy import PolicyError

        try:
            policy = RetryPolicy(max_attempts=args.max_attempts,
                                 backoff_base_s=args.backoff_base,
                                 backoff_cap_s=args.backoff_cap, timeout_s=args.timeout)
        except PolicyError as exc:
            raise ConfigError(f"--max-attempts / --backoff-* / --timeout: {exc}") from None
        worker = WorkerSettings.parse(
            broker=args.broker, mongodb_uri=args.mongodb_uri, app=args.app,
            handler=args.handler, target=args.target, durable=args.durable,
            worker_id=args.worker_id, concurrency=args.concurrency, ack_wait_s=args.ack_wait,
            drain_timeout_s=args.drain_timeout, run_retention_s=args.run_retention,
            metrics_port=args.metrics_port, policy=policy)
        return asyncio.run(run_worker(worker))
    if args.command == "dev":
        from pathlib import Path

        from .devcluster import control, supervisor

        if args.action is not None:
            return control.run(args)
        return asyncio.run(supervisor.run(supervisor.DevSettings(
            replicas=args.replicas, workers=args.workers, broker=args.broker,
            nats_cluster=args.nats_cluster, state_dir=Path(args.state_dir),
            control_port=args.control_port)))
    if args.command == "audit":
        return asyncio.run(audit_cli.run(args))
    if args.command in {"schedules", "runs"}:
        return asyncio.run(schedules_cli.run(args))
    return 2


if __name__ == "__main__":
    sys.exit(main())
