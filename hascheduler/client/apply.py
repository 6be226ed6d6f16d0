"""Declared schedules made real: the plan (pure) and its writes (through the client).

A declaration is a schedule as ``PUT /schedules/{id}`` takes it, with its ``id``. The plan
compares each declaration with the schedule of that id, field by field, after both went
through the same model (so a default left out and the same default written are equal),
and, when pruning, lists the schedules carrying the selector's label that nothing
declares. Its writes carry the revision the plan read: a schedule changed between the plan
and the write is reported as a conflict, never overwritten.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from hascheduler.client import calls
from hascheduler.client.calls import SERVER_FIELDS, Document
from hascheduler.client.clients import Client
from hascheduler.client.errors import Conflict, HaschedulerError
from hascheduler.core import models
from hascheduler.core.constants import MAX_BATCH, MAX_PAGE
from hascheduler.core.fields import DEFAULT_NAMESPACE

CREATE, UPDATE, UNCHANGED, DELETE = "create", "update", "unchanged", "delete"
# Creation requests stay under the API's body limit (MAX_REQUEST_BYTES, 128 KiB).
BATCH_BYTES = 96 * 1024
# Up to this many declarations not under the selector are read one request each; more,
# and reading every schedule in pages is fewer round trips.
READ_ONE_BY_ONE = 50
RACED = "changed since the plan read it"


class Refused(ValueError):
    """Declarations that cannot be applied: every problem, each naming its document."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Declared:
    """One declaration, where it came from (for messages) and its fields as the API
    will store them."""

    schedule_id: str
    origin: str
    body: dict[str, Any]  # the PUT body (no id)
    fields: dict[str, Any]  # normalised, to compare


@dataclass(frozen=True)
class Step:
    action: str
    schedule_id: str
    origin: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    revision: int | None = None  # the revision the plan read
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # field: (now, then)


def _normalised(fields: models.ScheduleFields | Mapping[str, Any]) -> dict[str, Any]:
    """The client fields, as the API writes them in JSON (a model, or the API's JSON of
    one: the same text either way)."""
    dumped = fields.model_dump(mode="json") if isinstance(fields, models.ScheduleFields) else fields
    return {
        k: v
        for k, v in dumped.items()
        if k in models.ScheduleFields.model_fields and k not in SERVER_FIELDS
    }


def declare(
    documents: Iterable[tuple[str, Any]],
    now: dt.datetime,
    selector: tuple[str, str] | None = None,
    namespace: str | None = None,
) -> list[Declared]:
    """Check every document (origin, parsed value) before anything is written. Raises
    Refused naming each invalid document and field, each duplicated id, (with a selector)
    each declaration without its label, and (with a ``namespace``) each declared in
    another namespace; one that names none is declared in ``namespace``."""
    problems: list[str] = []
    declared: dict[str, Declared] = {}
    for origin, document in documents:
        if not isinstance(document, dict):
            problems.append(f"{origin}: a schedule is a mapping, not {type(document).__name__}")
            continue
        schedule_id = document.get("id")
        if not isinstance(schedule_id, str) or not schedule_id:
            problems.append(f"{origin}: id: required (apply makes schedules by id)")
            continue
        if namespace is not None:
            named = document.setdefault("namespace", namespace)
            if named != namespace:
                problems.append(
                    f"{origin} ({schedule_id}): namespace: {named!r} is outside --namespace "
                    f"{namespace!r}"
                )
                continue
        try:
            checked = models.ScheduleIn.model_validate(document, context={"now": now})
        except ValidationError as exc:
            for error in exc.errors():
                where = ".".join(str(p) for p in error["loc"]) or "(document)"
                problems.append(f"{origin} ({schedule_id}): {where}: {error['msg']}")
            continue
        if schedule_id in declared:
            problems.append(
                f"{origin}: id {schedule_id!r} is declared twice (also in "
                f"{declared[schedule_id].origin})"
            )
            continue
        if selector is not None and checked.labels.get(selector[0]) != selector[1]:
            problems.append(
                f"{origin} ({schedule_id}): labels: lacks {selector[0]}="
                f"{selector[1]}, which --selector prunes by"
            )
            continue
        body = {k: v for k, v in document.items() if k != "id"}
        declared[schedule_id] = Declared(schedule_id, origin, body, _normalised(checked))
    if problems:
        raise Refused(problems)
    return list(declared.values())


