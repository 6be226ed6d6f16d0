"""Names and limits shared across the package, each with the reason for its value."""

from __future__ import annotations

import re

# MongoDB collections.
SCHEDULES = "schedules"
LEASES = "leases"
FIRES = "fires"
RUNS = "runs"
SLOTS = "slots"  # concurrency slots (storage/flow.py)
RATES = "rates"  # start budgets (storage/flow.py)
FIRE_COUNTS = "fire_counts"
BACKFILLS = "backfills"
AUDIT = "audit"  # the audit trail (storage/audit_log.py)
MEMBERS = "members"
WEBHOOKS = "webhooks"  # their configuration (storage/webhooks.py)
DELIVERIES = "webhook_deliveries"  # each event to each webhook, with its attempts
LEASE_HISTORY_MARKS = "lease_history_marks"  # storage/lease_history.py
# Every collection hascheduler writes: none of them may be read as a fan-out source (its
# tenants' keys would show one team another's data: a webhook's secret, an audit record).
OWN_COLLECTIONS = frozenset(
    {
        SCHEDULES,
        LEASES,
        FIRES,
        RUNS,
        SLOTS,
        RATES,
        FIRE_COUNTS,
        BACKFILLS,
        AUDIT,
        MEMBERS,
        WEBHOOKS,
        DELIVERIES,
        LEASE_HISTORY_MARKS,
    }
)
LEASE_NAME = "scheduler"  # one lease document: one leader for the whole cluster
DEFAULT_DATABASE = "hascheduler"  # used when the URI names no database

# A schedule's payload travels in every broker message; 64 KiB keeps a burst of 10k fires
# well under a broker's per-batch limits and the mirror free of payloads.
MAX_PAYLOAD_BYTES = 64 * 1024
# Longer periods are almost certainly a unit mistake, and keep date arithmetic in range.
MAX_INTERVAL_S = 10 * 365 * 86_400.0
# The default floor between two fires of one schedule (serve --min-fire-interval): a
# schedule firing faster is nearly always a mistake, and each fire costs a claim, a publish
# and a ledger document.
DEFAULT_MIN_FIRE_INTERVAL_S = 1.0
# Jitter beyond a day would reorder fires of a daily schedule.
MAX_JITTER_S = 86_400.0
# The HTTP body limit: a payload at its limit plus the schedule's other fields.
MAX_REQUEST_BYTES = MAX_PAYLOAD_BYTES + 64 * 1024
# MongoDB's error code for a unique index refusing a write.
DUPLICATE_KEY = 11000
# How many schedules one page of GET /schedules returns at most.
MAX_PAGE = 500
# Schedules one POST /schedules:batch may create (the request's size bounds it too).
MAX_BATCH = 500
DEFAULT_PAGE = 100
# GET /schedules/{id}/next?count=N: enough for a calendar view, bounded for the server.
MAX_PREVIEW = 1000

# A schedule's target: a NATS subject suffix (or AMQP routing key) of dot-separated tokens.
# The API refuses any other, and the broker checks again before framing a message with it
# (a document written around the API must not break the wire protocol).
TARGET_PATTERN = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
MAX_TARGET_CHARS = 200

# Mirror: how long to wait before reopening a failed change stream (doubles up to max).
STREAM_RETRY_INITIAL_S = 0.1
STREAM_RETRY_MAX_S = 5.0
# The awaitData wait of the mirror's change stream: short enough that shutdown is prompt.
STREAM_MAX_AWAIT_MS = 500

# The runs ledger keeps a run this long after its last change (dead ones too: forensic
# evidence for a week, as Dramatiq keeps its dead letters).
DEFAULT_RUN_RETENTION_S = 7 * 86_400.0
# The most tenants one fan-out may select (serve --max-fan-out): each costs a claim, a
# message and a run at every fire; 10,000 is the burst the leader is measured at.
DEFAULT_MAX_FAN_OUT = 10_000
# The most fires one run key (a schedule, or a fan-out's tenant) may hold waiting under
# overlap policy buffer_all (serve --max-buffered); more are recorded skipped.
DEFAULT_MAX_BUFFERED = 100
# The most fires a schedule's max_fires may allow: the leader keeps the ids of the fires
# counted against it (each counted once, whatever the republishes) in one document.
MAX_FIRES = 10_000
# A schedule's expect.success_within, at most (the audit trail's default retention). Its
# last success is read from the runs ledger, which must keep runs at least that long.
MAX_SUCCESS_WITHIN_S = 400 * 86_400.0
# The most nominal times one backfill may fire (serve --max-backfill).
DEFAULT_MAX_BACKFILL = 100_000
# A fire run now (POST /schedules/{id}/trigger) may name an Idempotency-Key of this many
# characters at most.
MAX_IDEMPOTENCY_KEY_CHARS = 200
# A fan-out fire whose source mirror is loading (a new source, or one resyncing after lost
# history) waits for it this long past its due time, then is recorded skipped.
SOURCE_SYNC_WAIT_S = 60.0
# How often a replica counts the running and stuck runs for /metrics.
RUNS_WATCH_INTERVAL_S = 5.0
# How often each replica judges the health of the schedules that declare an objective (for
# /metrics): a scrape interval's figure, three indexed reads per such schedule.
HEALTH_WATCH_INTERVAL_S = 10.0

# Heartbeats for GET /cluster: written this often, forgotten (TTL index) after this long.
HEARTBEAT_INTERVAL_S = 2.0
# How often a replica or worker asks the database its time (core/clock.py); the leader's
# renewals are samples too.
CLOCK_SAMPLE_S = 1.0
HEARTBEAT_TTL_S = 30.0
