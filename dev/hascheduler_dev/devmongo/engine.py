"""Query and update semantics: mongomock's engine, applied one document at a time.

mongomock is only used for what a document *means* under a filter, an update or a
pipeline; storage and indexes are ours (storage.py). Where mongomock diverges from
MongoDB in ways this project depends on, the gap is filled here, each fill with a test in
tests/devmongo/test_crud.py:

- ``$$NOW`` and ``$$CLUSTER_TIME``: mongomock ignores them; we substitute the operation's
  values before evaluation (MongoDB fixes both once per operation, so this is exact).
- ``$add`` of a date and milliseconds (mongomock asserts numbers only).
- Comparisons in ``$expr`` where a field is missing: MongoDB orders missing below every
  value; mongomock answers False for every comparison.
- ``$unset`` and ``$replaceWith`` stages in update pipelines.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import ge, gt, le, lt
from typing import Any

from bson import Int64, ObjectId, Timestamp

from hascheduler_dev.devmongo.errors import MongoError, bad_value
from hascheduler_dev.devmongo.values import (
    MISSING,
    PLAIN_SCALARS,
    Document,
    key_of,
    sort_key,
    type_rank,
)

# mongomock has no type information; it is reached only through these handles, which keeps
# the untyped boundary in this one module.
mongomock: Any = importlib.import_module("mongomock")
mm_aggregate: Any = importlib.import_module("mongomock.aggregate")
mm_filtering: Any = importlib.import_module("mongomock.filtering")
mm_helpers: Any = importlib.import_module("mongomock.helpers")

_MONGOMOCK_ERRORS = (
    mongomock.OperationFailure,
    mongomock.WriteError,
    NotImplementedError,
    AssertionError,
    TypeError,
    ValueError,
    KeyError,
    ZeroDivisionError,
)


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
        raise mongomock.OperationFailure(
            "$unset specification must be a string or an array of strings"
        )
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
    result: list[Document] = mm_aggregate._handle_replace_root_stage(docs, db, {"newRoot": options})
    return result


_install_gap_fills()


def substitute_system_vars(expr: Any, now: datetime.datetime, cluster_time: Timestamp) -> Any:
    """Replace ``$$NOW`` / ``$$CLUSTER_TIME`` with the operation's fixed values; ``expr``
    itself when it names neither (nothing rebuilt: a filter's $in list of a thousand ids
    was copied twice per statement)."""
    return _substituted(expr, now, cluster_time) if _names_variables(expr) else expr


def _names_variables(expr: Any) -> bool:
    cls = expr.__class__
    if cls is str:
        return bool(expr[:2] == "$$")
    if cls is dict:
        return "$literal" not in expr and _any_names_variables(expr.values())
    if cls is list:
        return _any_names_variables(expr)
    return isinstance(expr, str | dict | list)  # a subclass: the general walk decides


def _any_names_variables(values: Iterable[Any]) -> bool:
    for v in values:
        if v.__class__ is str:
            if v[:2] == "$$":
                return True
        elif v.__class__ not in PLAIN_SCALARS and v is not None and _names_variables(v):
            return True
    return False


def _substituted(expr: Any, now: datetime.datetime, cluster_time: Timestamp) -> Any:
    if isinstance(expr, str):
        if expr == "$$NOW":
            return now
        if expr == "$$CLUSTER_TIME":
            return cluster_time
        return expr
    if isinstance(expr, dict):
        if "$literal" in expr:
            return expr
        return {k: _substituted(v, now, cluster_time) for k, v in expr.items()}
    if isinstance(expr, list):
        return [_substituted(v, now, cluster_time) for v in expr]
    return expr


# --- per-document operations --------------------------------------------------------------


class Operation:
    """One operation's evaluation context: ``$$NOW`` and ``$$CLUSTER_TIME`` are fixed per op."""

    def __init__(self, now: datetime.datetime, cluster_time: Timestamp) -> None:
        self.now = now
        self.cluster_time = cluster_time

    def prepare(self, expr: Any) -> Any:
        return substitute_system_vars(expr, self.now, self.cluster_time)


def _plainly_valid(filter_: Document) -> bool:
    """Only fields equal to a plain scalar or null, or ``$in`` a list of those: nothing
    mongomock could refuse, so it is not asked (that check cost a per-document update
    statement about a third of its time)."""
    for name, want in filter_.items():
        if name.__class__ is not str or name[:1] == "$":
            return False
        cls = want.__class__
        if cls in PLAIN_SCALARS or want is None:
            continue
        if cls is dict and len(want) == 1:
            listed = want.get("$in")
            if listed.__class__ is list and all(
                v.__class__ in PLAIN_SCALARS or v is None for v in listed
            ):
                continue
        return False
    return True


