"""Who may call the API: bearer tokens with a read or a write scope, and a per-client limit
on writes.

Tokens come from the environment or from files (a mounted Kubernetes Secret), several per
scope so that one can be rotated without downtime. Without any token the replica serves
on 127.0.0.1 only (see ``cli``), so an unauthenticated API is never reachable from
another host.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hascheduler.core.errors import ConfigError

# Kubelet probes and Prometheus scrapers carry no token; these reveal no schedule data.
# The dashboard page is static: it asks for a token and sends it with every call it makes.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/ui"})
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Tokens shorter than this are guessable; refuse them at start-up rather than serve.
MIN_TOKEN_CHARS = 16
# The example Secret's values: refused, so that a copy applied unchanged cannot be used.
PLACEHOLDER = "CHANGE-ME"
# Clients remembered by the write limiter; the least recently seen is forgotten first, so
# a flood of addresses cannot grow memory without bound.
MAX_TRACKED_CLIENTS = 10_000


class Scope(enum.IntEnum):
    """Ordered: a write token may also read."""

    READ = 1
    WRITE = 2


class AccessConfigError(ConfigError):
    """A token setting is unusable; the message names it."""


def _digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison's time independent of the
    # token's length as well as of its content.
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class Tokens:
    read: tuple[bytes, ...] = ()
    write: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, read: list[str] | None = None, write: list[str] | None = None) -> Tokens:
        return cls(tuple(_digest(t) for t in read or ()), tuple(_digest(t) for t in write or ()))

    @property
    def enabled(self) -> bool:
        return bool(self.read or self.write)

    def scope_of(self, token: str) -> Scope | None:
        """The scope ``token`` grants, or None. Compares against every configured token
        in constant time, so neither timing nor order tells which one nearly matched."""
        candidate = _digest(token)
        scope: Scope | None = None
        for known in self.write:
            if hmac.compare_digest(candidate, known):
                scope = Scope.WRITE
        for known in self.read:
            if hmac.compare_digest(candidate, known) and scope is None:
                scope = Scope.READ
        return scope


def _split(text: str) -> list[str]:
    """Tokens separated by commas or new lines; blank entries and # comments ignored."""
    out = []
    for line in text.replace(",", "\n").splitlines():
        token = line.strip()
        if token and not token.startswith("#"):
            out.append(token)
    return out


def load_tokens(env: Mapping[str, str]) -> Tokens:
    """Tokens from HASCHEDULER_{READ,WRITE}_TOKENS (comma-separated) and
    HASCHEDULER_{READ,WRITE}_TOKENS_FILE (one per line), both read when both are set."""
    scopes: dict[str, list[str]] = {}
    for scope in ("READ", "WRITE"):
        name = f"HASCHEDULER_{scope}_TOKENS"
        tokens = _split(env.get(name, ""))
        path = env.get(f"{name}_FILE")
        if path:
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise AccessConfigError(f"{name}_FILE: cannot read {path}: "
                                        f"{exc.strerror or exc}") from None
            from_file = _split(text)
            if not from_file:
                raise AccessConfigError(f"{name}_FILE: {path} holds no token")
            tokens += from_file
        for token in tokens:
            if PLACEHOLDER in token:
                raise AccessConfigError(f"{name}: a token still says {PLACEHOLDER}: put a "
                                        "token of your own in its place (k8s/base/"
                                        "tokens-secret.example.yaml)")
            if len(token) < MIN_TOKEN_CHARS:
                raise AccessConfigError(f"{name}: every token needs at least "
                                        f"{MIN_TOKEN_CHARS} characters")
        scopes[scope] = tokens
    return Tokens.of(read=scopes["READ"], write=scopes["WRITE"])


def needed_scope(method: str, path: str) -> Scope | None:
    if path in OPEN_PATHS:
        return None
    return Scope.WRITE if method in WRITE_METHODS else Scope.READ


def caller(tokens: Tokens, authorization: str | None) -> str:
    """Who made an authorized request, as the ledgers record it: the scope of its token
    (tokens have no names yet), or "anonymous" on a replica without tokens."""
    if not tokens.enabled:
        return "anonymous"
    _, _, token = (authorization or "").strip().partition(" ")
    scope = tokens.scope_of(token.strip())
    return "anonymous" if scope is None else f"a {scope.name.lower()} token"


@dataclass(frozen=True)
class Denied:
    status: int
    title: str
    headers: dict[str, str] = field(default_factory=dict)


def authorize(tokens: Tokens, method: str, path: str, authorization: str | None
              ) -> Denied | None:
    """None when the request may go on; otherwise the 401/403 to answer."""
    needed = needed_scope(method, path)
    if not tokens.enabled or needed is None:
        return None
    challenge = {"WWW-Authenticate": 'Bearer realm="hascheduler"'}
    if not authorization:
        return Denied(401, "this API needs a token: send the header "
                           "'Authorization: Bearer <token>'", challenge)
    kind, _, token = authorization.strip().partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        return Denied(401, "the Authorization header must be 'Bearer <token>'", challenge)
    granted = tokens.scope_of(token.strip())
    if granted is None:
        return Denied(401, "the token is not valid", challenge)
    if granted < needed:
        return Denied(403, f"this token has the read scope; {method} {path} needs a token "
                           "with the write scope")
    return None


@dataclass(frozen=True)
class WriteLimit:
    """At most ``per_second`` writes per client on average, ``burst`` at once; 0 is off."""

    per_second: float = 50.0
    burst: int = 100

    def __post_init__(self) -> None:
        if self.per_second < 0 or not math.isfinite(self.per_second):
            raise AccessConfigError("the write rate must be a number of writes per second, "
                                    "0 or more (0: no limit)")
        if self.per_second > 0 and self.burst < 1:
            raise AccessConfigError("the write burst must be at least 1")

    @property
    def enabled(self) -> bool:
        return self.per_second > 0


class WriteLimiter:
    """A token bucket per client, refilled continuously."""

    def __init__(self, limit: WriteLimit,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, client: str) -> float:
        """0 when the write may go on (and is counted); otherwise seconds until it may."""
        if not self.limit.enabled:
            return 0.0
        now = self._clock()
        level, at = self._buckets.pop(client, (float(self.limit.burst), now))
        level = min(float(self.limit.burst), level + (now - at) * self.limit.per_second)
        if level >= 1.0:
            level -= 1.0
            wait = 0.0
        else:
            wait = (1.0 - level) / self.limit.per_second
        self._buckets[client] = (level, now)
        while len(self._buckets) > MAX_TRACKED_CLIENTS:
            self._buckets.popitem(last=False)
        return wait
