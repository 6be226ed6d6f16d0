"""Who may call the API: named tokens granting actions in namespaces, bearer JWTs from an
identity provider, and a per-client limit on writes.

A grant is a name (what the audit trail records), a set of actions and the namespaces it
may act in (``*``: all). Grants come from three places, all optional:

- the access file (``--access-file``, a mounted Kubernetes Secret): named tokens stored as
  salted hashes, never in plain text, and the namespaces' rules; re-read when it changes;
- today's two variables, HASCHEDULER_{READ,WRITE}_TOKENS[_FILE]: tokens named ``read-N``
  (read, every namespace) and ``write-N`` (every action, every namespace);
- a JWKS file: bearer JWTs (RS256, ES256) whose ``exp``, ``nbf`` and ``aud`` are checked,
  their ``sub`` the name, their claims the actions and namespaces.

Without any of them the replica serves on 127.0.0.1 only (see ``cli``), so an
unauthenticated API is never reachable from another host.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import json
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hascheduler.core.errors import ConfigError
from hascheduler.core.fields import NAMESPACE

log = structlog.get_logger("hascheduler.access")

# Tokens shorter than this are guessable; refuse them at start-up rather than serve.
MIN_TOKEN_CHARS = 16
# The example Secret's values: refused, so that a copy applied unchanged cannot be used.
PLACEHOLDER = "CHANGE-ME"
# Clients remembered by the write limiter; the least recently seen is forgotten first, so
# a flood of addresses cannot grow memory without bound.
MAX_TRACKED_CLIENTS = 10_000
# A named token reads hst_<id>_<secret>: the id finds its entry in one lookup, whatever
# the number of tokens; only the secret is hashed and compared.
TOKEN_PREFIX = "hst"
_NAMED_TOKEN = re.compile(rf"{TOKEN_PREFIX}_([0-9a-f]{{16}})_([A-Za-z0-9_-]{{43}})")
# A JWT is three base64url parts; one longer than this is refused before it is decoded
# (an identity provider's tokens are a few kilobytes).
MAX_JWT_CHARS = 8192
JWT_ALGORITHMS = ("RS256", "ES256")
ANY_NAMESPACE = "*"
TOKEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


class Action(enum.StrEnum):
    READ = "read"
    WRITE = "write"  # create, change, delete, restore a schedule
    TRIGGER = "trigger"  # run now, backfill, replay a dead run
    PAUSE = "pause"  # pause, resume
    CANCEL = "cancel"  # cancel a run or a backfill
    ADMIN = "admin"  # every action above


ACTIONS = tuple(Action)


class AccessConfigError(ConfigError):
    """A token setting is unusable; the message names it."""


@dataclass(frozen=True)
class Grant:
    """What one token (or JWT) may do, and the name it acts under."""

    name: str
    actions: frozenset[Action]
    namespaces: frozenset[str]

    @property
    def everywhere(self) -> bool:
        return ANY_NAMESPACE in self.namespaces

    def can(self, action: Action) -> bool:
        return action in self.actions or Action.ADMIN in self.actions

    def allows(self, action: Action, namespace: str) -> bool:
        return self.can(action) and (self.everywhere or namespace in self.namespaces)


ANONYMOUS = Grant("anonymous", frozenset(ACTIONS), frozenset({ANY_NAMESPACE}))


@dataclass(frozen=True)
class NamespaceRules:
    """An operator's rules for one namespace (the access file's ``namespaces``)."""

    require_reason: bool = False
    max_schedules: int | None = None
    max_fires_per_second: float | None = None  # beyond: deferred to a slot (core/quota.py)
    max_fan_out: int | None = None  # tenants one fan-out may select, under --max-fan-out
    # The collections its fan-outs may read; None: any but hascheduler's own (no access
    # file: one team).
    fan_out_sources: frozenset[str] | None = None


# A namespace an access file does not list: no source granted.
UNLISTED = NamespaceRules(fan_out_sources=frozenset())

RULES = frozenset(
    {"require_reason", "max_schedules", "max_fires_per_second", "max_fan_out", "fan_out_sources"}
)


@dataclass(frozen=True)
class Stored:
    salt: bytes
    digest: bytes
    grant: Grant


def _salted(salt: bytes, secret: str) -> bytes:
    # The secret is 256 random bits: a keyed hash is enough; a slow password hash would
    # only add cost to every request.
    return hmac.new(salt, secret.encode(), hashlib.sha256).digest()


def _plain_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class JwtKeys:
    """Bearer JWTs signed by a key of a JWKS file."""

    keys: Any  # jwt.PyJWKSet
    audience: str
    issuer: str | None = None

    @classmethod
    def load(cls, path: str, audience: str, issuer: str | None = None) -> JwtKeys:
        # Imported only where JWTs are configured: PyJWT brings in cryptography, which
        # every replica and command would load at start otherwise.
        import jwt

        try:
            keys = jwt.PyJWKSet.from_json(Path(path).read_text())
        except OSError as exc:
            raise AccessConfigError(
                f"--jwks-file: cannot read {path}: {exc.strerror or exc}"
            ) from None
        except (jwt.PyJWTError, ValueError) as exc:
            raise AccessConfigError(f"--jwks-file: {path}: {exc}") from None
        if not audience:
            raise AccessConfigError(
                "--jwks-file needs --jwt-audience: a token meant for "
                "another service must not be accepted here"
            )
        return cls(keys, audience, issuer)

    def grant_of(self, token: str) -> Grant | None:
        if len(token) > MAX_JWT_CHARS:
            return None
        import jwt

        try:
            header = jwt.get_unverified_header(token)
            kid = header.get("kid")
            candidates = [k for k in self.keys.keys if kid is None or k.key_id == kid]
            for key in candidates:
                try:
                    claims = jwt.decode(
                        token,
                        key.key,
                        algorithms=list(JWT_ALGORITHMS),
                        audience=self.audience,
                        issuer=self.issuer,
                        options={"require": ["exp", "sub", "aud"]},
                    )
                except jwt.InvalidSignatureError:
                    continue
                return _jwt_grant(claims)
        except (jwt.PyJWTError, ValueError, TypeError):
            return None
        return None


def _words(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def _jwt_grant(claims: Mapping[str, Any]) -> Grant | None:
    """Actions from ``hascheduler_actions`` (or OAuth's space-separated ``scope``),
    namespaces from ``hascheduler_namespaces``; unknown words are ignored."""
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub:
        return None
    known = {a.value for a in ACTIONS}
    actions = frozenset(
        Action(w)
        for w in _words(claims.get("hascheduler_actions", claims.get("scope")))
        if w in known
    )
    namespaces = frozenset(
        w
        for w in _words(claims.get("hascheduler_namespaces"))
        if w == ANY_NAMESPACE or NAMESPACE.fullmatch(w)
    )
    if not actions or not namespaces:
        return None
    return Grant(f"jwt:{sub[:200]}", actions, namespaces)


@dataclass(frozen=True)
class Access:
    """Every grant a replica honours, and the namespaces' rules: one immutable value,
    replaced whole when the access file changes."""

    named: Mapping[str, Stored] = field(default_factory=dict)
    legacy: Mapping[bytes, Grant] = field(default_factory=dict)
    jwt_keys: JwtKeys | None = None
    rules: Mapping[str, NamespaceRules] = field(default_factory=dict)
    from_file: bool = False  # an access file's: its namespaces are granted what it lists

    @property
    def enabled(self) -> bool:
        return bool(self.named or self.legacy or self.jwt_keys)

    def counts(self) -> dict[str, int]:
        return {
            "named": len(self.named),
            "legacy": len(self.legacy),
            "jwks": len(self.jwt_keys.keys.keys) if self.jwt_keys else 0,
        }

    def rules_of(self, namespace: str) -> NamespaceRules:
        return self.rules.get(namespace, UNLISTED if self.from_file else NamespaceRules())

    def grant_of(self, token: str) -> Grant | None:
        """The grant ``token`` carries, or None. One dictionary lookup and one
        constant-time comparison, however many tokens are configured."""
        named = _NAMED_TOKEN.fullmatch(token)
        if named is not None:
            stored = self.named.get(named[1])
            if stored is not None and hmac.compare_digest(
                _salted(stored.salt, named[2]), stored.digest
            ):
                return stored.grant
            return None
        if token.count(".") == 2 and self.jwt_keys is not None:
            return self.jwt_keys.grant_of(token)
        return self.legacy.get(_plain_digest(token))


def _split(text: str) -> list[str]:
    """Tokens separated by commas or new lines; blank entries and # comments ignored."""
    out = []
    for line in text.replace(",", "\n").splitlines():
        token = line.strip()
        if token and not token.startswith("#"):
            out.append(token)
    return out


def legacy_grants(env: Mapping[str, str]) -> dict[bytes, Grant]:
    """Tokens from HASCHEDULER_{READ,WRITE}_TOKENS (comma-separated) and
    HASCHEDULER_{READ,WRITE}_TOKENS_FILE (one per line), both read when both are set:
    ``read-N`` may read every namespace, ``write-N`` do anything anywhere, as before
    tokens had names."""
    grants: dict[bytes, Grant] = {}
    for scope, actions in (("WRITE", frozenset(ACTIONS)), ("READ", frozenset({Action.READ}))):
        name = f"HASCHEDULER_{scope}_TOKENS"
        tokens = _split(env.get(name, ""))
        path = env.get(f"{name}_FILE")
        if path:
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise AccessConfigError(
                    f"{name}_FILE: cannot read {path}: {exc.strerror or exc}"
                ) from None
            from_file = _split(text)
            if not from_file:
                raise AccessConfigError(f"{name}_FILE: {path} holds no token")
            tokens += from_file
        for i, token in enumerate(tokens, 1):
            if PLACEHOLDER in token:
                raise AccessConfigError(
                    f"{name}: a token still says {PLACEHOLDER}: put a "
                    "token of your own in its place (k8s/base/"
                    "tokens-secret.example.yaml)"
                )
            if len(token) < MIN_TOKEN_CHARS:
                raise AccessConfigError(
                    f"{name}: every token needs at least {MIN_TOKEN_CHARS} characters"
                )
            # A token listed as both write and read keeps the write grant.
            grants.setdefault(
                _plain_digest(token),
                Grant(f"{scope.lower()}-{i}", actions, frozenset({ANY_NAMESPACE})),
            )
    return grants


def parse_actions(text: str | Iterable[str], where: str) -> frozenset[Action]:
    words = [w.strip() for w in (text.split(",") if isinstance(text, str) else text)]
    unknown = [w for w in words if w not in {a.value for a in ACTIONS}]
    if unknown or not words:
        raise AccessConfigError(
            f"{where}: actions are some of "
            f"{', '.join(a.value for a in ACTIONS)} (not {unknown or 'none'})"
        )
    return frozenset(Action(w) for w in words)


def parse_namespaces(text: str | Iterable[str], where: str) -> frozenset[str]:
    words = [w.strip() for w in (text.split(",") if isinstance(text, str) else text)]
    bad = [
        w
        for w in words
        if not isinstance(w, str) or (w != ANY_NAMESPACE and not NAMESPACE.fullmatch(w))
    ]
    if bad or not words:
        raise AccessConfigError(
            f"{where}: namespaces are '*' or DNS labels (lowercase "
            f"letters, digits, '-'), not {bad or 'none'}"
        )
    return frozenset(words)


@dataclass(frozen=True)
class NewToken:
    secret: str  # shown once
    entry: dict[str, Any]  # the access file's line


def create_token(name: str, actions: frozenset[Action], namespaces: frozenset[str]) -> NewToken:
    if not TOKEN_NAME.fullmatch(name):
        raise AccessConfigError(
            f"--name {name!r}: letters, digits, '.', '_', ':', '@' or "
            "'-', starting with a letter or digit"
        )
    token_id = secrets.token_hex(8)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    salt = secrets.token_bytes(16)
    return NewToken(
        f"{TOKEN_PREFIX}_{token_id}_{secret}",
        {
            "name": name,
            "id": token_id,
            "salt": salt.hex(),
            "hash": _salted(salt, secret).hex(),
            "actions": sorted(a.value for a in actions),
            "namespaces": sorted(namespaces),
        },
    )


def entry_line(entry: Mapping[str, Any]) -> str:
    """An access file's token entry on one line (YAML flow style, also JSON)."""
    return "  - " + json.dumps(dict(entry), separators=(", ", ": "))


@dataclass(frozen=True)
class Denied:
    status: int
    title: str
    headers: dict[str, str] = field(default_factory=dict)


CHALLENGE = {"WWW-Authenticate": 'Bearer realm="hascheduler"'}


def authenticate(access: Access, authorization: str | None) -> Grant | Denied:
    """The grant of the request's bearer token, or the 401 to answer."""
    if not access.enabled:
        return ANONYMOUS
    if not authorization:
        return Denied(
            401,
            "this API needs a token: send the header 'Authorization: Bearer <token>'",
            CHALLENGE,
        )
    kind, _, token = authorization.strip().partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        return Denied(401, "the Authorization header must be 'Bearer <token>'", CHALLENGE)
    grant = access.grant_of(token.strip())
    if grant is None:
        return Denied(401, "the token is not valid", CHALLENGE)
    return grant


def refusal(grant: Grant, action: Action, namespace: str | None) -> Denied:
    where = f"in namespace {namespace!r}" if namespace is not None else "anywhere"
    return Denied(
        403,
        f"{grant.name} may not {action.value} {where}: it may "
        f"{', '.join(sorted(a.value for a in grant.actions))} in "
        f"{', '.join(sorted(grant.namespaces))}",
    )


@dataclass(frozen=True)
class WriteLimit:
    """At most ``per_second`` writes per client on average, ``burst`` at once; 0 is off."""

    per_second: float = 50.0
    burst: int = 100

    def __post_init__(self) -> None:
        if self.per_second < 0 or not math.isfinite(self.per_second):
            raise AccessConfigError(
                "the write rate must be a number of writes per second, 0 or more (0: no limit)"
            )
        if self.per_second > 0 and self.burst < 1:
            raise AccessConfigError("the write burst must be at least 1")

    @property
    def enabled(self) -> bool:
        return self.per_second > 0


class WriteLimiter:
    """A token bucket per client, refilled continuously."""

    def __init__(self, limit: WriteLimit, clock: Callable[[], float] = time.monotonic) -> None:
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
