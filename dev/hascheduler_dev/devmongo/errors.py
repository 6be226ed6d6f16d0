"""MongoDB server errors as the development server answers them."""

from __future__ import annotations

from typing import Any

# Codes and names from MongoDB's src/mongo/base/error_codes.yml; only those we answer.
CODE_NAMES: dict[int, str] = {
    1: "InternalError",
    2: "BadValue",
    9: "FailedToParse",
    13: "Unauthorized",
    14: "TypeMismatch",
    20: "IllegalOperation",
    26: "NamespaceNotFound",
    27: "IndexNotFound",
    40: "ConflictingUpdateOperators",
    43: "CursorNotFound",
    48: "NamespaceExists",
    50: "MaxTimeMSExpired",
    52: "DollarPrefixedFieldName",
    59: "CommandNotFound",
    66: "ImmutableField",
    67: "CannotCreateIndex",
    72: "InvalidOptions",
    73: "InvalidNamespace",
    85: "IndexOptionsConflict",
    86: "IndexKeySpecsConflict",
    91: "ShutdownInProgress",
    96: "OperationFailed",
    115: "CommandNotSupported",
    189: "PrimarySteppedDown",
    225: "TransactionTooOld",
    260: "InvalidResumeToken",
    263: "OperationNotSupportedInTransaction",
    280: "ChangeStreamFatalError",
    286: "ChangeStreamHistoryLost",
    352: "UnsupportedOpQueryCommand",
    10107: "NotWritablePrimary",
    11000: "DuplicateKey",
    40415: "Location40415",
    40674: "Location40674",
    11600: "InterruptedAtShutdown",
    11602: "InterruptedDueToReplStateChange",
    13435: "NotPrimaryNoSecondaryOk",
    13436: "NotPrimaryOrSecondary",
}

# Errors after which a driver must re-check the server's state (SDAM "state change").
STATE_CHANGE_CODES = frozenset({91, 189, 10107, 11600, 11602, 13435, 13436})


class MongoError(Exception):
    """A command failed; carries the code and extra reply fields MongoDB would send."""

    def __init__(self, code: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = extra

    @property
    def code_name(self) -> str:
        return CODE_NAMES.get(self.code, "UnknownError")

    def to_reply(self) -> dict[str, Any]:
        return {
            "ok": 0.0,
            "errmsg": self.message,
            "code": self.code,
            "codeName": self.code_name,
            **self.extra,
        }


class DuplicateKey(MongoError):
    def __init__(
        self, ns: str, index_name: str, key_pattern: dict[str, Any], key_value: dict[str, Any]
    ) -> None:
        shown = ", ".join(f"{k}: {v!r}" for k, v in key_value.items())
        super().__init__(
            11000,
            f"E11000 duplicate key error collection: {ns} index: {index_name} "
            f"dup key: {{ {shown} }}",
            keyPattern=key_pattern,
            keyValue=key_value,
        )


def bad_value(message: str) -> MongoError:
    return MongoError(2, message)


def type_mismatch(message: str) -> MongoError:
    return MongoError(14, message)
