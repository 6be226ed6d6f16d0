"""Query and update semantics: mongomock's engine, applied one document at a time.

mongomock is only used for what a document *means* under a filter, an update or a
pipeline; storage and indexes are ours (storage.py). Where mongomock diverges from
MongoDB in ways this project depends on, the gap is filled here, each fill with a test in
tests/devmongo/test_engine.py:

- ``$$NOW`` and ``$$CLUSTER_TIME``: mongomock ignores them; we substitute the operation's
  values before evaluation (MongoDB fixes both once per operation, so this is exact).
- ``$add`` of a date and milliseconds (mongomock asserts numbers only).
- Comparisons in ``$expr`` where a field is missing: MongoDB orders missing below every
  value; mongomock answers False for every comparison.
- ``$unset`` and ``$replaceWith`` stages in update pipelines.
"""

from __future__ import annotations

import copy
import datetime
import functools
import importlib
from collections.abc import Callable, Iterable
from typing import Any

from bson import Timestamp

from .errors import MongoError, bad_value
from .values import Document, sort_key

# mongomock has no type information; it is reached only through these handles, which keeps
# the untyped boundary in this one module.
mongomock: Any = importlib.import_module("mongomock")
mm_aggregate: Any = importlib.import_module("mongomock.aggregate")
mm_filtering: Any = importlib.import_module("mongomock.filtering")
mm_helpers: Any = importlib.import_module("mongomock.helpers")

_MONGOMOCK_ERRORS = (mongomock.OperationFailure, mongomock.WriteError, NotImplementedError,
                     AssertionError, TypeError, ValueError, KeyError, ZeroDivisionError)


def _engine_error(exc: BaseException) -> MongoError:
    if isinstance(exc, MongoError):
        return exc
    code = getattr(exc, "code", None) or 2
    if isinstance(exc, NotImplementedError):
        return MongoError(2, f"not supported by the development server: {exc}")
    return MongoError(int(code), str(exc) or exc.__class__.__name__)


# --- gap fills ---------------------------------------------------------------------------

def _install_gap_fills() -> None:
    parser = mm_aggregate._Parser
    original_arith = parser._handle_arithmetic_operator
    original_compare = parser._handle_comparison_operator

    @functools.wraps(original_arith)
    def arithmetic(self: Any, operator: str, values: Any) -> Any:
        if operator == "$add" and isinstance(values, list | tuple):
            parsed = list(self.parse_many(values))
            dates = [v for v in parsed if isinstance(v, datetime.datetime)]
            if len(dates) == 1:
                others = [v for v in parsed if v is not dates[0]]
                if any(v is None for v in others):
                    return None
                millis = sum(others)
                return dates[0] + datetime.timedelta(milliseconds=millis)
            if len(dates) > 1:
                raise mongomock.OperationFailure("only one date allowed in an $add expression")
        return original_arith(self, operator, values)

    @functools.wraps(original_compare)
    def compare(self: Any, operator: str, values: Any) -> Any:
        if operator in _COMPARATORS and isinstance(values, list | tuple) and len(values) == 2:
            left, right = (self._parse_or_nothing(v) for v in values)
            ordering = _compare(left, right)
            return _COMPARATORS[operator](ordering)
        return original_compare(self, operator, values)

    parser._handle_arithmetic_operator = arithmetic
    parser._handle_comparison_operator = compare
    mm_aggregate._PIPELINE_HANDLERS["$unset"] = _unset_stage
    mm_aggregate._PIPELINE_HANDLERS["$replaceWith"] = _replace_with_stage


_COMPARATORS: dict[str, Callable[[int], bool | int]] = {
    "$eq": lambda c: c == 0,
    "$ne": lambda c: c != 0,
    "$gt": lambda c: c > 0,
    "$gte": lambda c: c >= 0,
    "$lt": lambda c: c < 0,
    "$lte": lambda c: c <= 0,
    "$cmp": lambda c: c,
}


def _compare(left: Any, right: Any) -> int:
    """Aggregation comparison: BSON order across types, missing lowest of all."""
    if left is mm_filtering.NOTHING or right is mm_filtering.NOTHING:
        if left is right:
            return 0
        return -1 if left is mm_filtering.NOTHING else 1
    lk, rk = sort_key(left), sort_key(right)
    return (lk > rk) - (lk < rk)


