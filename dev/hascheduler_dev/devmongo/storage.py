"""In-memory collections with real indexes, emitting change events for every write.

Documents are kept by an internal record id (like mongod's RecordId), in insertion order.
Every index keeps a hash map from key to record ids (equality, uniqueness) and its first
field's distinct values in order (ranges, TTL), so lookups by ``_id``, unique checks and indexed
equality or range filters never scan the collection. The planner only narrows candidates;
the full filter is always applied to them with MongoDB's matching semantics (engine.py).
"""

from __future__ import annotations

import datetime
import itertools
import re
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bson import ObjectId, Regex
from sortedcontainers import SortedList

from hascheduler_dev.devmongo import engine
from hascheduler_dev.devmongo.changes import ChangeLog
from hascheduler_dev.devmongo.errors import DuplicateKey, MongoError, bad_value
from hascheduler_dev.devmongo.values import (
    MISSING,
    PLAIN_SCALARS,
    RANK_DATE,
    Document,
    get_path,
    index_values,
    key_of,
    sort_key,
    type_rank,
)

# How an insert decides whether an index holds a document (Collection._insert_steps).
_ALWAYS, _EQUAL, _PRESENT, _GENERAL = "always", "equal", "present", "general"

# Values whose index keys need no array or document walk (a missing field indexes as null).
_SCALAR_TYPES = PLAIN_SCALARS | {type(None)}
_NEG_INF = float("-inf")


def _simple_filter(spec: Document | None) -> Any:
    """A plain function deciding ``spec`` for a document, or None when ``spec`` is not
    only top-level equalities to a string, a boolean or an integer, ``$in`` lists of plain
    scalars and ``{"$exists": true}`` tests. A value of another type than the one wanted
    goes to the general matcher (an array may hold what is wanted; 2.0 equals 2)."""
    if not spec:
        return None
    equal: list[tuple[str, Any]] = []
    among: list[tuple[str, frozenset[Hashable]]] = []
    present: list[str] = []
    for name, want in spec.items():
        if name.startswith("$") or "." in name:
            return None
        if isinstance(want, dict):
            if want == {"$exists": True}:
                present.append(name)
            elif (keys := _plain_keys(want)) is not None:
                among.append((name, keys))
            else:
                return None
        elif isinstance(want, str | int):  # a bool is an int
            equal.append((name, want))
        else:
            return None

    needed = frozenset(present)

    def check(doc: Document) -> bool:
        for name, want in equal:
            value = doc.get(name, MISSING)
            if value is MISSING:
                return False
            if value.__class__ is not want.__class__:
                # True == 1 in Python, not in MongoDB; an array may hold the value.
                return engine.matches(spec, doc)
            if value != want:
                return False
        for name, keys in among:
            value = doc.get(name, MISSING)
            if value is MISSING:
                return False  # null is not among the values: _plain_keys saw to it
            if value.__class__ not in PLAIN_SCALARS or value != value:
                return engine.matches(spec, doc)  # an array, a document, NaN
            if key_of(value) not in keys:
                return False
        return needed <= doc.keys()

    return check


def _plain_keys(cond: Document) -> frozenset[Hashable] | None:
    """For ``{"$in": [...]}`` of plain scalars (no null, NaN, array, document or regex):
    the values' equality keys, so that a document's value is looked up rather than
    compared with each (mongomock's way: a long list over many candidates holds the
    server, and everything queued behind it, a lease renewal too)."""
    values = cond.get("$in") if len(cond) == 1 else None
    if not isinstance(values, list) or not all(
        v.__class__ in PLAIN_SCALARS and v == v for v in values
    ):
        return None
    return frozenset(key_of(v) for v in values)


class DuplicateKeyConflict(Exception):
    """An index key already held by another record (Collection turns it into E11000)."""


