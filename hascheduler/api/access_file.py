"""The access file: named tokens and namespace rules, read when a replica starts and again
when the file changes (polled), and what each change did, for the audit trail."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import structlog

from hascheduler.api.access import (
    RULES,
    TOKEN_NAME,
    Access,
    AccessConfigError,
    Grant,
    NamespaceRules,
    Stored,
    parse_actions,
    parse_namespaces,
)
from hascheduler.core import history
from hascheduler.core.constants import OWN_COLLECTIONS
from hascheduler.core.fanout import COLLECTION as FAN_OUT_COLLECTION
from hascheduler.core.fields import NAMESPACE

log = structlog.get_logger("hascheduler.access")


def read_access_file(path: str) -> tuple[dict[str, Stored], dict[str, NamespaceRules]]:  # noqa: C901 (one pass over the file, each entry checked where it is read)
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
    named: dict[str, Stored] = {}
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
        if not TOKEN_NAME.fullmatch(name) or name in names:
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
        named[str(entry["id"])] = Stored(
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
        if not isinstance(entry, dict) or set(entry) - RULES:
            raise AccessConfigError(f"{where}: {', '.join(sorted(RULES))} only")
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


def with_file(access: Access, path: str | None) -> Access:
    """``access`` with the named tokens and rules of the access file at ``path``."""
    if path is None:
        return access
    named, rules = read_access_file(path)
    return Access(named, access.legacy, access.jwt_keys, rules, from_file=True)


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
        self.current = with_file(base, path)

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
            self.current = with_file(self.base, self.path)
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
