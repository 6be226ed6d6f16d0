"""The worker runtime: runs each fire to an outcome recorded in the runs ledger.

The public names: ``WorkerApp`` (handlers per target pattern), ``Run`` (what a handler is
given), ``RetryPolicy``, ``PermanentFailure``. They are loaded when first asked for: a
command that only reads an app's declarations (``apply --app``) need not load the
runtime and its broker clients.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hascheduler.worker.app import Run, WorkerApp, WorkerConfigError
    from hascheduler.worker.delivery import StaleFilter
    from hascheduler.worker.policy import PermanentFailure, RetryPolicy, RunTimeout
    from hascheduler.worker.service import run_worker
    from hascheduler.worker.settings import WorkerSettings

# Each public name and the module that defines it.
_HOMES = {
    "Run": "app",
    "WorkerApp": "app",
    "WorkerConfigError": "app",
    "StaleFilter": "delivery",
    "PermanentFailure": "policy",
    "RetryPolicy": "policy",
    "RunTimeout": "policy",
    "WorkerSettings": "settings",
    "run_worker": "service",
}

__all__ = [
    "PermanentFailure",
    "RetryPolicy",
    "Run",
    "RunTimeout",
    "StaleFilter",
    "WorkerApp",
    "WorkerConfigError",
    "WorkerSettings",
    "run_worker",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