def check_filter(filter_: Any) -> Document:
    if filter_ is None:
        return {}
    if not isinstance(filter_, dict):
        raise MongoError(14, "filter must be an object")
    if _plainly_valid(filter_):
        return filter_
    try:
        mm_filtering.filter_applies(filter_, {})
    except _MONGOMOCK_ERRORS as exc:
        raise _engine_error(exc) from exc
    return filter_


def matches(filter_: Document, doc: Document) -> bool:
    """Whether ``doc`` satisfies ``filter_`` (already prepared by Operation.prepare)."""
    if not filter_:
        return True
    plain = _plain_conditions(filter_, doc)
    if plain is not None:
        return plain
    try:
        return bool(mm_filtering.filter_applies(filter_, doc))
    except _MONGOMOCK_ERRORS as exc:
        raise _engine_error(exc) from exc


_RANGE_TESTS: dict[str, Callable[[Any, Any], bool]] = {"$lt": lt, "$lte": le, "$gt": gt, "$gte": ge}


def _plain_conditions(filter_: Document, doc: Document) -> bool | None:
    """The answer for a filter of top-level equalities and ranges ($lt, $lte, $gt, $gte)
    between plain scalars, or None.

    The ledger's writes and the leader's retry scans filter like this
    (``{"term": 3, "state": "claimed", "next_attempt_at": {"$lte": now}}``) over thousands
    of documents a second; arrays, documents, missing fields, NaN and other operators take
    the general matcher. Ranges compare within one BSON type only, as MongoDB's do.
    """
    for key, want in filter_.items():
        have = doc.get(key, MISSING)
        if type(have) not in PLAIN_SCALARS or key[:1] == "$" or "." in key or have != have:
            return None
        if type(want) is dict:
            for op, bound in want.items():
                test = _RANGE_TESTS.get(op)
                if test is None or type(bound) not in PLAIN_SCALARS or bound != bound:
                    return None
                if type_rank(have) != type_rank(bound) or not test(sort_key(have), sort_key(bound)):
                    return False
        elif type(want) not in PLAIN_SCALARS or want != want:
            return None
        elif key_of(have) != key_of(want):
            return False
    return True


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
            if name not in {
                "$set",
                "$addFields",
                "$unset",
                "$project",
                "$replaceRoot",
                "$replaceWith",
            }:
                raise MongoError(72, f"{name} is not allowed to be used within an update")
        return
    if not isinstance(update, dict):
        raise MongoError(14, "update must be an object or an array")
    operators = [k.startswith("$") for k in update]
    if any(operators) and not all(operators):
        raise MongoError(
            9,
            "an update document must contain only update operators or only fields (a replacement)",
        )
    for key, fields in update.items():
        if not key.startswith("$"):
            continue
        if key not in _UPDATE_OPERATORS:
            raise MongoError(
                9,
                f"Unknown modifier: {key}. Expected a valid update modifier "
                "or pipeline-style update specified as an array",
            )
        if isinstance(fields, dict) and "" in fields:
            raise MongoError(56, "An empty update path is not valid.")
        if key == "$push" and isinstance(fields, dict):
            for spec in fields.values():
                _validate_push_modifiers(spec)


def _validate_push_modifiers(spec: Any) -> None:
    """MongoDB's refusals of a ``$push`` whose ``$each`` or ``$slice`` is malformed."""
    if not isinstance(spec, dict) or "$each" not in spec:
        return
    if not isinstance(spec["$each"], list):
        raise MongoError(
            2,
            "The argument to $each in $push must be an array but it was of "
            f"type: {type(spec['$each']).__name__}",
        )
    keep = spec.get("$slice", 0)
    whole = isinstance(keep, int) or (isinstance(keep, float) and keep.is_integer())
    if not whole or isinstance(keep, bool):
        raise MongoError(
            2,
            "The value for $slice must be an integer value but was given "
            f"type: {type(keep).__name__}",
        )


_UPDATE_OPERATORS = frozenset(
    {
        "$set",
        "$unset",
        "$inc",
        "$mul",
        "$min",
        "$max",
        "$rename",
        "$setOnInsert",
        "$currentDate",
        "$push",
        "$pull",
        "$pullAll",
        "$addToSet",
        "$pop",
        "$bit",
    }
)


