"""A route of the API: its method, path, handler, guard and OpenAPI operation. Each
resource's module declares its own (``ROUTES``); routes.py joins them into the one table
the server registers and /openapi.json is generated from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hascheduler.api.errors import Handler
from hascheduler.api.guards import Guard


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    guard: Guard  # who may call it (api/access.py)
    operation: dict[str, Any]  # its OpenAPI operation object


OPEN = Guard(None)
