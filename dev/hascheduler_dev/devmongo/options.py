"""Which options of each data command the development server implements.

An option it does not implement must be refused, not ignored: ``collation`` or ``let``
silently dropped would return a wrong result that looks right. Every command may carry the
generic fields drivers add (session, cluster time, read and write concern, API version); a
data command's own fields are checked against what its handler reads, and the statements
of ``update`` and ``delete`` and the specs of ``createIndexes`` likewise.
"""

from __future__ import annotations

from typing import Any

from hascheduler_dev.devmongo.errors import MongoError

# Sent by drivers with any command; none changes what a single-node server answers.
GENERIC = frozenset(
    {
        "$db",
        "lsid",
        "txnNumber",
        "$clusterTime",
        "$readPreference",
        "readConcern",
        "writeConcern",
        "apiVersion",
        "apiStrict",
        "apiDeprecationErrors",
        "comment",
        "maxTimeMS",
        "startTransaction",
        "autocommit",
        "stmtId",
        "stmtIds",
    }
)
# hint picks an index and changes no result; allowDiskUse, noCursorTimeout,
# allowPartialResults and bypassDocumentValidation have nothing to act on here.
COMMAND_OPTIONS: dict[str, frozenset[str]] = {
    "find": frozenset(
        {
            "find",
            "filter",
            "sort",
            "projection",
            "skip",
            "limit",
            "batchSize",
            "singleBatch",
            "hint",
            "allowDiskUse",
            "noCursorTimeout",
            "allowPartialResults",
        }
    ),
    "aggregate": frozenset(
        {
            "aggregate",
            "pipeline",
            "cursor",
            "explain",
            "allowDiskUse",
            "hint",
            "bypassDocumentValidation",
        }
    ),
    "count": frozenset({"count", "query", "limit", "skip", "hint"}),
    "distinct": frozenset({"distinct", "key", "query"}),
    "insert": frozenset({"insert", "documents", "ordered", "bypassDocumentValidation"}),
    "update": frozenset({"update", "updates", "ordered", "bypassDocumentValidation"}),
    "delete": frozenset({"delete", "deletes", "ordered"}),
    "findAndModify": frozenset(
        {
            "findAndModify",
            "query",
            "sort",
            "remove",
            "update",
            "new",
            "fields",
            "upsert",
            "arrayFilters",
            "hint",
            "bypassDocumentValidation",
        }
    ),
    "getMore": frozenset({"getMore", "collection", "batchSize"}),
    "createIndexes": frozenset({"createIndexes", "indexes", "commitQuorum"}),
    # A single node has no secondary to wait for or to force past.
    "replSetStepDown": frozenset({"replSetStepDown", "force", "secondaryCatchUpPeriodSecs"}),
}
COMMAND_OPTIONS["findandmodify"] = COMMAND_OPTIONS["findAndModify"] | {"findandmodify"}
STATEMENT_OPTIONS: dict[str, tuple[str, frozenset[str]]] = {
    "update": ("updates", frozenset({"q", "u", "upsert", "multi", "arrayFilters", "hint"})),
    "delete": ("deletes", frozenset({"q", "limit", "hint"})),
    "createIndexes": (
        "indexes",
        frozenset(
            {
                "key",
                "name",
                "unique",
                "sparse",
                "expireAfterSeconds",
                "partialFilterExpression",
                "background",
                "v",
            }
        ),
    ),
}
# Known to MongoDB, not implemented here: named in the error so the reader knows it is a
# limit of this server, not a mistake in the command.
NOT_IMPLEMENTED = frozenset(
    {
        "collation",
        "let",
        "c",
        "min",
        "max",
        "returnKey",
        "showRecordId",
        "tailable",
        "awaitData",
        "oplogReplay",
        "hidden",
        "wildcardProjection",
        "sampleRate",
    }
)


def check(name: str, body: dict[str, Any]) -> None:
    """Refuse an option ``name`` does not implement. Raises MongoError."""
    allowed = COMMAND_OPTIONS.get(name)
    if allowed is None:
        return
    _check_fields(name, body, allowed | GENERIC)
    statements = STATEMENT_OPTIONS.get(name)
    if statements is not None:
        field, known = statements
        items = body.get(field)
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict):
                _check_fields(f"{name}.{field}", item, known)


def _check_fields(where: str, document: dict[str, Any], known: frozenset[str]) -> None:
    for key in document:
        if key in known:
            continue
        if key in NOT_IMPLEMENTED:
            raise MongoError(
                115,
                f"the development server does not implement '{key}' for "
                f"{where}; run against a real MongoDB for it",
            )
        raise MongoError(40415, f"BSON field '{where}.{key}' is an unknown field.")
