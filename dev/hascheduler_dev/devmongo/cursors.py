"""Server-side cursors: plain result cursors and change stream cursors."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import bson

from hascheduler_dev.devmongo import engine
from hascheduler_dev.devmongo.changes import (
    TOKEN_FLAG_INVALIDATE,
    ChangeEvent,
    ChangeLog,
    encode_token,
)
from hascheduler_dev.devmongo.errors import MongoError
from hascheduler_dev.devmongo.values import Document

MAX_BATCH_BYTES = 16 * 1024 * 1024
DEFAULT_FIRST_BATCH = 101

# Events a change stream shows without showExpandedEvents.
_DEFAULT_EVENTS = frozenset(
    {"insert", "update", "replace", "delete", "drop", "rename", "dropDatabase", "invalidate"}
)
_INTERNAL_DBS = frozenset({"admin", "config", "local"})


@dataclass
class Cursor:
    id: int
    ns: str
    last_used: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.last_used = time.monotonic()


@dataclass
class ResultCursor(Cursor):
    docs: list[Document] = field(default_factory=list)
    pos: int = 0

    def next_batch(self, batch_size: int | None) -> list[Document]:
        batch: list[Document] = []
        size = 0
        limit = batch_size if batch_size else None
        while self.pos < len(self.docs) and (limit is None or len(batch) < limit):
            doc = self.docs[self.pos]
            size += len(bson.encode(doc))
            if batch and size > MAX_BATCH_BYTES:
                break
            batch.append(doc)
            self.pos += 1
        return batch

    @property
    def exhausted(self) -> bool:
        return self.pos >= len(self.docs)


@dataclass
class ChangeStreamCursor(Cursor):
    """A change stream over one collection, one database (coll None) or the cluster (db None)."""

    changes: ChangeLog | None = None
    db: str | None = None
    coll: str | None = None
    position: int = 0  # sequence number of the last event examined
    position_ticked: tuple[int, int] | None = None  # its cluster time (ClusterClock)
    full_document: str = "default"
    before_change: str = "off"
    show_expanded: bool = False
    stages: list[Document] = field(default_factory=list)
    lookup: Callable[[str, str, Any], Document | None] | None = None
    invalidated: bool = False  # the invalidate event was returned; the cursor is over
    # The stages' filters when they are only $match stages without $expr ([]: they are
    # not; None: not looked at yet).
    _filters: list[Document] | None = None

    def _in_scope(self, event: ChangeEvent) -> bool:
        if self.db is None:
            return event.db not in _INTERNAL_DBS
        if event.db != self.db:
            return False
        return self.coll is None or event.coll == self.coll or event.coll is None

    def _invalidates(self, event: ChangeEvent) -> bool:
        if self.coll is not None:
            return event.operation_type in {"drop", "rename", "dropDatabase"}
        return self.db is not None and event.operation_type == "dropDatabase"

    def _render(self, event: ChangeEvent) -> Document:
        doc = event.to_document()
        if event.operation_type in {"insert", "replace"}:
            doc["fullDocument"] = event.full_document
        elif event.operation_type == "update":
            if self.full_document == "updateLookup" and self.lookup is not None:
                doc["fullDocument"] = self.lookup(event.db, event.coll or "", event.key_id)
            elif self.full_document in {"whenAvailable", "required"}:
                doc["fullDocument"] = event.full_document
        if self.before_change == "whenAvailable" and event.operation_type in {
            "update",
            "replace",
            "delete",
        }:
            doc["fullDocumentBeforeChange"] = None
        return doc

    def _none_in_scope(self, changes: ChangeLog) -> bool:
        """Whether no event after ``position`` is in scope, known without reading them."""
        if self.db is None:
            return False
        if self.coll is None:
            return changes.last_in_db.get(self.db, 0) <= self.position
        return (
            changes.last_in.get((self.db, self.coll), 0) <= self.position
            and changes.last_in.get((self.db, None), 0) <= self.position
        )

    def collect(self, batch_size: int | None) -> list[Document]:
        """The next events in scope after ``position``, advancing it; never waits."""
        changes = self.changes
        assert changes is not None
        if self._none_in_scope(changes):
            changes.check_resumable_after(self.position)
            if changes.last_seq > self.position:
                self.position, self.position_ticked = changes.last_seq, changes.last_ticked
            return []
        batch: list[Document] = []
        for event in changes.after(self.position):
            if batch_size is not None and len(batch) >= batch_size:
                break
            self.position, self.position_ticked = event.seq, event.ticked
            if not self._in_scope(event):
                continue
            shown = self.show_expanded or event.operation_type in _DEFAULT_EVENTS
            if event.operation_type == "dropDatabase" and self.coll is not None:
                shown = False  # a collection's stream sees its drop, then invalidate
            if shown:
                batch.extend(self._apply_stages(self._render(event)))
            if self._invalidates(event):
                invalidate = {
                    "_id": encode_token(event.ticked, event.seq, TOKEN_FLAG_INVALIDATE),
                    "operationType": "invalidate",
                    "clusterTime": event.cluster_time,
                    "wallTime": event.wall_time,
                }
                batch.append(invalidate)
                self.invalidated = True
                break
        return batch

    def _apply_stages(self, doc: Document) -> list[Document]:
        if not self.stages:
            return [doc]
        if self._filters is None:
            self._filters = _only_filters(self.stages)
        if self._filters:
            # Only $match stages (a recorder watching a ledger's every write): the event is
            # matched, not put through the pipeline engine, which copies and dispatches.
            return [doc] if all(engine.matches(f, doc) for f in self._filters) else []
        out = engine.run_pipeline([doc], self.stages)
        for shown in out:
            if not isinstance(shown.get("_id"), dict) or shown["_id"] != doc["_id"]:
                raise MongoError(
                    280,
                    "Encountered an event whose _id field, which contains "
                    "the resume token, was modified by the pipeline.",
                )
        return out

    def post_batch_token(self, batch: list[Document]) -> Document:
        assert self.changes is not None
        if batch and self.invalidated:
            token: Document = batch[-1]["_id"]
            return token
        return encode_token(self.position_ticked or self.changes.clock.current, self.position)


def _only_filters(stages: list[Document]) -> list[Document]:
    """The filters of ``stages`` if each is a $match without $expr (whose $$NOW the
    pipeline engine evaluates), else []."""
    filters: list[Document] = []
    for stage in stages:
        wanted = stage.get("$match")
        if len(stage) != 1 or not isinstance(wanted, dict) or _names(wanted, "$expr"):
            return []
        filters.append(wanted)
    return filters


def _names(value: Any, operator: str) -> bool:
    """Whether ``operator`` appears as a key anywhere in ``value``."""
    if isinstance(value, dict):
        return any(k == operator or _names(v, operator) for k, v in value.items())
    if isinstance(value, list):
        return any(_names(v, operator) for v in value)
    return False