@dataclass
class Index:
    name: str
    key: list[tuple[str, Any]]
    unique: bool = False
    sparse: bool = False
    expire_after_seconds: float | None = None
    partial_filter: Document | None = None
    # key tuple -> the record id holding it, or the set of them when more than one does
    # (most keys have one holder: a set for each was an allocation, and a tracked object
    # for the collector, per document per index)
    entries: dict[Hashable, int | set[int]] = field(default_factory=dict)
    # The collection's documents by record id, to build ``ordered`` from when first needed.
    docs: dict[int, Document] = field(default_factory=dict, repr=False)
    # The first field's values in order: built at the first range scan and maintained
    # from then on (a unique _id index is mostly only looked up, and keeping its order
    # cost every insert).
    ordered: FirstFieldOrder | None = None
    # An array value was indexed (any field): one document may satisfy two bounds with two
    # elements, and a key match no longer decides an equality exactly.
    multikey: bool = False
    held: int = 0  # records indexed
    fields: list[str] = field(init=False)
    _top_level: bool = field(init=False)
    # The partial filter as a plain check when it is top-level equalities of scalars and
    # {"$exists": true} (the shapes the scheduler uses): the general matcher, run for every
    # write to every partial index, cost the leader's ledger writes a good share of the
    # server's time.
    _partial_check: Any = field(init=False, default=None)
    # The top-level fields whose values decide this index's keys for a document and
    # whether it holds the document: a write that changes none of them leaves the index as
    # it was. None: any field may (a partial filter the plain check cannot decide).
    read_heads: tuple[str, ...] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.fields = [f for f, _ in self.key]
        # Top-level fields only: keys come straight from the document's values when they
        # are scalars (the common case), skipping the general multikey walk.
        self._top_level = not any("." in f for f in self.fields)
        self._partial_check = _simple_filter(self.partial_filter)
        heads = [path.split(".", 1)[0] for path in self.fields]
        if self.partial_filter is None:
            self.read_heads = tuple(dict.fromkeys(heads))
        elif self._partial_check is not None:
            self.read_heads = tuple(dict.fromkeys([*self.partial_filter, *heads]))

    def _sorted(self) -> FirstFieldOrder:
        if self.ordered is None:
            first = self.fields[0]
            self.ordered = FirstFieldOrder()
            for rid, doc in self.docs.items():
                if self.applies_to(doc):
                    for v in index_values(doc, first):
                        self.ordered.add(sort_key(v), rid)
        return self.ordered

    def spec(self) -> Document:
        out: Document = {"v": 2, "key": dict(self.key), "name": self.name}
        if self.unique and self.name != "_id_":
            out["unique"] = True
        if self.sparse:
            out["sparse"] = True
        if self.expire_after_seconds is not None:
            out["expireAfterSeconds"] = self.expire_after_seconds
        if self.partial_filter is not None:
            out["partialFilterExpression"] = self.partial_filter
        return out

    def reads_any(self, fields: frozenset[str]) -> bool:
        """Whether a change to these top-level fields may change this index's keys for a
        document, or whether it holds the document at all."""
        return self.read_heads is None or not fields.isdisjoint(self.read_heads)

    def applies_to(self, doc: Document) -> bool:
        if not self.sparse and self.partial_filter is None:
            return True
        if self.sparse and all(get_path(doc, f) is MISSING for f in self.fields):
            return False
        if self.partial_filter is None:
            return True
        if self._partial_check is not None:
            return bool(self._partial_check(doc))
        return engine.matches(self.partial_filter, doc)

    def _keys(self, doc: Document) -> tuple[list[Hashable], list[Any]]:
        """The index keys ``doc`` holds, and its first field's values (for ``ordered``)."""
        if self._top_level:  # a missing field indexes as null
            # Unrolled for one and two fields: this runs for every index of every write.
            if len(self.fields) == 1:
                v = doc.get(self.fields[0])
                if type(v) in _SCALAR_TYPES:
                    return [(key_of(v),)], [v]
            elif len(self.fields) == 2:
                v, w = doc.get(self.fields[0]), doc.get(self.fields[1])
                if type(v) in _SCALAR_TYPES and type(w) in _SCALAR_TYPES:
                    return [(key_of(v), key_of(w))], [v]
            else:
                plain = [doc.get(f) for f in self.fields]
                if all(type(v) in _SCALAR_TYPES for v in plain):
                    return [tuple(map(key_of, plain))], plain[:1]
        values = [index_values(doc, f) for f in self.fields]
        if all(len(vs) == 1 for vs in values):  # no array anywhere: exactly one key
            return [tuple(key_of(vs[0]) for vs in values)], values[0]
        per_field = [[key_of(v) for v in vs] for vs in values]
        return list(dict.fromkeys(itertools.product(*per_field))), values[0]

    def add(
        self, rid: int, doc: Document, unique_check: bool = False, applies: bool = False
    ) -> None:
        """Index ``doc`` as record ``rid``; with ``unique_check``, first raise
        DuplicateKeyConflict if a unique key is held by another record. ``applies``: the
        caller knows the index holds the document (its partial filter was checked)."""
        if not applies and not self.applies_to(doc):
            return
        keys, firsts = self._keys(doc)
        if unique_check and self.unique:
            taken = self._taken(rid, keys)
            if taken is not None:
                raise DuplicateKeyConflict(taken)
        self.held += 1
        entries = self.entries
        for k in keys:
            holders = entries.get(k)
            if holders is None:
                entries[k] = rid
            elif isinstance(holders, int):
                if holders != rid:
                    entries[k] = {holders, rid}
            else:
                holders.add(rid)
        if len(keys) > 1 or len(firsts) > 1:
            # Any array under any field: its keys no longer decide a condition exactly.
            self.multikey = True
        if self.ordered is not None:
            for v in firsts:
                self.ordered.add(sort_key(v), rid)

    def remove(self, rid: int, doc: Document) -> None:
        if not self.applies_to(doc):
            return
        keys, firsts = self._keys(doc)
        self.held -= 1
        entries = self.entries
        for k in keys:
            holders = entries.get(k)
            if holders is None:
                continue
            if isinstance(holders, int):
                if holders == rid:
                    del entries[k]
            else:
                holders.discard(rid)
                if len(holders) == 1:
                    entries[k] = next(iter(holders))
                elif not holders:
                    del entries[k]
        if self.ordered is not None:
            for v in firsts:
                self.ordered.discard(sort_key(v), rid)

    def conflict(self, rid: int, doc: Document) -> Hashable | None:
        """A key of ``doc`` already held by another record, if this index is unique."""
        if not self.unique or not self.applies_to(doc):
            return None
        return self._taken(rid, self._keys(doc)[0])

    def _taken(self, rid: int, keys: list[Hashable]) -> Hashable | None:
        for k in keys:
            holders = self.entries.get(k)
            if holders is None:
                continue
            if isinstance(holders, int):
                if holders != rid:
                    return k
            elif len(holders) > 1 or rid not in holders:
                return k
        return None

    def size(self) -> int:
        """How many records the index holds (each once, arrays or not)."""
        return self.held

    def members(self) -> set[int]:
        found: set[int] = set()
        for holders in self.entries.values():
            if isinstance(holders, int):
                found.add(holders)
            else:
                found |= holders
        return found

    def lookup(self, values: tuple[Any, ...]) -> set[int]:
        holders = self.entries.get(tuple(key_of(v) for v in values))
        if holders is None:
            return set()
        return {holders} if isinstance(holders, int) else set(holders)

    def lookup_size(self, values: tuple[Any, ...]) -> int:
        holders = self.entries.get(tuple(key_of(v) for v in values))
        if holders is None:
            return 0
        return 1 if isinstance(holders, int) else len(holders)

    def range(
        self, low: tuple[Any, ...], low_inclusive: bool, high: tuple[Any, ...], high_inclusive: bool
    ) -> Iterator[int]:
        """Record ids whose first-field sort key lies between ``low`` and ``high``, in
        (key, record id) order."""
        return self._sorted().range(low, low_inclusive, high, high_inclusive)

    def range_members(
        self, low: tuple[Any, ...], low_inclusive: bool, high: tuple[Any, ...], high_inclusive: bool
    ) -> set[int]:
        """Record ids whose first-field sort key lies between ``low`` and ``high``, in no
        order (a candidate set: sorting the records of a value held by 100,000 is waste)."""
        return self._sorted().members(low, low_inclusive, high, high_inclusive)

    def range_size(
        self,
        low: tuple[Any, ...],
        low_inclusive: bool,
        high: tuple[Any, ...],
        high_inclusive: bool,
        at_most: int | None = None,
    ) -> int:
        """How many records the range holds; with ``at_most``, the count stops once past
        it (a planner comparing with a smaller candidate set needs no more)."""
        return self._sorted().count(low, low_inclusive, high, high_inclusive, at_most)


