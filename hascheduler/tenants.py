"""The mirror of one fan-out source: the documents of a collection, each reduced to the
fields its fan-outs need (their keys and filter fields), kept in sync by a change stream
with the schedules mirror's guarantees (invariant 2, docs/ARCHITECTURE.md).

Tenant documents carry no revision, so a replayed change (one the load already saw) cannot
be told from a new one; the stream is applied in order all the same, and the mirror is
ready only once the stream has caught up past the load: from then on it holds what the
collection holds.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from .fanout import MISSING, FanOut, lookup, matches, tenant_key
from .mirror import ChangeMirror, WatchedCollection


def project(document: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """The parts of ``document`` at ``fields`` (dotted paths), nested as they were."""
    kept: dict[str, Any] = {}
    for path in fields:
        value = lookup(document, path)
        if value is MISSING:
            continue
        names = path.split(".")
        into = kept
        for name in names[:-1]:
            into = into.setdefault(name, {})
        into[names[-1]] = value
    return kept


class SourceMirror(ChangeMirror):
    """The documents of ``collection``, reduced to ``fields``; ``run()`` keeps it in sync."""

    READY_AFTER_LOAD = False
    NAME = "source_mirror"

    def __init__(self, collection: WatchedCollection, fields: Iterable[str]) -> None:
        super().__init__(collection)
        self.fields = tuple(sorted(set(fields) | {"_id"}))
        self.docs: dict[Any, dict[str, Any]] = {}
        self._digest: str | None = None

    @property
    def size(self) -> int:
        return len(self.docs)

    @property
    def digest(self) -> str:
        """sha256 over the kept documents in id order: equal digests, equal mirrors."""
        if self._digest is None:
            h = hashlib.sha256()
            for key in sorted(self.docs, key=_order):
                h.update(json.dumps(self.docs[key], sort_keys=True, default=str).encode())
                h.update(b"\n")
            self._digest = h.hexdigest()
        return self._digest

    def apply(self, event: dict[str, Any]) -> str:
        op = event.get("operationType")
        key = event.get("documentKey", {}).get("_id")
        action = "ignore"
        if op == "delete":
            if self.docs.pop(key, None) is not None:
                self._digest = None
            action = "remove"
        elif op in {"insert", "replace", "update"} and event.get("fullDocument") is not None:
            self.docs[key] = project(event["fullDocument"], self.fields)
            self._digest = None
            action = "upsert"
        self._applied(event)
        return action

    def load(self, documents: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
        loaded = {d["_id"]: project(d, self.fields) for d in documents}
        changed = sum(1 for k, d in loaded.items() if self.docs.get(k) != d)
        removed = sum(1 for k in self.docs if k not in loaded)
        self.docs = loaded
        self._digest = None
        return changed, removed

    async def _load_all(self) -> tuple[int, int]:
        docs = [d async for d in self._coll.find({}, dict.fromkeys(self.fields, 1))]
        return self.load(docs)

    def tenants(self, fan_out: FanOut) -> list[str]:
        """The keys of the documents ``fan_out`` selects now, sorted; documents without a
        usable key are left out."""
        keys = {tenant_key(d, fan_out.key) for d in self.docs.values() if matches(fan_out, d)}
        return sorted(k for k in keys if k is not None)


def _order(key: Any) -> tuple[str, str]:
    return type(key).__name__, str(key)
