"""Who may call a route: each route's guard, in the route table (routes.py), which the
access middleware applies."""

from __future__ import annotations

from dataclasses import dataclass

from hascheduler.api.access import Action

# Where a route's namespace comes from (Guard.scope).
SCHEDULE = "schedule"  # the path's id is a schedule's
FIRE = "fire"  # the path's id is a fire's (or its run's): <schedule id>@...
BACKFILL = "backfill"  # the path's id is a backfill's
WEBHOOK = "webhook"  # the path's id is a webhook's
BODY = "body"  # the body names it: the handler checks each (require)
LISTING = "listing"  # a list: the handler reads only namespaces the grant reaches
CLUSTER_WIDE = "cluster"  # the cluster's own state: no namespace


@dataclass(frozen=True)
class Guard:
    """Who may call a route: the action it needs (None: anyone, no token) and where the
    namespace the action applies to comes from."""

    action: Action | None
    scope: str = CLUSTER_WIDE