def _unset_stage(docs: list[Document], _db: Any, options: Any) -> list[Document]:
    fields = [options] if isinstance(options, str) else options
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise mongomock.OperationFailure("$unset specification must be a string or an array "
                                         "of strings")
    out = []
    for doc in docs:
        doc = copy.deepcopy(doc)
        for field in fields:
            *parents, leaf = field.split(".")
            target: Any = doc
            for part in parents:
                target = target.get(part) if isinstance(target, dict) else None
            if isinstance(target, dict):
                target.pop(leaf, None)
        out.append(doc)
    return out


def _replace_with_stage(docs: list[Document], db: Any, options: Any) -> list[Document]:
    result: list[Document] = mm_aggregate._handle_replace_root_stage(
        docs, db, {"newRoot": options})
    return result


_install_gap_fills()


def substitute_system_vars(expr: Any, now: datetime.datetime, cluster_time: Timestamp) -> Any:
    """Replace ``$$NOW`` / ``$$CLUSTER_TIME`` with the operation's fixed values."""
    if isinstance(expr, str):
        if expr == "$$NOW":
            return now
        if expr == "$$CLUSTER_TIME":
            return cluster_time
        return expr
    if isinstance(expr, dict):
        if "$literal" in expr:
            return expr
        return {k: substitute_system_vars(v, now, cluster_time) for k, v in expr.items()}
    if isinstance(expr, list):
        return [substitute_system_vars(v, now, cluster_time) for v in expr]
    return expr


# --- per-document operations --------------------------------------------------------------

class Operation:
    """One operation's evaluation context: ``$$NOW`` and ``$$CLUSTER_TIME`` are fixed per op."""

    def __init__(self, now: datetime.datetime, cluster_time: Timestamp) -> None:
        self.now = now
        self.cluster_time = cluster_time

    def prepare(self, expr: Any) -> Any:
        return substitute_system_vars(expr, self.now, self.cluster_time)


def check_filter(filter_: Any) -> Document:
    if filter_ is None:
        return {}
    if not isinstance(filter_, dict):
        raise MongoError(14, "filter must be an object")
    try:
        mm_filtering.filter_applies(filter_, {})
    except _MONGOMOCK_ERRORS as exc:
        raise _engine_error(exc) from exc
    return filter_


def matches(filter_: Document, doc: Document) -> bool:
    """Whether ``doc`` satisfies ``filter_`` (already prepared by Operation.prepare)."""
    if not filter_:
        return True
    try:
        return bool(mm_filtering.filter_applies(filter_, doc))
    except _MONGOMOCK_ERRORS as exc:
        raise _engine_error(exc) from exc


# A private, always-empty mongomock collection: its update code works on a document
# handed to it and never touches its own storage.
_scratch: Any = mongomock.MongoClient().get_database("devmongo_scratch").get_collection("scratch")


def is_operator_update(update: Any) -> bool:
    return isinstance(update, dict) and bool(update) and next(iter(update)).startswith("$")


def validate_update(update: Any) -> None:
    if isinstance(update, list):
        for stage in update:
            if not isinstance(stage, dict) or len(stage) != 1:
                raise MongoError(9, "each update pipeline stage must be an object with one field")
            name = next(iter(stage))
            if name not in {"$set", "$addFields", "$unset", "$project", "$replaceRoot",
                            "$replaceWith"}:
                raise MongoError(
                    72, f"{name} is not allowed to be used within an update")
        return
    if not isinstance(update, dict):
        raise MongoError(14, "update must be an object or an array")
    operators = [k.startswith("$") for k in update]
    if any(operators) and not all(operators):
        raise MongoError(9, "an update document must contain only update operators or only "
                            "fields (a replacement)")
    for key in update:
        if key.startswith("$") and key not in _UPDATE_OPERATORS:
            raise MongoError(9, f"Unknown modifier: {key}. Expected a valid update modifier "
                                "or pipeline-style update specified as an array")


_UPDATE_OPERATORS = frozenset({
    "$set", "$unset", "$inc", "$mul", "$min", "$max", "$rename", "$setOnInsert",
    "$currentDate", "$push", "$pull", "$pullAll", "$addToSet", "$pop", "$bit"})


