"""A fire as a Celery task message (protocol version 2, JSON), built in one place (pure).

A Celery worker that cannot decode a message may reject it back to its queue and meet it
again, for ever: every field here is proven against a real Celery worker
(tests/test_celery.py), and nothing else in the project builds these messages.

Protocol 2 (docs.celeryq.dev, "Message Protocol"): the task's name and id travel in the
AMQP headers, ``args``/``kwargs`` in a JSON body ``[args, kwargs, embed]``, and the task id
again as the correlation id. The task id is the fire id, so a task can tell a redelivery or
a republished fire from a new one (``self.request.id``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CELERY_PREFIX = "celery:"
# What the payload of a schedule with a Celery target may hold.
PAYLOAD_KEYS = frozenset({"args", "kwargs", "queue"})


class CeleryPayloadError(ValueError):
    """A payload that cannot become a Celery call: the message names the field."""


def celery_task(target: str) -> str | None:
    """The task name of a ``celery:<task>`` target, or None for any other target."""
    return target[len(CELERY_PREFIX) :] if target.startswith(CELERY_PREFIX) else None


@dataclass(frozen=True, slots=True)
class CeleryCall:
    args: list[Any]
    kwargs: dict[str, Any]
    queue: str | None  # None: the broker's configured Celery queue


def celery_call(payload: Any) -> CeleryCall:
    """The call a schedule's payload asks for: ``{"args": [...], "kwargs": {...},
    "queue": "name"}``, each key optional. Raises CeleryPayloadError naming the field."""
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise CeleryPayloadError(
            "payload: a Celery target takes an object with args, kwargs and queue"
        )
    unknown = set(payload) - PAYLOAD_KEYS
    if unknown:
        raise CeleryPayloadError(
            f"payload.{sorted(unknown)[0]}: a Celery target's payload "
            "holds only args, kwargs and queue"
        )
    args = payload.get("args", [])
    if not isinstance(args, list):
        raise CeleryPayloadError("payload.args: must be a list")
    kwargs = payload.get("kwargs", {})
    if not isinstance(kwargs, dict) or not all(k.isidentifier() for k in kwargs):
        raise CeleryPayloadError(
            "payload.kwargs: must be an object whose keys are Python identifiers"
        )
    queue = payload.get("queue")
    if queue is not None and (not isinstance(queue, str) or not 0 < len(queue) <= 255):
        raise CeleryPayloadError("payload.queue: must be a queue name of 1 to 255 characters")
    return CeleryCall(args, kwargs, queue)


@dataclass(frozen=True, slots=True)
class CeleryMessage:
    headers: dict[str, Any]
    correlation_id: str
    body: bytes
    content_type: str = "application/json"
    content_encoding: str = "utf-8"


def celery_message(task: str, fire_id: str, call: CeleryCall, origin: str) -> CeleryMessage:
    """The protocol-2 message that runs ``task(*call.args, **call.kwargs)`` as task id
    ``fire_id``."""
    headers: dict[str, Any] = {
        "lang": "py",
        "task": task,
        "id": fire_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": fire_id,
        "parent_id": None,
        "argsrepr": _bounded_repr(call.args),
        "kwargsrepr": _bounded_repr(call.kwargs),
        "origin": origin,
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    body = json.dumps([call.args, call.kwargs, embed], separators=(",", ":")).encode()
    return CeleryMessage(headers=headers, correlation_id=fire_id, body=body)


def _bounded_repr(value: Any, limit: int = 1024) -> str:
    # What Celery's monitors show; Celery itself truncates these too.
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