def _anchored(
    fields: dict[str, Any], body: dict[str, Any], then: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An interval declared without ``start_at`` is anchored where the server anchored it
    when it was made: keeping that anchor is no change, and a rewrite must not move the
    grid to the moment of the write."""
    trigger, current = fields.get("trigger") or {}, then.get("trigger") or {}
    if (
        trigger.get("kind") == "interval"
        and trigger.get("start_at") is None
        and current.get("kind") == "interval"
        and current.get("start_at") is not None
    ):
        anchor = current["start_at"]
        fields = {**fields, "trigger": {**trigger, "start_at": anchor}}
        body = {**body, "trigger": {**body["trigger"], "start_at": anchor}}
    return fields, body


def plan(
    declared: list[Declared], current: Mapping[str, Document], prune: Iterable[Document] = ()
) -> list[Step]:
    """What to do, in the declarations' order, then the deletions (pure)."""
    steps: list[Step] = []
    names = {d.schedule_id for d in declared}
    for d in declared:
        existing = current.get(d.schedule_id)
        if existing is None:
            steps.append(Step(CREATE, d.schedule_id, d.origin, d.body))
            continue
        then = _normalised(existing)
        fields, body = _anchored(d.fields, d.body, then)
        changes = {k: (then.get(k), v) for k, v in fields.items() if then.get(k) != v}
        steps.append(
            Step(
                UPDATE if changes else UNCHANGED,
                d.schedule_id,
                d.origin,
                body,
                existing["revision"],
                changes,
            )
        )
    steps += [Step(DELETE, s["id"], revision=s["revision"]) for s in prune if s["id"] not in names]
    return steps


def read_cluster(api: Client, selector: tuple[str, str] | None) -> list[Document]:
    """Every schedule carrying the selector's label (without one: every schedule), a page
    of 500 at a time."""
    return list(_all(api, dict([selector]) if selector else None))


def prune_scope(declared: list[Declared], namespace: str | None) -> frozenset[str]:
    """The namespaces a prune may delete in: ``namespace`` when one is named, else those
    the declarations name; never merely every namespace a token reaches."""
    if namespace is not None:
        return frozenset({namespace})
    return frozenset(str(d.fields.get("namespace") or DEFAULT_NAMESPACE) for d in declared)


def read_plan(
    api: Client,
    declared: list[Declared],
    selector: tuple[str, str] | None,
    read: list[Document] | None = None,
    scope: frozenset[str] = frozenset(),
) -> list[Step]:
    """The plan against the cluster as it is now (with a selector: what to prune too,
    in the namespaces of ``scope``). Many declarations read every schedule; a few are
    read one by one. ``read``: what ``read_cluster`` with the same selector answered, when
    the caller read it already."""
    if read is None and (selector is not None or len(declared) > READ_ONE_BY_ONE):
        read = read_cluster(api, selector)
    current = {s["id"]: s for s in read or ()}
    labelled = (
        [s for s in current.values() if s.get("namespace", DEFAULT_NAMESPACE) in scope]
        if selector
        else []
    )
    every_one_read = read is not None and selector is None
    unknown = (
        [] if every_one_read else [d.schedule_id for d in declared if d.schedule_id not in current]
    )
    if len(unknown) > READ_ONE_BY_ONE:
        wanted = set(unknown)
        current |= {s["id"]: s for s in _all(api, None) if s["id"] in wanted}
    else:
        for schedule_id in unknown:
            try:
                current[schedule_id] = api.get_schedule(schedule_id).model_dump(mode="json")
            except HaschedulerError as exc:
                if exc.status != 404:
                    raise
    return plan(declared, current, labelled)


def _all(api: Client, labels: dict[str, str] | None) -> Iterator[Document]:
    return api.pages(lambda after: calls.schedule_documents_page(labels, after, MAX_PAGE))


@dataclass
class Outcome:
    done: list[Step] = field(default_factory=list)
    failed: list[tuple[Step, str]] = field(default_factory=list)


def batches(
    steps: list[Step], count: int = MAX_BATCH, size: int = BATCH_BYTES
) -> Iterator[list[Step]]:
    """Creations in requests of at most ``count`` schedules and ``size`` bytes of JSON
    (the API refuses larger bodies)."""
    batch: list[Step] = []
    used = 0
    for step in steps:
        weight = len(json.dumps(step.body)) + len(step.schedule_id) + 16
        if batch and (len(batch) == count or used + weight > size):
            yield batch
            batch, used = [], 0
        batch.append(step)
        used += weight
    if batch:
        yield batch


def execute(api: Client, steps: list[Step]) -> Outcome:
    """Every write of the plan; one that fails (a conflict, a refusal) is reported and
    the others still go. Creations go in batches, one request each."""
    outcome = Outcome()
    for batch in batches([s for s in steps if s.action == CREATE]):
        try:
            answer = api.create_schedules([{"id": s.schedule_id, **s.body} for s in batch])
        except HaschedulerError as exc:
            outcome.failed += [(s, str(exc)) for s in batch]
            continue
        existing = set(answer.existing)
        for step in batch:
            if step.schedule_id in existing:
                outcome.failed.append((step, f"{RACED}: created meanwhile by another"))
            else:
                outcome.done.append(step)
    for step in steps:
        try:
            if step.action == UPDATE:
                api.replace_schedule(step.schedule_id, step.body, if_match=step.revision)
            elif step.action == DELETE:
                api.delete_schedule(step.schedule_id, if_match=step.revision)
            else:
                continue
        except Conflict as exc:
            outcome.failed.append((step, f"{RACED}: {exc}"))
            continue
        except HaschedulerError as exc:
            outcome.failed.append((step, str(exc)))
            continue
        outcome.done.append(step)
    return outcome


def converge(
    api: Client,
    declared: list[Declared],
    selector: tuple[str, str] | None,
    scope: frozenset[str],
    rounds: int = 5,
) -> Outcome:
    """Plan and write until the cluster matches: the way for many processes applying the
    same declarations at once (workers of one app starting together). A write that lost a
    race (an id another created, a revision another wrote) is planned again from what
    the winner left; anything else is the outcome's failure."""
    outcome = Outcome()
    for _ in range(rounds):
        outcome = execute(api, read_plan(api, declared, selector, scope=scope))
        if not any(reason.startswith(RACED) for _, reason in outcome.failed):
            return outcome
    return outcome


def describe(steps: list[Step]) -> str:
    """The plan as a diff per schedule."""
    lines = []
    for step in steps:
        where = f"  ({step.origin})" if step.origin else ""
        if step.action == CREATE:
            lines.append(f"+ create {step.schedule_id}{where}")
        elif step.action == DELETE:
            lines.append(f"- delete {step.schedule_id}")
        elif step.action == UNCHANGED:
            lines.append(f"= unchanged {step.schedule_id}")
        else:
            lines.append(f"~ update {step.schedule_id}{where}")
            for name, (then, now) in sorted(step.changes.items()):
                lines.append(f"    {name}: {_shown(then)} -> {_shown(now)}")
    counts = {
        a: sum(1 for s in steps if s.action == a) for a in (CREATE, UPDATE, UNCHANGED, DELETE)
    }
    lines.append(
        ", ".join(f"{n} to {a}" if a != UNCHANGED else f"{n} unchanged" for a, n in counts.items())
    )
    return "\n".join(lines)


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def exported(schedule: models.Schedule) -> dict[str, Any]:
    """A stored schedule as a declaration: applying it back changes nothing."""
    return {"id": schedule.id, **_normalised(schedule)}