def apply_update(op: Operation, doc: Document, filter_: Document, update: Any,
                 inserting: bool, array_filters: list[Document] | None = None) -> Document:
    """The document after ``update``; ``doc`` itself is not modified.

    Raises MongoError (66 ImmutableField when ``_id`` would change).
    """
    if array_filters:
        raise MongoError(2, "arrayFilters are not supported by the development server")
    fast = _top_level_set_unset(doc, update)
    if fast is not None:
        return fast
    new = copy.deepcopy(doc)
    try:
        if isinstance(update, list):
            pipeline = op.prepare(update)
            [result] = list(mm_aggregate.process_pipeline([new], None, pipeline, None))
            new = result
        elif is_operator_update(update):
            if "$currentDate" in update:
                update = _current_date_as_set(op, update)
            _scratch._apply_update_document(new, filter_, update, inserting)
        else:
            new = copy.deepcopy(update)
            if "_id" in doc:
                new.setdefault("_id", doc["_id"])
    except _MONGOMOCK_ERRORS as exc:
        raise _engine_error(exc) from exc
    if "_id" in doc and ("_id" not in new or sort_key(new["_id"]) != sort_key(doc["_id"])):
        raise MongoError(66, "After applying the update, the (immutable) field '_id' was found "
                             "to have been altered")
    if "_id" in new and next(iter(new)) != "_id":
        new = {"_id": new["_id"], **{k: v for k, v in new.items() if k != "_id"}}
    patched: Document = mm_helpers.patch_datetime_awareness_in_document(new)
    return patched


def _plain_field(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and "." not in name and \
        not name.startswith("$") and name != "_id"


def _top_level_set_unset(doc: Document, update: Any) -> Document | None:
    """``$set``/``$unset`` of top-level, undotted fields, applied directly.

    For such fields MongoDB's semantics are plain assignment and removal, so this skips
    the deep copy and the general engine (the dispatcher marks thousands of fires a
    second this way). Anything else returns None and takes the general path. Stored
    documents are never mutated in place, so sharing unchanged values is safe.
    """
    if not isinstance(update, dict) or not update or not set(update) <= {"$set", "$unset"}:
        return None
    sets, unsets = update.get("$set", {}), update.get("$unset", {})
    if not isinstance(sets, dict) or not isinstance(unsets, dict) or not (sets or unsets):
        return None
    if not all(_plain_field(k) for k in (*sets, *unsets)) or set(sets) & set(unsets):
        return None
    if any(isinstance(v, dict) and any(str(k).startswith("$") for k in v)
           for v in sets.values()):
        return None  # operator-looking values: let the engine refuse them as MongoDB does
    new = {k: v for k, v in doc.items() if k not in unsets}
    for key, value in sets.items():
        new[key] = copy.deepcopy(value)
    patched: Document = mm_helpers.patch_datetime_awareness_in_document(new)
    return patched


def _current_date_as_set(op: Operation, update: Document) -> Document:
    spec = update["$currentDate"]
    sets = {}
    for field, kind in spec.items():
        wants_ts = isinstance(kind, dict) and kind.get("$type") == "timestamp"
        sets[field] = op.cluster_time if wants_ts else op.now
    rest = {k: v for k, v in update.items() if k != "$currentDate"}
    rest["$set"] = {**rest.get("$set", {}), **sets}
    return rest


def upsert_seed(filter_: Document) -> Document:
    """The document an upsert starts from: the filter's equality conditions."""
    seed: Document = {}

    def collect(f: Document) -> None:
        for key, value in f.items():
            if key == "$and" and isinstance(value, list):
                for part in value:
                    collect(part)
            elif key.startswith("$"):
                continue
            elif isinstance(value, dict) and value and next(iter(value)).startswith("$"):
                if "$eq" in value:
                    _set_path(seed, key, copy.deepcopy(value["$eq"]))
            else:
                _set_path(seed, key, copy.deepcopy(value))

    collect(filter_)
    return seed


def _set_path(doc: Document, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    target = doc
    for part in parents:
        target = target.setdefault(part, {})
    target[leaf] = value


def run_pipeline(docs: Iterable[Document], pipeline: list[Document]) -> list[Document]:
    try:
        return list(mm_aggregate.process_pipeline(list(docs), None, pipeline, None))
    except _MONGOMOCK_ERRORS as exc:
        raise _engine_error(exc) from exc


def sort_documents(docs: list[Document], sort: Document) -> list[Document]:
    if not sort:
        return docs
    try:
        result: list[Document] = mm_aggregate._handle_sort_stage(docs, None, sort)
    except _MONGOMOCK_ERRORS as exc:
        raise _engine_error(exc) from exc
    return result


def project(docs: list[Document], projection: Document | None) -> list[Document]:
    if not projection:
        return docs
    try:
        result: list[Document] = mm_aggregate._handle_project_stage(docs, None, projection)
    except _MONGOMOCK_ERRORS as exc:
        raise _engine_error(exc) from exc
    return result


def require_document(value: Any, what: str) -> Document:
    if not isinstance(value, dict):
        raise bad_value(f"{what} must be an object")
    return value