class FirstFieldOrder:
    """An index's first-field values (their sort keys) in order, each with the records
    holding it. Ordered by distinct value, not by (value, record): the scheduler's indexed
    values repeat (a state, a term, the instant a batch was written), so most writes only
    add a record to, or take one from, a value already there; a sorted list of every
    (value, record) pair cost each of them a sorted insert or delete, an eighth of the
    server's samples at 10,000 fires a second (docs/ARCHITECTURE.md)."""

    def __init__(self) -> None:
        self.keys: SortedList[Any] = SortedList()
        self.holders: dict[Any, set[int]] = {}

    @staticmethod
    def _canonical(sk: tuple[Any, ...]) -> tuple[Any, ...]:
        # NaN compares with nothing, so no sorted list can hold it, and a dictionary finds
        # it only by identity: it is held with -Infinity, just above where MongoDB sorts
        # it (below every number). A range is only a candidate set: NaN is in every one
        # that holds -Infinity, and in no other that could match it.
        if len(sk) == 2 and sk[1] != sk[1]:
            return (sk[0], _NEG_INF)
        return sk

    def _held(self, sk: tuple[Any, ...]) -> tuple[tuple[Any, ...], set[int] | None]:
        """The key ``sk`` is held under, and its records (None: nobody holds it)."""
        holders = self.holders.get(sk)
        if holders is None:  # canonical only when missed: the common case pays nothing
            sk = self._canonical(sk)
            holders = self.holders.get(sk)
        return sk, holders

    def add(self, sk: tuple[Any, ...], rid: int) -> None:
        sk, holders = self._held(sk)
        if holders is None:
            self.holders[sk] = {rid}
            self.keys.add(sk)
        else:
            holders.add(rid)

    def discard(self, sk: tuple[Any, ...], rid: int) -> None:
        sk, holders = self._held(sk)
        if holders is None:
            return
        holders.discard(rid)
        if not holders:
            del self.holders[sk]
            self.keys.remove(sk)

    def range(
        self, low: tuple[Any, ...], low_inclusive: bool, high: tuple[Any, ...], high_inclusive: bool
    ) -> Iterator[int]:
        for sk in self.keys.irange(low, high, (low_inclusive, high_inclusive)):
            holders = self.holders[sk]
            yield from sorted(holders) if len(holders) > 1 else holders

    def members(
        self, low: tuple[Any, ...], low_inclusive: bool, high: tuple[Any, ...], high_inclusive: bool
    ) -> set[int]:
        if low == high and low_inclusive and high_inclusive:  # an equality: no walk
            return set(self.holders.get(self._canonical(low), ()))
        found: set[int] = set()
        for sk in self.keys.irange(low, high, (low_inclusive, high_inclusive)):
            found |= self.holders[sk]
        return found

    def count(
        self,
        low: tuple[Any, ...],
        low_inclusive: bool,
        high: tuple[Any, ...],
        high_inclusive: bool,
        at_most: int | None = None,
    ) -> int:
        """The records in the range, walking its distinct values: a wide range over
        values that seldom repeat walks many, so ``at_most`` stops the walk once past."""
        if low == high and low_inclusive and high_inclusive:  # an equality: no walk
            return len(self.holders.get(self._canonical(low), ()))
        total = 0
        for sk in self.keys.irange(low, high, (low_inclusive, high_inclusive)):
            total += len(self.holders[sk])
            if at_most is not None and total > at_most:
                break
        return total

    def __iter__(self) -> Iterator[int]:
        for sk in self.keys:
            yield from sorted(self.holders[sk])

    def __reversed__(self) -> Iterator[int]:
        for sk in reversed(self.keys):
            yield from sorted(self.holders[sk], reverse=True)


