"""The worker runtime: runs each fire to an outcome recorded in the runs ledger.

The public names: ``WorkerApp`` (handlers per target pattern), ``Run`` (what a handler is
given), ``RetryPolicy``, ``PermanentFailure``.
"""

from .app import Run, WorkerApp, WorkerConfigError
from .delivery import StaleFilter
from .policy import PermanentFailure, RetryPolicy, RunTimeout
from .runtime import WorkerSettings, run_worker

__all__ = ["PermanentFailure", "RetryPolicy", "Run", "RunTimeout", "StaleFilter",
           "WorkerApp", "WorkerConfigError", "WorkerSettings", "run_worker"]
