"""What a leader claims (pure): the claim as a typed record, and the expansion of a batch of
due fires into claims, one per fire or, for a fan-out, one per tenant it selects now
(invariant 10, docs/ARCHITECTURE.md).

Expansion decides nothing from the clock or the database: it takes the batch, the mirror's
entries and the tenants each fan-out selects, and says which claims to make, which fires
wait for their source's mirror, and which are refused with the reason the ledger records.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hascheduler.core.entries import Entry
from hascheduler.core.fanout import FanOut, tenant_fire_id
from hascheduler.core.fire_queue import Due, is_fire_time
from hascheduler.core.triggers import fire_id

# Why a claim is recorded skipped when its schedule was paused before its due time: a
# backfill's claim skipped so is freed and fired after the resume (core/backfill.py).
PAUSED_BEFORE_DUE = "schedule paused before its due time"


@dataclass(slots=True)
class Claim:
    """One fire a leader claimed (or is about to), from its claim to its publish."""

    fire_id: str  # the ledger's key and the broker's deduplication key
    schedule_id: str
    nominal_at: dt.datetime
    due_at: dt.datetime  # the nominal time plus the schedule's jitter
    tenant: str | None = None  # a fan-out's tenant key
    attempts: int = 0  # publishes tried so far
    # A fire run now (POST /schedules/{id}/trigger) may carry its own payload and overlap
    # policy, for this fire only.
    payload: Mapping[str, Any] | None = None
    overlap: str | None = None
    manual: bool = False  # run now: not one of its trigger's fires (nor of its max_fires)
    traceparent: str | None = None  # a fire run now: the trace of the request that asked
    priority: int | None = None  # a fire run now: its own priority, instead of the schedule's

    @classmethod
    def of(cls, due: Due, tenant: str | None = None) -> Claim:
        key = (
            fire_id(due.schedule_id, due.nominal)
            if tenant is None
            else tenant_fire_id(due.schedule_id, due.nominal, tenant)
        )
        return cls(key, due.schedule_id, due.nominal, due.fire_at, tenant)


# The tenants a fan-out selects now; None while its source's mirror is not in sync.
Tenants = Callable[[FanOut], list[str] | None]


@dataclass
class Expansion:
    claims: list[Claim] = field(default_factory=list)
    # Fan-out fires whose source mirror is loading: claimed once it is in sync.
    waiting: list[tuple[Due, FanOut]] = field(default_factory=list)
    # Fires that cannot be expanded, with the reason recorded for them as skipped.
    refused: list[tuple[Due, str]] = field(default_factory=list)


def expand(
    batch: Sequence[Due],
    entries: Mapping[str, Entry],
    tenants: Tenants | None,
    max_fan_out: int,
    may_wait: bool,
    sync_wait_s: float,
) -> Expansion:
    """The claims for ``batch``. A fan-out whose tenants are unknown waits for its source
    if ``may_wait``, and is refused otherwise; one selecting more tenants than
    ``max_fan_out`` is refused whole (firing a subset would pick arbitrarily which tenants
    miss out)."""
    out = Expansion()
    for due in batch:
        entry = entries.get(due.schedule_id)
        if entry is None or entry.fan_out is None:
            out.claims.append(Claim.of(due))
            continue
        selected = tenants(entry.fan_out) if tenants is not None else None
        if selected is None and may_wait:
            out.waiting.append((due, entry.fan_out))
        elif selected is None:
            out.refused.append(
                (due, f"fan-out source not in sync within {sync_wait_s:g} s of the due time")
            )
        elif len(selected) > max_fan_out:
            out.refused.append(
                (
                    due,
                    f"fan-out selects {len(selected)} tenants at the claim, "
                    f"above the bound of {max_fan_out} "
                    "(serve --max-fan-out)",
                )
            )
        else:
            out.claims.extend(Claim.of(due, tenant) for tenant in selected)
    return out


def withdrawn(claim: Claim, entry: Entry | None, revision: int) -> str | None:
    """Why ``claim``, made when its schedule was at ``revision``, is no longer one of its
    fires as ``entry`` stands (its tenant's selection aside), or None (pure)."""
    if entry is None:
        return "schedule deleted before its due time"
    if entry.completed:
        return "schedule completed (its max_fires fires are used)"
    if entry.paused_at(claim.nominal_at):
        return PAUSED_BEFORE_DUE
    if entry.revision != revision and not is_fire_time(entry, claim.nominal_at):
        return "schedule changed before its due time; no longer a fire time"
    if claim.tenant is not None and entry.fan_out is None:
        return "schedule changed before its due time; it no longer fans out"
    return None


def none_withdrawn(
    claims: list[Claim], entries: Mapping[str, Entry], revisions: Mapping[str, int]
) -> bool:
    """Whether every one of ``claims``, none a tenant's, is still a fire of its schedule
    as ``entries`` stand (pure): what ``FiringPath.still_due`` would keep them all for."""
    return all(
        c.tenant is None
        and withdrawn(c, entries.get(c.schedule_id), revisions[c.schedule_id]) is None
        for c in claims
    )
