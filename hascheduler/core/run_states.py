"""A run's states (storage/runs.py says what moves a run between them): named here, apart
from the runs ledger, for what only names them (the command line's choices, the API's
filters)."""

PENDING = "pending"
RUNNING = "running"
SUCCEEDED = "succeeded"
RETRYING = "retrying"
DEAD = "dead"
CANCELLED = "cancelled"
WAITING = "waiting"
PARKED = "parked"  # a claim's answer: the run now waits for a slot of its key
STATES = (PENDING, RUNNING, SUCCEEDED, RETRYING, DEAD, CANCELLED, WAITING)
ENDED = (SUCCEEDED, DEAD, CANCELLED)
