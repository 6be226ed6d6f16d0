"""The worker runtime: runs each fire to an outcome recorded in the runs ledger.

The public names: ``WorkerApp`` (handlers per target pattern), ``Run`` (what a handler is
given), ``RetryPolicy``, ``PermanentFailure``.
"""

from hascheduler.worker.app import Run, WorkerApp, WorkerConfigError
from hascheduler.worker.delivery import StaleFilter
from hascheduler.worker.policy import PermanentFailure, RetryPolicy, RunTimeout
from hascheduler.worker.runtime import WorkerSettings, run_worker

__all__ = ["PermanentFailure", "RetryPolicy", "Run", "RunTimeout", "StaleFilter",
           "WorkerApp", "WorkerConfigError", "WorkerSettings", "run_worker"]