def index_name(key: list[tuple[str, Any]]) -> str:
    return "_".join(f"{f}_{d}" for f, d in key)


_RANGE_OPS = {"$gt", "$gte", "$lt", "$lte"}


def _equalities(filter_: Document) -> dict[str, list[Any]]:
    """Top-level conditions that pin a field to one of a few values (for the planner)."""
    found: dict[str, list[Any]] = {}
    for key, cond in filter_.items():
        if key == "$and" and isinstance(cond, list):
            for part in cond:
                if isinstance(part, dict):
                    for k, v in _equalities(part).items():
                        found.setdefault(k, v)
            continue
        if key.startswith("$"):
            continue
        if isinstance(cond, dict) and cond and next(iter(cond)).startswith("$"):
            if "$eq" in cond:
                found[key] = [cond["$eq"]]
            elif (
                "$in" in cond
                and isinstance(cond["$in"], list)
                and not any(_is_regex(v) for v in cond["$in"])
            ):
                found[key] = list(cond["$in"])
        elif not _is_regex(cond):
            found[key] = [cond]
    return found


def _covers(index: Index, equal: dict[str, list[Any]]) -> bool:
    """Whether every document the filter can match is in the index: always, unless the
    index is partial; then the filter must imply each condition of the partial filter, as
    MongoDB requires: a plain equality (``{"state": "claimed"}``) pinned to the same value,
    or ``{"$exists": true}`` on a field the filter pins to values that are not null
    (``{"open_key": {"$in": [...]}}``)."""
    if index.partial_filter is None:
        return True
    for field_, want in index.partial_filter.items():
        if (
            isinstance(want, dict)
            and want.keys() == {"$exists"}
            and want["$exists"] in (True, 1)
            and not field_.startswith("$")
        ):
            pinned = equal.get(field_)
            if not pinned or any(v is None for v in pinned):
                return False
            continue
        if isinstance(want, dict):
            if set(want) != {"$eq"}:
                return False
            want = want["$eq"]
        pinned = equal.get(field_)
        if (
            field_.startswith("$")
            or type(want) not in _SCALAR_TYPES
            or pinned is None
            or len(pinned) != 1
            or key_of(pinned[0]) != key_of(want)
        ):
            return False
    return True


def _is_regex(value: Any) -> bool:
    return isinstance(value, re.Pattern | Regex) or (isinstance(value, dict) and "$regex" in value)


def _ranges(filter_: Document) -> dict[str, Document]:
    found: dict[str, Document] = {}
    for key, cond in filter_.items():
        if key == "$and" and isinstance(cond, list):
            for part in cond:
                if isinstance(part, dict):
                    for k, v in _ranges(part).items():
                        found.setdefault(k, v)
        elif not key.startswith("$") and isinstance(cond, dict) and cond and set(cond) & _RANGE_OPS:
            found[key] = cond
    return found


