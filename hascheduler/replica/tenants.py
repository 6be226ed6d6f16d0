"""The mirror of one fan-out source: the documents of a collection, each reduced to the
fields its fan-outs need (their keys and filter fields), kept in sync by a change stream
with the schedules mirror's guarantees (invariant 2, docs/ARCHITECTURE.md).

Tenant documents carry no revision, so a replayed change (one the load already saw) cannot
be told from a new one; the stream is applied in order all the same, and the mirror is
ready only once the stream has caught up past the load: from then on it holds what the
collection holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from hascheduler.core.fanout import MISSING, FanOut, lookup, matches, tenant_key
from hascheduler.replica.mirror import ChangeMirror, WatchedCollection
from hascheduler.storage.streams import read_all

log = structlog.get_logger("hascheduler.tenants")


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
        # The tenants each fan-out selects, until the next change: a fan-out fire asks at
        # its claim and again, per claim batch, at its due time.
        self._selected: dict[str, list[str]] = {}

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
                self._changed()
            action = "remove"
        elif op in {"insert", "replace", "update"} and event.get("fullDocument") is not None:
            self.docs[key] = project(event["fullDocument"], self.fields)
            self._changed()
            action = "upsert"
        self._applied(event)
        return action

    def load(self, documents: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
        loaded = {d["_id"]: project(d, self.fields) for d in documents}
        changed = sum(1 for k, d in loaded.items() if self.docs.get(k) != d)
        removed = sum(1 for k in self.docs if k not in loaded)
        self.docs = loaded
        self._changed()
        return changed, removed

    def _changed(self) -> None:
        self._digest = None
        self._selected.clear()

    async def _load_all(self) -> tuple[int, int]:
        docs = [d async for d in read_all(self._coll, dict.fromkeys(self.fields, 1))]
        return self.load(docs)

    def tenants(self, fan_out: FanOut) -> list[str]:
        """The keys of the documents ``fan_out`` selects now, sorted; documents without a
        usable key are left out."""
        cache_key = fan_out.model_dump_json()
        selected = self._selected.get(cache_key)
        if selected is None:
            keys = {tenant_key(d, fan_out.key) for d in self.docs.values() if matches(fan_out, d)}
            selected = self._selected[cache_key] = sorted(k for k in keys if k is not None)
        return selected


def _order(key: Any) -> tuple[str, str]:
    return type(key).__name__, str(key)


class Sources:
    """The source mirrors a replica's schedules need: one per distinct (collection,
    fields), started when a schedule first names it, stopped when none does. A fan-out fire
    whose source is not in sync waits for it (the firing path's ``defer``)."""

    def __init__(self, database: Any) -> None:
        self.database = database
        self.mirrors: dict[tuple[str, tuple[str, ...]], SourceMirror] = {}
        self._tasks: dict[tuple[str, tuple[str, ...]], asyncio.Task[None]] = {}
        self._named: dict[str, tuple[str, tuple[str, ...]]] = {}  # schedule id -> source

    def on_change(self, schedule_id: str, fan_out: FanOut | None) -> None:
        """A schedule's fan-out as the mirror now holds it (None: none, or deleted)."""
        before = self._named.pop(schedule_id, None)
        if fan_out is not None:
            key = fan_out.source()
            self._named[schedule_id] = key
            if key not in self.mirrors:
                mirror = SourceMirror(self.database[key[0]], key[1])
                self.mirrors[key] = mirror
                self._tasks[key] = asyncio.get_running_loop().create_task(mirror.run())
                log.info("source_mirror_started", collection=key[0], fields=list(key[1]))
        if before is not None and before not in self._named.values():
            self.mirrors.pop(before).stop()
            self._tasks.pop(before).cancel()
            log.info("source_mirror_stopped", collection=before[0])

    @property
    def ready(self) -> bool:
        return all(m.ready for m in self.mirrors.values())

    def tenants(self, fan_out: FanOut) -> list[str] | None:
        mirror = self.mirrors.get(fan_out.source())
        return mirror.tenants(fan_out) if mirror is not None and mirror.ready else None

    async def wait_ready(self, fan_out: FanOut, timeout_s: float) -> bool:
        """Whether ``fan_out``'s source mirror is in sync within ``timeout_s``."""
        mirror = self.mirrors.get(fan_out.source())
        if mirror is None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(mirror.wait_ready(), timeout_s)
        return mirror.ready

    def summary(self) -> dict[str, Any]:
        """How many sources are mirrored, and one digest of all their copies: equal on two
        replicas, equal copies. It names no source (the open /readyz shows it)."""
        combined = hashlib.sha256()
        for (collection, fields), mirror in sorted(self.mirrors.items()):
            combined.update(f"{collection}:{','.join(fields)}={mirror.digest};".encode())
        return {"count": len(self.mirrors), "digest": combined.hexdigest()[:16]}

    async def close(self) -> None:
        for mirror in self.mirrors.values():
            mirror.stop()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=3)
