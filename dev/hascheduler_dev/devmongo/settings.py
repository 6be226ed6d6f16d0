"""The development server's settings, as plain values (importing them loads no server
module: see native.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 27017
    replset: str = "rs0"
    oplog_size: int = 1_000_000
    cursor_timeout_s: float = 600.0
    ttl_interval_s: float = 1.0
    # A command that holds the (single-threaded) server longer is logged, as mongod's
    # slow operations are: everything else waits behind it, a lease renewal too.
    slow_ms: int = 100
    # PEM holding the certificate and its key, as mongod's --tlsCertificateKeyFile: the
    # server then accepts TLS connections only (mongod's --tlsMode requireTLS).
    tls_certificate_key_file: str | None = None