def apply_update(
    op: Operation,
    doc: Document,
    filter_: Document,
    update: Any,
    inserting: bool,
    array_filters: list[Document] | None = None,
    plan: PlainUpdate | None = None,
) -> Document:
    """The document after ``update``; ``doc`` itself is not modified. ``plan``, from
    plain_update_plan(update) when one update applies to many documents, skips re-reading
    it.

    Raises MongoError (66 ImmutableField when ``_id`` would change).
    """
    if plan is not None:
        return plan.apply(doc)
    if array_filters is not None or _has_array_positional(update):
        return _apply_with_array_filters(op, doc, filter_, update, inserting, array_filters or [])
    fast = plain_update_plan(update)
    if fast is not None:
        return fast.apply(doc)
    new = copy.deepcopy(doc)
    whole = True  # the result's every value patched to what the server stores
    try:
        if isinstance(update, list):
            pipeline = op.prepare(update)
            [result] = list(mm_aggregate.process_pipeline([new], None, pipeline, None))
            new = result
        elif is_operator_update(update):
            if "$currentDate" in update:
                update = _current_date_as_set(op, update)
            if not inserting:
                # The stored document was patched when written: only the update's own
                # values need it (an upsert's insert also takes values from the filter).
                update = mm_helpers.patch_datetime_awareness_in_document(update)
                whole = False
            _scratch._apply_update_document(new, filter_, update, inserting)
        else:
            new = copy.deepcopy(update)
            if "_id" in doc:
                new.setdefault("_id", doc["_id"])
    except _MONGOMOCK_ERRORS as exc:
        raise _engine_error(exc) from exc
    if "_id" in doc and ("_id" not in new or sort_key(new["_id"]) != sort_key(doc["_id"])):
        raise MongoError(
            66,
            "After applying the update, the (immutable) field '_id' was found to have been altered",
        )
    if "_id" in new and next(iter(new)) != "_id":
        new = {"_id": new["_id"], **{k: v for k, v in new.items() if k != "_id"}}
    if not whole:
        return new
    patched: Document = mm_helpers.patch_datetime_awareness_in_document(new)
    return patched


# --- arrayFilters --------------------------------------------------------------------------

_IDENTIFIER = re.compile(r"^[a-z][a-zA-Z0-9]*$")
_FILTERED_OPERATORS = frozenset({"$set", "$unset", "$inc", "$mul", "$min", "$max"})


def _array_filters_by_identifier(array_filters: Any) -> dict[str, Document]:
    if not isinstance(array_filters, list):
        raise MongoError(14, "arrayFilters must be an array of objects")
    found: dict[str, Document] = {}
    for spec in array_filters:
        if not isinstance(spec, dict) or not spec:
            raise MongoError(9, "each arrayFilters entry must be a non-empty object")
        identifiers = {key.split(".", 1)[0] for key in spec}
        if len(identifiers) != 1:
            raise MongoError(9, "each arrayFilters entry must use exactly one identifier")
        identifier = identifiers.pop()
        if not _IDENTIFIER.match(identifier):
            raise MongoError(
                2,
                f"the array filter identifier '{identifier}' must begin with "
                "a lowercase letter and contain only letters and digits",
            )
        if identifier in found:
            raise MongoError(
                9, f"Found multiple array filters with the same top-level field name {identifier}"
            )
        # Matched against {"v": element}: "x.grade" -> "v.grade", "x" -> "v".
        found[identifier] = {"v" + key[len(identifier) :]: cond for key, cond in spec.items()}
    return found


def _has_array_positional(update: Any) -> bool:
    return is_operator_update(update) and any(
        isinstance(fields, dict) and any("$[" in str(path) for path in fields)
        for fields in update.values()
    )


def _apply_with_array_filters(
    op: Operation,
    doc: Document,
    filter_: Document,
    update: Any,
    inserting: bool,
    array_filters: Any,
) -> Document:
    """An update with ``$[]`` / ``$[<identifier>]`` paths (mongomock has none).

    Paths without positional operators go through the engine as usual; the filtered ones
    are applied here, in the order written.
    """
    filters = _array_filters_by_identifier(array_filters)
    if not is_operator_update(update):
        raise MongoError(9, "arrayFilters may only be used with update operators")
    plain: Document = {}
    positional: list[tuple[str, str, Any]] = []
    for operator, fields in update.items():
        if not isinstance(fields, dict):
            raise MongoError(
                9, f"Modifiers operate on fields but we found type {type(fields).__name__} instead"
            )
        for path, value in fields.items():
            if "$[" in path:
                if operator not in _FILTERED_OPERATORS:
                    raise MongoError(
                        2, f"{operator} with $[] paths is not supported by the development server"
                    )
                positional.append((operator, path, value))
            else:
                plain.setdefault(operator, {})[path] = value
    used: set[str] = set()
    new = apply_update(op, doc, filter_, plain, inserting) if plain else copy.deepcopy(doc)
    for operator, path, value in positional:
        _apply_positional(new, path.split("."), operator, value, filters, used, path)
    unused = set(filters) - used
    if unused:
        raise MongoError(
            9, f"The array filter for identifier '{sorted(unused)[0]}' was not used in the update"
        )
    patched: Document = mm_helpers.patch_datetime_awareness_in_document(new)
    return patched