class Collection:
    def __init__(self, catalog: Catalog, db: str, name: str) -> None:
        self.catalog = catalog
        self.db = db
        self.name = name
        self.docs: dict[int, Document] = {}
        self._rids = itertools.count(1)
        id_index = Index("_id_", [("_id", 1)], unique=True, docs=self.docs)
        self.indexes: dict[str, Index] = {"_id_": id_index}
        self.options: Document = {}
        # The indexes an update of these top-level fields may move a document in, per set
        # of fields updated (a few shapes of update, written thousands of times a second).
        self._touching: dict[frozenset[str], list[Index]] = {}
        # Each index in order, with how an insert decides whether it holds a document
        # (None: built at the next insert; see _insert_steps).
        self._inserting: list[tuple[Index, str, str, Any]] | None = None

    @property
    def ns(self) -> str:
        return f"{self.db}.{self.name}"

    @property
    def changes(self) -> ChangeLog:
        return self.catalog.changes

    # -- reading ------------------------------------------------------------------------

    def candidates(self, filter_: Document) -> Iterable[int]:
        """Record ids that may match, in natural order; narrowed through an index if one fits."""
        return self._plan(filter_)[0]

    def _plan(self, filter_: Document) -> tuple[list[int], frozenset[str]]:
        """Candidates, and the top-level fields whose conditions the chosen index decided
        exactly (scalar equalities or $in on the index's fields, none holding arrays)."""
        if not filter_:
            return list(self.docs), frozenset()
        equal = _equalities(filter_)
        ids = equal.get("_id")
        if ids is not None:
            # _id is unique: no index narrows an equality on it further (a bulk write of
            # outcomes by _id weighed every index of the runs for each statement).
            index = self.indexes["_id_"]
            found: set[int] = set()
            for value in ids:
                found |= index.lookup((value,))
            return sorted(found), (
                frozenset(["_id"]) if self._decides(index, "_id", filter_, equal) else frozenset()
            )
        # Each usable index's candidate count is read off its structures first; only the
        # smallest is materialised (an update of 1,000 fires by _id also matched the
        # (state, term) index, and copying its 20,000 claimed ids cost more than the update).
        best_size: int | None = None
        best_plan: tuple[Index, list[str]] | None = None
        for index in self.indexes.values():
            if index.sparse or not _covers(index, equal):
                continue
            fields = index.fields
            if all(f in equal for f in fields):
                size = sum(
                    index.lookup_size(combo)
                    for combo in itertools.product(*(equal[f] for f in fields))
                )
                used = fields
            elif fields[0] in equal and len(equal[fields[0]]) <= 64:
                size = 0
                for value in equal[fields[0]]:
                    sk = sort_key(value)
                    size += index.range_size(sk, True, sk, True)
                used = fields[:1]
            elif index.partial_filter is not None:
                # The filter implies the partial filter: the index holds every match (the
                # fires asked to run now, a few among a million, sorted on nominal_at).
                size, used = index.size(), []
            else:
                continue
            if best_size is None or size < best_size:
                best_size, best_plan = size, (index, used)
        # A range on an index's first field competes by its size too: the claimed fires
        # due for a retry (a range on next_attempt_at) are a few of the thousands the
        # (term) index's equality names.
        best_range: tuple[Index, tuple[tuple[Any, ...], bool, tuple[Any, ...], bool]] | None
        best_range = None
        ranges = _ranges(filter_)
        for index in self.indexes.values():
            cond = ranges.get(index.fields[0])
            if cond is None or index.sparse or not _covers(index, equal):
                continue
            bounds = self._range_bounds(index, cond)
            if bounds is None:
                return [], frozenset()
            size = index.range_size(*bounds, at_most=best_size)
            if best_size is None or size < best_size:
                best_size, best_plan, best_range = size, None, (index, bounds)
        best: set[int] | None = None
        decided: frozenset[str] = frozenset()
        if best_plan is not None:
            index, used = best_plan
            best = set()
            if not used:
                best = index.members()
            elif len(used) == len(index.fields):
                for combo in itertools.product(*(equal[f] for f in used)):
                    best |= index.lookup(combo)
            else:
                for value in equal[used[0]]:
                    sk = sort_key(value)
                    best |= index.range_members(sk, True, sk, True)
            if all(self._decides(index, f, filter_, equal) for f in used):
                decided = frozenset(used)
        elif best_range is not None:
            best = best_range[0].range_members(*best_range[1])
        if best is None:
            return list(self.docs), frozenset()
        return sorted(best), decided

    def _equality_narrows(self, equal: dict[str, list[Any]]) -> bool:
        return any(
            not index.sparse and _covers(index, equal) and index.fields[0] in equal
            for index in self.indexes.values()
        )

    def first_by_id(
        self, op: engine.Operation, filter_: Document, count: int, descending: bool = False
    ) -> list[Document] | None:
        """The first ``count`` matches in ``_id`` order, walking the ``_id`` index and
        stopping there; None when an equality index narrows the filter better (the
        planner's path). A page of a list sorted by ``_id`` after a cursor otherwise read
        every later document, so reading a whole collection page by page was quadratic."""
        filter_ = op.prepare(filter_)
        if self._equality_narrows(_equalities(filter_)):
            return None
        index = self.indexes["_id_"]
        cond = _ranges(filter_).get("_id")
        ordered = index._sorted()
        if cond is None:
            rids: Iterable[int] = reversed(ordered) if descending else iter(ordered)
        else:
            bounds = self._range_bounds(index, cond)
            if bounds is None:
                return []
            rids = index.range(*bounds)
            if descending:
                rids = reversed(list(rids))
        found: list[Document] = []
        for rid in rids:
            doc = self.docs.get(rid)
            if doc is not None and engine.matches(filter_, doc):
                found.append(doc)
                if len(found) >= count:
                    break
        return found

    @staticmethod
    def _decides(index: Index, path: str, filter_: Document, equal: dict[str, list[Any]]) -> bool:
        """Whether the index settles the condition on ``path`` (one of its fields)."""
        return (
            not index.multikey
            and "." not in path
            and _only_equality(filter_.get(path))
            and all(_exact_scalar(v) for v in equal[path])
        )

    @staticmethod
    def _range_bounds(
        index: Index, cond: Document
    ) -> tuple[tuple[Any, ...], bool, tuple[Any, ...], bool] | None:
        """The sort-key bounds of a range condition on ``index``'s first field (None: no
        value can match both bounds)."""
        bounds = [(op, v) for op, v in cond.items() if op in _RANGE_OPS]
        rank = type_rank(bounds[0][1])
        low: tuple[Any, ...] = (rank,)
        high: tuple[Any, ...] = (rank + 1,)
        low_inc, high_inc = True, False
        for op, value in bounds:
            if type_rank(value) != rank:
                return None  # type bracketing: no value matches both bounds
            sk = sort_key(value)
            if op in {"$gt", "$gte"}:
                low, low_inc = sk, op == "$gte"
            elif not (index.multikey and len(bounds) > 1):
                high, high_inc = sk, op == "$lte"
        return low, low_inc, high, high_inc

    def find(self, op: engine.Operation, filter_: Document) -> list[tuple[int, Document]]:
        rids, residual, simple = self._matching(op, filter_)
        if not residual:
            return [(rid, self.docs[rid]) for rid in rids if rid in self.docs]
        check = simple or (lambda doc: engine.matches(residual, doc))
        return [(rid, self.docs[rid]) for rid in rids if rid in self.docs and check(self.docs[rid])]

    def find_sorted(
        self, op: engine.Operation, filter_: Document, sort: Document, count: int
    ) -> list[tuple[int, Document]]:
        """The first ``count`` matches in ``sort`` order. A filter only the general
        matcher decides is tried on the candidates in order until ``count`` match, rather
        than on every candidate before sorting (the next parked run of a long queue)."""
        rids, residual, simple = self._matching(op, filter_)
        candidates = [(rid, self.docs[rid]) for rid in rids if rid in self.docs]
        if residual and simple is None:
            ordered = engine.plain_sort([doc for _, doc in candidates], sort)
            if ordered is not None:
                rid_of = {id(doc): rid for rid, doc in candidates}
                found: list[tuple[int, Document]] = []
                for doc in ordered:
                    if engine.matches(residual, doc):
                        found.append((rid_of[id(doc)], doc))
                        if len(found) >= count:
                            break
                return found
        if residual:
            check = simple or (lambda doc: engine.matches(residual, doc))
            candidates = [(rid, doc) for rid, doc in candidates if check(doc)]
        rid_of = {id(doc): rid for rid, doc in candidates}
        return [
            (rid_of[id(doc)], doc)
            for doc in engine.sort_documents([doc for _, doc in candidates], sort)[:count]
        ]

    def _matching(self, op: engine.Operation, filter_: Document) -> tuple[list[int], Document, Any]:
        """The planner's candidates, the part of the filter left to check on each, and a
        plain check of that part (None: only the general matcher decides it)."""
        filter_ = op.prepare(filter_)
        rids, decided = self._plan(filter_)
        # Fields the index decided exactly need not be re-checked per candidate (for an
        # $in list that check scans the whole list for every document).
        residual = {k: v for k, v in filter_.items() if k not in decided} if decided else filter_
        return rids, residual, _simple_filter(residual) if residual else None

    def get_by_id(self, _id: Any) -> Document | None:
        rids = self.indexes["_id_"].lookup((_id,))
        return self.docs[next(iter(rids))] if rids else None

    # -- writing ------------------------------------------------------------------------

    def insert(self, doc: Document) -> Any:
        """Insert one document; returns its ``_id``. Raises DuplicateKey."""
        validate_document(doc)
        if "_id" not in doc:
            doc = {"_id": ObjectId(), **doc}
        elif next(iter(doc)) != "_id":
            doc = {"_id": doc["_id"], **{k: v for k, v in doc.items() if k != "_id"}}
        if isinstance(doc["_id"], list):
            raise bad_value("can't use an array for _id")
        rid = next(self._rids)
        # Like mongod, the collection exists from here on even if the insert fails.
        self.catalog.ensure_registered(self)
        # Index first (rolling back on a duplicate), so a failed insert leaves no trace.
        self._index_new(rid, doc)
        self.docs[rid] = doc
        self.changes.append(self.db, self.name, "insert", doc["_id"], doc)
        return doc["_id"]

    def _index_new(self, rid: int, doc: Document, indexes: Iterable[Index] | None = None) -> None:
        """Add ``doc`` to the indexes (all by default), undoing it all on a duplicate key."""
        added: list[Index] = []
        try:
            if indexes is None:
                for index, how, field_, want in self._insert_steps():
                    if how == _EQUAL:
                        value = doc.get(field_, MISSING)
                        if value.__class__ is want.__class__:
                            if value != want:
                                continue
                        elif value is MISSING or not index.applies_to(doc):
                            continue  # another type: True is not 1, 1.0 is
                    elif how == _PRESENT and field_ not in doc:
                        continue
                    self._add_new(index, rid, doc, how != _GENERAL)
                    added.append(index)
            else:
                for index in indexes:
                    self._add_new(index, rid, doc, False)
                    added.append(index)
        except BaseException:
            for index in added:
                index.remove(rid, doc)
            raise

    def _add_new(self, index: Index, rid: int, doc: Document, applies: bool) -> None:
        try:
            index.add(rid, doc, unique_check=True, applies=applies)
        except DuplicateKeyConflict:
            raise DuplicateKey(
                self.ns,
                index.name,
                dict(index.key),
                {f: _first_value(doc, f) for f in index.fields},
            ) from None

    def _insert_steps(self) -> list[tuple[Index, str, str, Any]]:
        """Each index in order, with how an insert decides that it holds the document: a
        partial filter of one top-level equality to a string or an integer, or one
        ``$exists: true``, is decided inline (an insert into the fires ledger asked its
        five partial indexes, four of which never hold a new claim, a method call each)."""
        if self._inserting is None:
            steps: list[tuple[Index, str, str, Any]] = []
            for index in self.indexes.values():
                how, field_, want = _GENERAL, "", None
                partial = index.partial_filter
                if partial is None and not index.sparse:
                    how = _ALWAYS
                elif partial is not None and not index.sparse and len(partial) == 1:
                    name, wanted = next(iter(partial.items()))
                    if name[:1] != "$" and "." not in name:
                        if wanted.__class__ in (str, int):
                            how, field_, want = _EQUAL, name, wanted
                        elif wanted == {"$exists": True}:
                            how, field_ = _PRESENT, name
                steps.append((index, how, field_, want))
            self._inserting = steps
        return self._inserting

    def replace(
        self,
        rid: int,
        new: Document,
        replacement: bool,
        validated: bool = False,
        touched: frozenset[str] | None = None,
    ) -> bool:
        """Store ``new`` for record ``rid``; False when nothing changed. Raises DuplicateKey.
        ``validated``: its field names are known good (a PlainUpdate checked them).
        ``touched``: the only top-level fields in which ``new`` may differ from the stored
        document (the others are the same objects), as a PlainUpdate knows them."""
        if not validated:
            validate_document(new)
        old = self.docs[rid]
        if touched is None:
            # Native equality is fast; the type walk rejects what Python equates (True == 1).
            if old == new and _same_types(old, new):
                return False
            candidates: Iterable[Index] = self.indexes.values()
        else:
            if not any(_differ(old, new, name) for name in touched):
                return False
            candidates = self._indexes_touching(touched)
        # Only the indexes whose keys changed are touched (a fire's state change moves one).
        changed = [index for index in candidates if _index_fields_differ(index, old, new)]
        for index in changed:
            index.remove(rid, old)
        try:
            self._index_new(rid, new, changed)
        except BaseException:
            for index in changed:
                index.add(rid, old)
            raise
        self.docs[rid] = new
        if replacement:
            self.changes.append(self.db, self.name, "replace", new["_id"], new)
        else:
            self.changes.append(self.db, self.name, "update", new["_id"], new, old)
        return True

    def _indexes_touching(self, fields: frozenset[str]) -> list[Index]:
        found = self._touching.get(fields)
        if found is None:
            if len(self._touching) >= 1024:  # arbitrary shapes: a bound, not a leak
                self._touching.clear()
            found = self._touching[fields] = [
                index for index in self.indexes.values() if index.reads_any(fields)
            ]
        return found

    def delete(self, rid: int) -> Document:
        doc = self.docs.pop(rid)
        for index in self.indexes.values():
            index.remove(rid, doc)
        self.changes.append(self.db, self.name, "delete", doc["_id"])
        return doc

    # -- indexes ------------------------------------------------------------------------

    def create_index(self, spec: Document) -> bool:
        """Create an index from a createIndexes spec; False if an identical one exists."""
        key_doc = spec.get("key")
        if not isinstance(key_doc, dict) or not key_doc:
            raise MongoError(67, "index key pattern must be a non-empty object")
        key = list(key_doc.items())
        for f, direction in key:
            if direction not in (1, -1, 1.0, -1.0) and direction not in ("hashed",):
                raise MongoError(
                    67, f"unsupported index type {direction!r} on {f} in the development server"
                )
        name = spec.get("name") or index_name(key)
        ttl = spec.get("expireAfterSeconds")
        if ttl is not None and (
            not isinstance(ttl, int | float) or isinstance(ttl, bool) or ttl < 0 or len(key) != 1
        ):
            raise MongoError(
                67, "TTL index expireAfterSeconds must be a non-negative number on a single field"
            )
        index = Index(
            name,
            key,
            unique=bool(spec.get("unique")),
            sparse=bool(spec.get("sparse")),
            expire_after_seconds=ttl,
            partial_filter=spec.get("partialFilterExpression"),
            docs=self.docs,
        )
        for existing in self.indexes.values():
            same_key = existing.key == index.key
            if existing.name == name or same_key:
                if same_key and existing.spec() == index.spec():
                    return False
                if existing.name == name:
                    raise MongoError(
                        86,
                        f"An existing index has the same name ({name}) as the "
                        "requested index but a different key or options",
                    )
                raise MongoError(85, f"Index already exists with a different name: {existing.name}")
        for rid, doc in self.docs.items():
            conflict = index.conflict(rid, doc)
            if conflict is not None:
                raise DuplicateKey(
                    self.ns, name, dict(key), {f: _first_value(doc, f) for f in index.fields}
                )
            index.add(rid, doc)
        self.indexes[name] = index
        self._touching.clear()
        self._inserting = None
        self.catalog.ensure_registered(self)
        return True

    def drop_index(self, name_or_key: Any) -> None:
        if name_or_key == "_id_" or name_or_key == {"_id": 1}:
            raise MongoError(72, "cannot drop _id index")
        for name, index in list(self.indexes.items()):
            if name == name_or_key or dict(index.key) == name_or_key:
                del self.indexes[name]
                self._touching.clear()
                self._inserting = None
                return
        raise MongoError(27, f"index not found with name [{name_or_key}]")

    def expired(self, now: datetime.datetime) -> list[int]:
        """Record ids whose TTL index date lies more than expireAfterSeconds in the past."""
        found: set[int] = set()
        for index in self.indexes.values():
            if index.expire_after_seconds is None:
                continue
            cutoff = now - datetime.timedelta(seconds=index.expire_after_seconds)
            found |= index.range_members((RANK_DATE,), True, sort_key(cutoff), False)
        return sorted(found)

    def still_expired(self, rid: int, now: datetime.datetime) -> bool:
        """Whether record ``rid`` is still there and past a TTL index's expiry (the sweep
        yields between chunks: a write meanwhile may have deleted or refreshed it)."""
        doc = self.docs.get(rid)
        if doc is None:
            return False
        for index in self.indexes.values():
            if index.expire_after_seconds is None:
                continue
            cutoff = sort_key(now - datetime.timedelta(seconds=index.expire_after_seconds))
            if any(
                (RANK_DATE,) <= sort_key(v) < cutoff for v in index_values(doc, index.fields[0])
            ):
                return True
        return False


