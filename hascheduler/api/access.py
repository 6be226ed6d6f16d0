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
import dataclasses
import datetime as dt
import enum
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hascheduler.core import history
from hascheduler.core.constants import OWN_COLLECTIONS
from hascheduler.core.errors import ConfigError
from hascheduler.core.fanout import COLLECTION as FAN_OUT_COLLECTION
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
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


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

_RULES = frozenset(
    {"require_reason", "max_schedules", "max_fires_per_second", "max_fan_out", "fan_out_sources"}
)


@dataclass(frozen=True)
class _Stored:
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

    named: Mapping[str, _Stored] = field(default_factory=dict)
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

    def with_file(self, path: str | None) -> Access:
        """This access with the named tokens and rules of the access file at ``path``."""
        if path is None:
            return self
        named, rules = read_access_file(path)
        return Access(named, self.legacy, self.jwt_keys, rules, from_file=True)


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


def read_access_file(path: str) -> tuple[dict[str, _Stored], dict[str, NamespaceRules]]:  # noqa: C901 (one pass over the file, each entry checked where it is read)
    """The named tokens and namespace rules of an access file (YAML or JSON):

    tokens:
      - {name: billing-ci, id: 0123456789abcdef, salt: <hex>, hash: <hex>,
         actions: [read, trigger], namespaces: [billing]}
    namespaces:
      billing: {require_reason: true, max_schedules: 500, fan_out_sources: [customers]}
    """
    import yaml  # only a replica given an access file reads YAML: not at every start

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise AccessConfigError(
            f"--access-file: cannot read {path}: {exc.strerror or exc}"
        ) from None
    except yaml.YAMLError as exc:
        raise AccessConfigError(f"--access-file: {path}: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"tokens", "namespaces"}:
        raise AccessConfigError(
            f"--access-file: {path}: a mapping with 'tokens' and 'namespaces' only"
        )
    named: dict[str, _Stored] = {}
    names: set[str] = set()
    for i, entry in enumerate(data.get("tokens") or [], 1):
        where = f"--access-file: {path}: token {i}"
        if not isinstance(entry, dict) or set(entry) != {
            "name",
            "id",
            "salt",
            "hash",
            "actions",
            "namespaces",
        }:
            raise AccessConfigError(
                f"{where}: name, id, salt, hash, actions, namespaces "
                "(the line `hascheduler token create` printed)"
            )
        name = str(entry["name"])
        if not _NAME.fullmatch(name) or name in names:
            raise AccessConfigError(f"{where}: the name {name!r} is not a unique slug")
        if not re.fullmatch(r"[0-9a-f]{16}", str(entry["id"])) or entry["id"] in named:
            raise AccessConfigError(f"{where} ({name}): id must be 16 hex digits, unique")
        try:
            salt, digest = bytes.fromhex(str(entry["salt"])), bytes.fromhex(str(entry["hash"]))
        except ValueError:
            raise AccessConfigError(f"{where} ({name}): salt and hash are hex") from None
        if len(salt) < 16 or len(digest) != 32:
            raise AccessConfigError(
                f"{where} ({name}): salt (16+ bytes) and hash "
                "(32 bytes) as `token create` prints them"
            )
        names.add(name)
        named[str(entry["id"])] = _Stored(
            salt,
            digest,
            Grant(
                name,
                parse_actions(entry["actions"], f"{where} ({name})"),
                parse_namespaces(entry["namespaces"], f"{where} ({name})"),
            ),
        )
    rules: dict[str, NamespaceRules] = {}
    for namespace, entry in (data.get("namespaces") or {}).items():
        where = f"--access-file: {path}: namespace {namespace!r}"
        if not isinstance(namespace, str) or not NAMESPACE.fullmatch(namespace):
            raise AccessConfigError(f"{where}: not a namespace name")
        if not isinstance(entry, dict) or set(entry) - _RULES:
            raise AccessConfigError(f"{where}: {', '.join(sorted(_RULES))} only")
        for name in ("max_schedules", "max_fan_out"):
            limit = entry.get(name)
            if limit is not None and (
                isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
            ):
                raise AccessConfigError(f"{where}: {name} is a whole number")
        rate = entry.get("max_fires_per_second")
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < 1e9
        ):
            raise AccessConfigError(f"{where}: max_fires_per_second is a number above 0")
        rules[namespace] = NamespaceRules(
            bool(entry.get("require_reason", False)),
            entry.get("max_schedules"),
            None if rate is None else float(rate),
            entry.get("max_fan_out"),
            _fan_out_sources(entry.get("fan_out_sources") or [], where),
        )
    return named, rules