def _apply_positional(
    node: Any,
    parts: list[str],
    operator: str,
    value: Any,
    filters: dict[str, Document],
    used: set[str],
    path: str,
) -> None:
    head, rest = parts[0], parts[1:]
    if head.startswith("$[") and head.endswith("]"):
        identifier = head[2:-1]
        if identifier and identifier not in filters:
            raise MongoError(
                2, f"No array filter found for identifier '{identifier}' in path '{path}'"
            )
        if identifier:
            used.add(identifier)
        if not isinstance(node, list):
            raise MongoError(2, f"Cannot apply array updates to non-array element in path '{path}'")
        for index, element in enumerate(node):
            if identifier and not matches(filters[identifier], {"v": element}):
                continue
            if rest:
                _apply_positional(element, rest, operator, value, filters, used, path)
            else:
                _set_one(node, index, operator, value, path)
        return
    if not rest:
        _set_one(node, head, operator, value, path)
        return
    if isinstance(node, dict) and head in node:
        child = node[head]
    elif isinstance(node, list) and head.isdigit() and int(head) < len(node):
        child = node[int(head)]
    else:
        raise MongoError(
            2, f"The path '{path}' must exist in the document in order to apply array updates."
        )
    _apply_positional(child, rest, operator, value, filters, used, path)


def _set_one(container: Any, key: Any, operator: str, value: Any, path: str) -> None:
    if isinstance(container, list):
        key = int(key) if isinstance(key, str) else key
        present = 0 <= key < len(container)
        current = container[key] if present else MISSING_VALUE
    elif isinstance(container, dict):
        present = key in container
        current = container.get(key, MISSING_VALUE)
    else:
        raise MongoError(28, f"Cannot create field '{key}' in element of path '{path}'")
    if operator == "$unset":
        if isinstance(container, list):
            if present:
                container[key] = None  # MongoDB leaves a null in the array
        else:
            container.pop(key, None)
        return
    if operator == "$set":
        new = copy.deepcopy(value)
    elif operator in {"$inc", "$mul"}:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise MongoError(14, f"Cannot {operator[1:]} with non-numeric argument")
        if current is MISSING_VALUE:
            new = value if operator == "$inc" else 0
        elif not isinstance(current, int | float) or isinstance(current, bool):
            raise MongoError(14, f"Cannot apply {operator} to a value of non-numeric type")
        else:
            new = current + value if operator == "$inc" else current * value
    else:  # $min / $max
        if current is MISSING_VALUE:
            new = copy.deepcopy(value)
        else:
            keep_new = (
                sort_key(value) < sort_key(current)
                if operator == "$min"
                else sort_key(value) > sort_key(current)
            )
            new = copy.deepcopy(value) if keep_new else current
    if isinstance(container, list):
        if not present:
            raise MongoError(2, f"array index {key} out of range in path '{path}'")
        container[key] = new
    else:
        container[key] = new


MISSING_VALUE: Any = object()


def _plain_field(name: Any) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and "." not in name
        and not name.startswith("$")
        and name != "_id"
    )