def _index_fields_differ(index: Index, old: Document, new: Document) -> bool:
    heads = index.read_heads
    if heads is None:
        return True  # whether it applies may have changed
    for name in heads:  # _differ, inlined: this runs for every index of every update
        a, b = old.get(name, MISSING), new.get(name, MISSING)
        if a is not b and (a != b or not _same_types(a, b)):
            return True
    return False


def _differ(old: Document, new: Document, field_: str) -> bool:
    a, b = old.get(field_, MISSING), new.get(field_, MISSING)
    return a is not b and (a != b or not _same_types(a, b))  # True == 1 in Python only


def _only_equality(cond: Any) -> bool:
    if isinstance(cond, dict):
        return set(cond) in ({"$eq"}, {"$in"})
    return cond is not None


def _exact_scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | ObjectId | datetime.datetime) and not isinstance(
        value, bool
    )


def _first_value(doc: Document, path: str) -> Any:
    value = get_path(doc, path)
    return None if value is MISSING else value


def _same_types(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same_types(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_types(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b)


def validate_document(doc: Any) -> None:
    if not isinstance(doc, dict):
        raise MongoError(14, "a document must be an object")
    for k in doc:
        if type(k) is not str or k[:1] == "$":
            if not isinstance(k, str):
                raise bad_value("document field names must be strings")
            if k.startswith("$"):
                raise MongoError(52, f"Document can't have $ prefixed field names: {k}")


class Catalog:
    """All databases and collections of the server, and the change log they write to."""

    def __init__(self, changes: ChangeLog) -> None:
        self.changes = changes
        self.databases: dict[str, dict[str, Collection]] = {}

    def get(self, db: str, name: str) -> Collection | None:
        return self.databases.get(db, {}).get(name)

    def collection(self, db: str, name: str) -> Collection:
        """The collection, created implicitly (as a write does) if missing."""
        validate_namespace(db, name)
        existing = self.get(db, name)
        if existing is not None:
            return existing
        return Collection(self, db, name)

    def ensure_registered(self, coll: Collection) -> None:
        colls = self.databases.setdefault(coll.db, {})
        if colls.get(coll.name) is not coll:
            colls[coll.name] = coll
            self.changes.append(coll.db, coll.name, "create")

    def create(self, db: str, name: str, options: Document) -> Collection:
        validate_namespace(db, name)
        if self.get(db, name) is not None:
            raise MongoError(48, f"Collection {db}.{name} already exists.")
        coll = Collection(self, db, name)
        coll.options = options
        self.ensure_registered(coll)
        return coll

    def drop(self, db: str, name: str) -> bool:
        colls = self.databases.get(db, {})
        if name not in colls:
            return False
        del colls[name]
        if not colls:
            del self.databases[db]
        self.changes.append(db, name, "drop")
        return True

    def drop_database(self, db: str) -> None:
        for name in list(self.databases.get(db, {})):
            self.drop(db, name)
        self.changes.append(db, None, "dropDatabase")


def validate_namespace(db: str, name: str) -> None:
    if not db or any(c in db for c in '/\\. "$\0'):
        raise MongoError(73, f"Invalid database name: '{db}'")
    if not name or "$" in name or "\0" in name or name.startswith("."):
        raise MongoError(73, f"Invalid collection name: '{name}'")