def _fan_out_sources(value: object, where: str) -> frozenset[str]:
    """A namespace's ``fan_out_sources``: collections of the schedules' database, never
    one of hascheduler's own."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AccessConfigError(f"{where}: fan_out_sources is a list of collection names")
    for name in value:
        if not FAN_OUT_COLLECTION.fullmatch(name) or name.startswith("system."):
            raise AccessConfigError(f"{where}: fan_out_sources: {name!r} is not a collection name")
        if name in OWN_COLLECTIONS:
            raise AccessConfigError(
                f"{where}: fan_out_sources: {name!r} is one of hascheduler's own collections"
            )
    return frozenset(value)


@dataclass(frozen=True)
class NewToken:
    secret: str  # shown once
    entry: dict[str, Any]  # the access file's line


def create_token(name: str, actions: frozenset[Action], namespaces: frozenset[str]) -> NewToken:
    if not _NAME.fullmatch(name):
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


# How often the access file is looked at: a revoked token stops working within this.
ACCESS_POLL_S = 1.0


class AccessFile:
    """The access in force: the start-up grants with the access file's, read again when
    the file changes. Polled, not watched: a mounted Kubernetes Secret changes by swapping
    a symlink, which an inotify watch on the file never sees. A file that no longer reads
    keeps the access it gave, and the log says why."""

    def __init__(self, base: Access, path: str | None = None) -> None:
        self.base = base
        self.path = path
        self._stamp = self._stat()
        self.current = base.with_file(path)

    def _stat(self) -> tuple[int, ...] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size

    def reload_if_changed(self) -> bool:
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            self.current = self.base.with_file(self.path)
        except AccessConfigError as exc:
            log.error("access_file_refused", error=str(exc))
            return False
        log.info("access_file_read", **self.current.counts())
        return True

    async def poll(self) -> None:
        """One look at the file (lifecycle.Every's step)."""
        self.reload_if_changed()

    def changes(self, before: Access, at: dt.datetime) -> list[dict[str, Any]]:
        """The audit records of what the file changed since ``before``: each token added
        or revoked (once per namespace it reaches), each namespace's rules. Their ids come
        from the change and the file's version, so every replica reading the same file
        writes the same records, once."""
        after, version = self.current, ":".join(map(str, self._stamp or ()))
        records = []
        for ids, action in (
            (after.named.keys() - before.named.keys(), history.TOKEN_ADD),
            (before.named.keys() - after.named.keys(), history.TOKEN_REVOKE),
        ):
            for token_id in sorted(ids):
                grant = (after.named.get(token_id) or before.named[token_id]).grant
                detail: dict[str, Any] = {
                    "token": grant.name,
                    "id": token_id,
                    "actions": sorted(grant.actions),
                    "namespaces": sorted(grant.namespaces),
                }
                records += [
                    _file_record(action, namespace, detail, at, version)
                    for namespace in sorted(grant.namespaces)
                ]
        for namespace in sorted(before.rules.keys() | after.rules.keys()):
            was, now = before.rules.get(namespace), after.rules.get(namespace)
            if was != now:
                changed: dict[str, Any] = {"before": _rules_view(was), "after": _rules_view(now)}
                records.append(
                    _file_record(history.NAMESPACE_RULES, namespace, changed, at, version)
                )
        return records


ACCESS_FILE_ACTOR = history.Actor("access-file")


def _file_record(
    action: str, namespace: str, detail: dict[str, Any], at: dt.datetime, version: str
) -> dict[str, Any]:
    made = history.record(action, ACCESS_FILE_ACTOR, at, namespace, "", None, detail=detail)
    key = json.dumps([action, namespace, detail, version], sort_keys=True, default=str)
    return {**made, "_id": hashlib.sha256(key.encode()).hexdigest()[:32]}


def _rules_view(rules: NamespaceRules | None) -> dict[str, Any] | None:
    if rules is None:
        return None
    view = dataclasses.asdict(rules)
    if rules.fan_out_sources is not None:
        view["fan_out_sources"] = sorted(rules.fan_out_sources)
    return view


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