@dataclass(frozen=True, slots=True)
class PlainUpdate:
    """An update of only ``$set``, ``$unset`` and ``$push`` (of values, or ``$each`` with
    an optional ``$slice``) on top-level, undotted fields.

    For such fields MongoDB's semantics are assignment, removal and a list grown at its
    end, so this skips the deep copy and the general engine (the dispatcher marks
    thousands of fires a second this way, and a worker records each run's outcome with a
    push to its attempt history). Stored documents are never mutated in place, so sharing
    the values between the documents updated is safe."""

    sets: Document
    unsets: frozenset[str]
    pushes: tuple[tuple[str, list[Any], int | None], ...] = ()  # field, values, $slice
    # Every field it may change: the others stay the very same objects, so only these
    # decide whether a document changed and which indexes it moves in.
    touched: frozenset[str] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "touched",
            frozenset(self.sets) | self.unsets | {name for name, _, _ in self.pushes},
        )

    def apply(self, doc: Document) -> Document:
        """The updated document. Raises MongoError (2 BadValue) when a push meets a field
        that is not an array."""
        unsets = self.unsets
        new = {k: v for k, v in doc.items() if k not in unsets} if unsets else dict(doc)
        new.update(self.sets)
        for field, values, keep in self.pushes:
            current = new.get(field, [])
            if not isinstance(current, list):
                raise MongoError(
                    2,
                    f"The field '{field}' must be an array but is of type "
                    f"{type(current).__name__} in document "
                    f"{{_id: {doc.get('_id')!r}}}",
                )
            grown = current + values
            if keep is not None:
                grown = grown[keep:] if keep < 0 else grown[:keep]
            new[field] = grown
        return new


def plain_update_plan(update: Any) -> PlainUpdate | None:
    """The PlainUpdate for ``update``, or None when it needs the general engine. Raises
    MongoError (40 ConflictingUpdateOperators) when it names a field twice."""
    if not isinstance(update, dict) or not update or not set(update) <= {"$set", "$unset", "$push"}:
        return None
    sets, unsets = update.get("$set", {}), update.get("$unset", {})
    pushed = update.get("$push", {})
    if (
        not isinstance(sets, dict)
        or not isinstance(unsets, dict)
        or not isinstance(pushed, dict)
        or not (sets or unsets or pushed)
    ):
        return None
    fields = [*sets, *unsets, *pushed]
    if not all(_plain_field(k) for k in fields):
        return None
    if len(set(fields)) != len(fields):
        twice = next(f for f in fields if fields.count(f) > 1)
        raise MongoError(40, f"Updating the path '{twice}' would create a conflict at '{twice}'")
    if any(_operator_like(v) for v in sets.values()):
        return None  # operator-looking values: let the engine refuse them as MongoDB does
    pushes = []
    for field, spec in pushed.items():
        if not _operator_like(spec):
            values, keep = [spec], None
        elif (
            set(spec) <= {"$each", "$slice"}
            and isinstance(spec.get("$each"), list)
            and _is_slice_count(spec.get("$slice"))
        ):
            values, keep = spec["$each"], spec.get("$slice")
            if any(_operator_like(v) for v in values):
                return None
        else:  # $sort, $position, or a malformed modifier
            return None
        pushes.append((field, mm_helpers.patch_datetime_awareness_in_document(values), keep))
    # The helper rebuilds containers, so nothing is shared with the command's document.
    return PlainUpdate(
        {
            k: v
            if v.__class__ in _UNPATCHED or v is None
            else mm_helpers.patch_datetime_awareness_in_document(v)
            for k, v in sets.items()
        },
        frozenset(unsets),
        tuple(pushes),
    )


# Values the helper returns as they are (it rebuilds containers and moves datetimes to UTC).
_UNPATCHED = frozenset({str, int, float, bool, Int64, ObjectId})


def _operator_like(value: Any) -> bool:
    return isinstance(value, dict) and any(str(k).startswith("$") for k in value)


def _is_slice_count(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


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
    plain = plain_sort(docs, sort)
    if plain is not None:
        return plain
    try:
        result: list[Document] = mm_aggregate._handle_sort_stage(docs, None, sort)
    except _MONGOMOCK_ERRORS as exc:
        raise _engine_error(exc) from exc
    return result


def plain_sort(docs: list[Document], sort: Document) -> list[Document] | None:
    """``docs`` sorted on top-level fields holding plain scalars (or missing: null), by
    their sort keys; None for anything else (arrays sort by an element, documents field
    by field: mongomock's, which wraps every value in a comparator object and holds the
    server's one thread many times longer)."""
    fields: list[tuple[str, bool]] = []
    for name, direction in sort.items():
        if (
            name[:1] == "$"
            or "." in name
            or type(direction) not in (int, float)
            or direction not in (1, -1)
        ):
            return None
        fields.append((name, direction == -1))
    for doc in docs:
        for name, _ in fields:
            value = doc.get(name)
            if value is not None and (type(value) not in PLAIN_SCALARS or value != value):
                return None
    ordered = list(docs)
    # As MongoDB's compound order: the last field first, each sort stable.
    for name, descending in reversed(fields):
        ordered.sort(key=functools.partial(_sort_key_of, name), reverse=descending)
    return ordered


def _sort_key_of(name: str, doc: Document) -> tuple[Any, ...]:
    return sort_key(doc.get(name))


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
