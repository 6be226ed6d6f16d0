"""A single-node replica-set primary: command execution, without sockets.

The server (server.py) parses frames and hands each command here; every reply gets
``$clusterTime`` and ``operationTime``; errors take mongod's shape.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from bson import Int64, ObjectId, Timestamp

from hascheduler_dev.devmongo import engine, options
from hascheduler_dev.devmongo.changes import (
    TOKEN_FLAG_INVALIDATE,
    ChangeLog,
    ClusterClock,
    decode_token,
)
from hascheduler_dev.devmongo.cursors import (
    DEFAULT_FIRST_BATCH,
    ChangeStreamCursor,
    Cursor,
    ResultCursor,
)
from hascheduler_dev.devmongo.errors import (
    STATE_CHANGE_CODES,
    DuplicateKey,
    MongoError,
    bad_value,
    type_mismatch,
)
from hascheduler_dev.devmongo.failpoints import Action, FailPoints
from hascheduler_dev.devmongo.settings import Settings
from hascheduler_dev.devmongo.storage import Catalog, Collection, validate_namespace
from hascheduler_dev.devmongo.values import MISSING, Document, get_path, key_of

# Expired documents deleted between two turns of the loop (reap_expired_documents).
TTL_CHUNK = 200
# How long one write command runs before it yields the loop (_each_statement).
TURN_S = 0.005

log = structlog.get_logger("hascheduler.devmongo")

MAX_WIRE_VERSION = 21  # MongoDB 7.0
SERVER_VERSION = "7.0.0"
SESSION_TIMEOUT_MINUTES = 30
RETRYABLE_COMMANDS = frozenset({"insert", "update", "delete", "findAndModify"})
# What a stepped-down node still answers: the handshake, monitoring and administration.
ANSWERED_WHEN_SECONDARY = frozenset(
    {
        "hello",
        "isMaster",
        "ismaster",
        "ping",
        "buildInfo",
        "buildinfo",
        "serverStatus",
        "endSessions",
        "refreshSessions",
        "killAllSessions",
        "killSessions",
        "killCursors",
        "replSetGetStatus",
        "replSetStepDown",
        "configureFailPoint",
        "connectionStatus",
        "whatsmyuri",
        "getParameter",
        "waitForFailPoint",
    }
)
READ_COMMANDS = frozenset(
    {
        "find",
        "getMore",
        "aggregate",
        "count",
        "distinct",
        "listIndexes",
        "listCollections",
        "listDatabases",
    }
)
# Commands that wait (for events, for a topology change) rather than work: their time is
# not the server's time held.
WAITING_COMMANDS = frozenset(
    {"getMore", "hello", "isMaster", "ismaster", "replSetStepDown", "waitForFailPoint"}
)
MAX_STEP_DOWN_S = 3600.0
MAX_REMEMBERED_SESSIONS = 100_000


@dataclass
class ConnectionContext:
    id: int
    peer: str
    app_name: str | None = None
    generation: int = 0  # the node's connection generation when it connected


class CloseConnection(Exception):
    """The fail point asks to drop the connection without replying."""


class Node:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.clock = ClusterClock()
        self.changes = ChangeLog(self.clock, settings.oplog_size)
        self.catalog = Catalog(self.changes)
        self.failpoints = FailPoints()
        self.cursors: dict[int, Cursor] = {}
        self._cursor_ids = itertools.count(int(time.time() * 1000) % 10**9 + 1)
        self._sessions: OrderedDict[bytes, tuple[int, Document]] = OrderedDict()
        self.process_id = ObjectId()
        self.started = time.monotonic()
        self.connections_current = 0
        self.connections_total = 0
        self.shutting_down = asyncio.Event()
        # Elections (replSetStepDown): the term names each primary's reign (electionId),
        # the topology version counts changes of state, connections older than the
        # generation are closed at their next command.
        self.term = 1
        self.topology_counter = 0
        self.connection_generation = 0
        self.secondary = False
        self._topology_changed = asyncio.Event()
        self._handlers: dict[
            str, Callable[[str, Document, ConnectionContext], Awaitable[Document]]
        ] = {
            "hello": self._hello,
            "isMaster": self._hello,
            "ismaster": self._hello,
            "ping": self._ping,
            "buildInfo": self._build_info,
            "buildinfo": self._build_info,
            "serverStatus": self._server_status,
            "endSessions": self._ping,
            "refreshSessions": self._ping,
            "killAllSessions": self._ping,
            "killSessions": self._ping,
            "insert": self._insert,
            "find": self._find,
            "getMore": self._get_more,
            "killCursors": self._kill_cursors,
            "update": self._update,
            "delete": self._delete,
            "findAndModify": self._find_and_modify,
            "findandmodify": self._find_and_modify,
            "aggregate": self._aggregate,
            "count": self._count,
            "distinct": self._distinct,
            "createIndexes": self._create_indexes,
            "listIndexes": self._list_indexes,
            "dropIndexes": self._drop_indexes,
            "deleteIndexes": self._drop_indexes,
            "create": self._create,
            "drop": self._drop,
            "listCollections": self._list_collections,
            "listDatabases": self._list_databases,
            "dropDatabase": self._drop_database,
            "configureFailPoint": self._configure_fail_point,
            "waitForFailPoint": self._wait_for_fail_point,
            "replSetGetStatus": self._repl_set_get_status,
            "connectionStatus": self._connection_status,
            "whatsmyuri": self._whatsmyuri,
            "getParameter": self._get_parameter,
            "commitTransaction": self._transactions,
            "abortTransaction": self._transactions,
            "replSetStepDown": self._repl_set_step_down,
        }

    @property
    def me(self) -> str:
        return f"{self.settings.host}:{self.settings.port}"

    # -- dispatch -------------------------------------------------------------------------

    async def execute(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        """Run one command and return the full reply. Raises CloseConnection."""
        name = next(iter(body), "")
        if ctx.generation < self.connection_generation:
            raise CloseConnection  # opened before a step-down: dropped, as the issue asks
        try:
            reply = await self._dispatch(name, db, body, ctx)
        except CloseConnection:
            raise
        except MongoError as exc:
            reply = exc.to_reply()
            if exc.code in STATE_CHANGE_CODES:
                reply["topologyVersion"] = self.topology_version
        except Exception as exc:  # a bug must never cost the client its connection
            log.exception("command_failed", command=name)
            reply = MongoError(1, f"internal error in the development server: {exc!r}").to_reply()
        reply["$clusterTime"] = {
            "clusterTime": self.clock.current,
            "signature": {"hash": b"\0" * 20, "keyId": Int64(0)},
        }
        reply["operationTime"] = self.clock.current
        return reply

    async def _dispatch(
        self, name: str, db: str, body: Document, ctx: ConnectionContext
    ) -> Document:
        received = time.monotonic()
        handler = self._handlers.get(name)
        if handler is None:
            raise MongoError(59, f"no such command: '{name}'")
        options.check(name, body)
        if self.secondary and name not in ANSWERED_WHEN_SECONDARY:
            self._refuse_as_secondary(name, body)
        if "startTransaction" in body or "autocommit" in body:
            await self._transactions(db, body, ctx)
        namespace = f"{db}.{body[name]}" if isinstance(body.get(name), str) else None
        action = self.failpoints.check(name, ctx.app_name, namespace)
        if action is not None:
            await self._before(action)
        # As mongod: a write's maxTimeMS runs from when the server took the command, so one
        # held up on its way to being applied (a blockConnection fail point, a session
        # replay) past its limit is refused, never applied.
        limit = body.get("maxTimeMS")
        if (
            name in RETRYABLE_COMMANDS
            and isinstance(limit, int)
            and limit > 0
            and (time.monotonic() - received) * 1000 > limit
        ):
            raise MongoError(50, "operation exceeded time limit")
        retry_key = self._retry_key(name, body)
        if retry_key is not None:
            remembered = self._sessions.get(retry_key[0])
            if remembered is not None:
                txn, reply = remembered
                if retry_key[1] == txn:
                    self._sessions.move_to_end(retry_key[0])
                    return copy.deepcopy(reply)
                if retry_key[1] < txn:
                    raise MongoError(
                        225,
                        f"Retryable write with txnNumber {retry_key[1]} is "
                        f"prohibited on session because a newer retryable "
                        f"write with txnNumber {txn} has already started",
                    )
        started = time.monotonic()
        result = await handler(db, body, ctx)
        held_ms = (time.monotonic() - started) * 1000
        if held_ms >= self.settings.slow_ms and name not in WAITING_COMMANDS:
            log.warning(
                "slow_command",
                command=name,
                ns=namespace,
                ms=round(held_ms, 1),
                shape=_shape(name, body),
            )
        result.setdefault("ok", 1.0)
        if retry_key is not None:
            self._sessions[retry_key[0]] = (retry_key[1], copy.deepcopy(result))
            self._sessions.move_to_end(retry_key[0])
            while len(self._sessions) > MAX_REMEMBERED_SESSIONS:
                self._sessions.popitem(last=False)
        if action is not None:
            if action.rule.close_after_execution:
                raise CloseConnection
            if action.rule.write_concern_error is not None:
                result = {**result, "writeConcernError": action.rule.write_concern_error}
        return result

    async def _before(self, action: Action) -> None:
        rule = action.rule
        if rule.block_ms:
            await asyncio.sleep(rule.block_ms / 1000)
        if rule.close_connection:
            raise CloseConnection
        if rule.error_code is not None:
            extra: Document = {}
            if rule.error_labels:
                extra["errorLabels"] = rule.error_labels
            raise MongoError(
                rule.error_code, "Failing command via 'failCommand' failpoint", **extra
            )

    @staticmethod
    def _retry_key(name: str, body: Document) -> tuple[bytes, int] | None:
        lsid, txn = body.get("lsid"), body.get("txnNumber")
        if name not in RETRYABLE_COMMANDS and name != "findandmodify":
            return None
        if not isinstance(lsid, dict) or txn is None:
            return None
        session = bytes(lsid.get("id", b"")) + repr(lsid.get("uid")).encode()
        return session, int(txn)

    def operation(self) -> engine.Operation:
        now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
        now = now.replace(microsecond=now.microsecond // 1000 * 1000)  # BSON dates: ms
        return engine.Operation(now, self.clock.current)

    # -- handshake and server info ---------------------------------------------------------

    @property
    def topology_version(self) -> Document:
        return {"processId": self.process_id, "counter": Int64(self.topology_counter)}

    @property
    def election_id(self) -> ObjectId:
        return ObjectId(f"7fffffff{self.term:016x}")

    # -- elections ------------------------------------------------------------------------

    async def _repl_set_step_down(
        self, db: str, body: Document, ctx: ConnectionContext
    ) -> Document:
        """``{replSetStepDown: seconds}``: be a secondary for that long (a fraction of a
        second is allowed here), then win the next election. Meanwhile writes answer
        NotWritablePrimary, reads NotPrimaryNoSecondaryOk, every connection open now is
        closed at its next command, and awaitable hellos answer at once."""
        if db != "admin":
            raise MongoError(13, "replSetStepDown may only be run against the admin database.")
        seconds = body.get("replSetStepDown")
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not 0 < seconds <= MAX_STEP_DOWN_S
        ):
            raise bad_value(
                f"replSetStepDown takes seconds, more than 0 and at most {MAX_STEP_DOWN_S:g}"
            )
        if self.secondary:
            raise MongoError(10107, "not primary so can't step down")
        self.secondary = True
        self.connection_generation += 1
        self._topology_change("stepped_down", seconds=float(seconds))
        asyncio.get_running_loop().call_later(float(seconds), self._step_up)
        return {}

    def _step_up(self) -> None:
        self.term += 1
        self.secondary = False
        self._topology_change("elected")

    def _topology_change(self, event: str, **fields: Any) -> None:
        self.topology_counter += 1
        self._topology_changed.set()
        self._topology_changed = asyncio.Event()
        log.info(event, term=self.term, topology_version=self.topology_counter, **fields)

    def _refuse_as_secondary(self, name: str, body: Document) -> None:
        if name in READ_COMMANDS:
            # 4.4+ servers label what a change stream may resume after.
            labels = ["ResumableChangeStreamError"] if name == "getMore" else []
            raise MongoError(13435, "not primary and secondaryOk=false", errorLabels=labels)
        labels = (
            ["RetryableWriteError"]
            if name in RETRYABLE_COMMANDS | {"findandmodify"} and "txnNumber" in body
            else []
        )
        raise MongoError(10107, "not primary", errorLabels=labels)

    async def _hello(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        client = body.get("client")
        if isinstance(client, dict):
            app = client.get("application")
            if isinstance(app, dict) and isinstance(app.get("name"), str):
                ctx.app_name = app["name"]
        if "topologyVersion" in body and "maxAwaitTimeMS" in body:
            # Awaitable hello: our topology never changes, so hold the reply for the full
            # wait (or until shutdown) rather than answering at once and making the client
            # poll in a loop.
            wait_ms = body["maxAwaitTimeMS"]
            if not isinstance(wait_ms, int) or wait_ms < 0:
                raise bad_value("maxAwaitTimeMS must be a non-negative integer")
            known = body["topologyVersion"]
            if isinstance(known, dict) and known.get("counter") == self.topology_counter:
                changed = asyncio.ensure_future(self._topology_changed.wait())
                stopping = asyncio.ensure_future(self.shutting_down.wait())
                try:
                    await asyncio.wait(
                        {changed, stopping},
                        timeout=wait_ms / 1000,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    changed.cancel()
                    stopping.cancel()
        if self.shutting_down.is_set():
            raise MongoError(91, "The server is in quiesce mode and will shut down")
        last = self.clock.current
        wall = datetime.datetime.fromtimestamp(last.time, datetime.UTC).replace(tzinfo=None)
        primary_field = "isWritablePrimary" if next(iter(body)) == "hello" else "ismaster"
        reply: Document = {
            primary_field: not self.secondary,
            "topologyVersion": self.topology_version,
            "hosts": [self.me],
            "setName": self.settings.replset,
            "setVersion": 1,
            "me": self.me,
            "secondary": self.secondary,
            "lastWrite": {
                "opTime": {"ts": last, "t": Int64(self.term)},
                "lastWriteDate": wall,
                "majorityOpTime": {"ts": last, "t": Int64(self.term)},
                "majorityWriteDate": wall,
            },
            "maxBsonObjectSize": 16 * 1024 * 1024,
            "maxMessageSizeBytes": 48_000_000,
            "maxWriteBatchSize": 100_000,
            "localTime": datetime.datetime.now(datetime.UTC).replace(tzinfo=None),
            "logicalSessionTimeoutMinutes": SESSION_TIMEOUT_MINUTES,
            "connectionId": ctx.id,
            "minWireVersion": 0,
            "maxWireVersion": MAX_WIRE_VERSION,
            "readOnly": False,
        }
        if not self.secondary:
            reply |= {"primary": self.me, "electionId": self.election_id}
        if body.get("helloOk"):
            reply["helloOk"] = True
        return reply

    async def _ping(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        return {}

    async def _build_info(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        return {
            "version": SERVER_VERSION,
            "gitVersion": "hascheduler-devmongo",
            "versionArray": [7, 0, 0, 0],
            "bits": 64,
            "debug": False,
            "maxBsonObjectSize": 16 * 1024 * 1024,
            "storageEngines": ["devmongo"],
            "modules": [],
        }

    async def _server_status(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        uptime = time.monotonic() - self.started
        return {
            "host": self.me,
            "version": SERVER_VERSION,
            "process": "devmongo",
            "pid": Int64(os.getpid()),
            "uptime": float(int(uptime)),
            "uptimeMillis": Int64(int(uptime * 1000)),
            "localTime": datetime.datetime.now(datetime.UTC).replace(tzinfo=None),
            "connections": {
                "current": self.connections_current,
                "available": 100_000,
                "totalCreated": self.connections_total,
            },
            "repl": {
                "setName": self.settings.replset,
                "isWritablePrimary": True,
                "primary": self.me,
                "me": self.me,
            },
            "devmongo": {
                "databases": len(self.catalog.databases),
                "changeLogEvents": self.changes.last_seq - self.changes.first_seq + 1,
                "openCursors": len(self.cursors),
            },
        }

    async def _repl_set_get_status(
        self, db: str, body: Document, ctx: ConnectionContext
    ) -> Document:
        state, name = (2, "SECONDARY") if self.secondary else (1, "PRIMARY")
        return {
            "set": self.settings.replset,
            "myState": state,
            "term": Int64(self.term),
            "date": datetime.datetime.now(datetime.UTC).replace(tzinfo=None),
            "members": [
                {
                    "_id": 0,
                    "name": self.me,
                    "health": 1.0,
                    "state": state,
                    "stateStr": name,
                    "self": True,
                }
            ],
        }

    async def _connection_status(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        return {"authInfo": {"authenticatedUsers": [], "authenticatedUserRoles": []}}

    async def _whatsmyuri(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        return {"you": ctx.peer}

    async def _get_parameter(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        return {"featureCompatibilityVersion": {"version": "7.0"}}

    async def _transactions(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        raise MongoError(
            20,
            "multi-document transactions are not supported by the "
            "hascheduler development server; use a MongoDB replica set",
        )

    async def _configure_fail_point(
        self, db: str, body: Document, ctx: ConnectionContext
    ) -> Document:
        if db != "admin":
            raise MongoError(13, "configureFailPoint may only be run against the admin database.")
        return self.failpoints.configure(body)

    async def _wait_for_fail_point(
        self, db: str, body: Document, ctx: ConnectionContext
    ) -> Document:
        """``{waitForFailPoint: "failCommand", timesEntered: n, maxTimeMS: ms}``: answer
        once the fail point has caught n commands, or fail with MaxTimeMSExpired."""
        if db != "admin":
            raise MongoError(13, "waitForFailPoint may only be run against the admin database.")
        if body.get("waitForFailPoint") != "failCommand":
            raise MongoError(
                2,
                f"unknown fail point: {body.get('waitForFailPoint')!r} (the "
                "development server implements failCommand)",
            )
        times, limit = body.get("timesEntered"), body.get("maxTimeMS")
        if isinstance(times, bool) or not isinstance(times, int) or times <= 0:
            raise bad_value("waitForFailPoint needs timesEntered, a positive integer")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise bad_value("waitForFailPoint needs maxTimeMS, a positive integer")
        try:
            await asyncio.wait_for(self.failpoints.wait_entered(times), limit / 1000)
        except TimeoutError:
            raise MongoError(50, "operation exceeded time limit") from None
        return {}

    # -- helpers --------------------------------------------------------------------------

    @staticmethod
    def _collection_name(body: Document, name: str) -> str:
        coll = body.get(name)
        if not isinstance(coll, str):
            raise MongoError(73, f"collection name has invalid type {type(coll).__name__}")
        return coll

    def _existing(self, db: str, name: str) -> Collection | None:
        validate_namespace(db, name)
        return self.catalog.get(db, name)

    def _open_cursor(
        self, cursor: ResultCursor, batch_size: int | None, single_batch: bool = False
    ) -> Document:
        first = cursor.next_batch(DEFAULT_FIRST_BATCH if batch_size is None else batch_size)
        cursor_id = 0
        if not cursor.exhausted and not single_batch:
            cursor_id = cursor.id
            self.cursors[cursor.id] = cursor
        return {"cursor": {"firstBatch": first, "id": Int64(cursor_id), "ns": cursor.ns}}

    def _new_result_cursor(self, ns: str, docs: list[Document]) -> ResultCursor:
        return ResultCursor(id=next(self._cursor_ids), ns=ns, docs=docs)

    @staticmethod
    def _batch_size(value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad_value("batchSize must be a non-negative integer")
        return value

    # -- reads ----------------------------------------------------------------------------

    async def _find(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, "find")
        filter_ = engine.check_filter(body.get("filter"))
        coll = self._existing(db, name)
        ns = f"{db}.{name}"
        limit = int(body.get("limit") or 0)
        single = bool(body.get("singleBatch")) or limit < 0
        limit = abs(limit)
        skip = int(body.get("skip") or 0)
        if skip < 0:
            raise bad_value("skip value must be non-negative")
        sort = body.get("sort") or {}
        docs = None
        if coll and limit and list(sort) == ["_id"] and sort["_id"] in (1, -1):
            docs = coll.first_by_id(self.operation(), filter_, skip + limit, sort["_id"] == -1)
        if docs is None and coll and sort and limit:
            docs = [
                doc for _, doc in coll.find_sorted(self.operation(), filter_, sort, skip + limit)
            ]
        if docs is None:
            docs = [doc for _, doc in coll.find(self.operation(), filter_)] if coll else []
            docs = engine.sort_documents(docs, sort)
        docs = docs[skip : skip + limit] if limit else docs[skip:]
        docs = engine.project(docs, body.get("projection"))
        batch_size = self._batch_size(body.get("batchSize"))
        if limit and (batch_size is None or batch_size > limit):
            batch_size = limit
        return self._open_cursor(self._new_result_cursor(ns, docs), batch_size, single)

    async def _get_more(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        cursor_id = body.get("getMore")
        if not isinstance(cursor_id, int):
            raise type_mismatch("getMore cursor id must be a long")
        cursor = self.cursors.get(int(cursor_id))
        if cursor is None:
            raise MongoError(43, f"cursor id {cursor_id} not found")
        cursor.touch()
        batch_size = self._batch_size(body.get("batchSize"))
        if isinstance(cursor, ChangeStreamCursor):
            wait_ms = body.get("maxTimeMS", 1000)
            batch = await self._wait_for_events(cursor, batch_size, float(wait_ms) / 1000)
            reply = {
                "cursor": {
                    "nextBatch": batch,
                    "id": Int64(0 if cursor.invalidated else cursor.id),
                    "ns": cursor.ns,
                    "postBatchResumeToken": cursor.post_batch_token(batch),
                }
            }
            if cursor.invalidated:
                self.cursors.pop(cursor.id, None)
            cursor.touch()
            return reply
        assert isinstance(cursor, ResultCursor)
        batch = cursor.next_batch(batch_size)
        if cursor.exhausted:
            self.cursors.pop(cursor.id, None)
        return {
            "cursor": {
                "nextBatch": batch,
                "id": Int64(0 if cursor.exhausted else cursor.id),
                "ns": cursor.ns,
            }
        }

    async def _wait_for_events(
        self, cursor: ChangeStreamCursor, batch_size: int | None, wait_s: float
    ) -> list[Document]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            batch = cursor.collect(batch_size)
            if batch or cursor.invalidated:
                return batch
            remaining = deadline - loop.time()
            if remaining <= 0 or self.shutting_down.is_set():
                return batch
            if not await self.changes.wait_after(cursor.position, remaining):
                return batch

    async def _kill_cursors(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        ids = body.get("cursors")
        if not isinstance(ids, list):
            raise bad_value("killCursors needs an array of cursor ids")
        killed: list[Any] = []
        missing: list[Any] = []
        for cursor_id in ids:
            (killed if self.cursors.pop(int(cursor_id), None) else missing).append(cursor_id)
        return {
            "cursorsKilled": killed,
            "cursorsNotFound": missing,
            "cursorsAlive": [],
            "cursorsUnknown": [],
        }

    async def _count(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, "count")
        filter_ = engine.check_filter(body.get("query"))
        coll = self._existing(db, name)
        n = len(coll.find(self.operation(), filter_)) if coll else 0
        n = max(n - int(body.get("skip") or 0), 0)
        limit = abs(int(body.get("limit") or 0))
        return {"n": min(n, limit) if limit else n}

    async def _distinct(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, "distinct")
        key = body.get("key")
        if not isinstance(key, str):
            raise bad_value("distinct key must be a string")
        filter_ = engine.check_filter(body.get("query"))
        coll = self._existing(db, name)
        seen: dict[Any, Any] = {}
        for _, doc in coll.find(self.operation(), filter_) if coll else []:
            value = get_path(doc, key)
            values = value if isinstance(value, list) else [value]
            for v in values:
                if v is not MISSING:
                    seen.setdefault(key_of(v), v)
        return {"values": list(seen.values())}

    async def _aggregate(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        target = body.get("aggregate")
        pipeline = body.get("pipeline")
        if not isinstance(pipeline, list) or not all(isinstance(s, dict) for s in pipeline):
            raise type_mismatch("'pipeline' option must be specified as an array")
        cursor_opts = body.get("cursor")
        if not isinstance(cursor_opts, dict) and not body.get("explain"):
            raise MongoError(
                9, "The 'cursor' option is required, except for aggregate with the explain argument"
            )
        batch_size = self._batch_size((cursor_opts or {}).get("batchSize"))
        if pipeline and "$changeStream" in pipeline[0]:
            return self._open_change_stream(db, target, pipeline, batch_size)
        for stage in pipeline:
            name = next(iter(stage))
            if name in {
                "$out",
                "$merge",
                "$lookup",
                "$graphLookup",
                "$unionWith",
                "$changeStream",
                "$currentOp",
                "$listSessions",
            }:
                raise MongoError(2, f"{name} is not supported by the development server")
        if not isinstance(target, str):
            raise MongoError(
                73,
                "aggregate: 1 needs a collection-less stage the development "
                "server does not support",
            )
        coll = self._existing(db, target)
        op = self.operation()
        if coll is None:
            docs: list[Document] = []
        elif pipeline and "$match" in pipeline[0]:
            matched = [d for _, d in coll.find(op, pipeline[0]["$match"])]
            pipeline = pipeline[1:]
            counted = _plain_count(pipeline, len(matched))
            if counted is not None:  # count_documents: no copies, no pipeline engine
                return self._open_cursor(
                    self._new_result_cursor(f"{db}.{target}", counted), batch_size
                )
            docs = [copy.deepcopy(d) for d in matched]
        else:
            docs = [copy.deepcopy(d) for d in coll.docs.values()]
        result = engine.run_pipeline(docs, op.prepare(pipeline))
        return self._open_cursor(self._new_result_cursor(f"{db}.{target}", result), batch_size)

    def _open_change_stream(
        self, db: str, target: Any, pipeline: list[Document], batch_size: int | None
    ) -> Document:
        spec = pipeline[0]["$changeStream"]
        if not isinstance(spec, dict):
            raise type_mismatch("$changeStream stage must be an object")
        for stage in pipeline[1:]:
            name = next(iter(stage))
            if name not in {
                "$match",
                "$project",
                "$addFields",
                "$set",
                "$unset",
                "$replaceRoot",
                "$replaceWith",
                "$redact",
            }:
                raise MongoError(
                    280 if name.startswith("$") else 2,
                    f"{name} is not permitted in a $changeStream pipeline",
                )
        cluster = bool(spec.get("allChangesForCluster"))
        if cluster and (db != "admin" or target != 1):
            raise MongoError(73, "allChangesForCluster needs aggregate: 1 on the admin database")
        if target == 1:
            scope_db: str | None = None if cluster else db
            coll: str | None = None
        elif isinstance(target, str):
            validate_namespace(db, target)
            scope_db, coll = db, target
        else:
            raise type_mismatch("aggregate target must be a collection name or 1")
        full_document = spec.get("fullDocument", "default")
        if full_document not in {"default", "updateLookup", "whenAvailable", "required"}:
            raise bad_value(f"unknown fullDocument mode {full_document!r}")
        before = spec.get("fullDocumentBeforeChange", "off")
        if before not in {"off", "whenAvailable", "required"}:
            raise bad_value(f"unknown fullDocumentBeforeChange mode {before!r}")
        if before == "required":
            raise MongoError(
                2,
                "the development server keeps no pre-images; "
                "fullDocumentBeforeChange 'required' cannot be served",
            )
        starts = [k for k in ("resumeAfter", "startAfter", "startAtOperationTime") if k in spec]
        if len(starts) > 1:
            raise MongoError(
                40674, "Only one type of resume option is allowed, but multiple were found"
            )
        if "resumeAfter" in spec or "startAfter" in spec:
            seq, flags = decode_token(spec.get("resumeAfter", spec.get("startAfter")))
            if flags & TOKEN_FLAG_INVALIDATE and "resumeAfter" in spec:
                raise MongoError(
                    260,
                    "Attempting to resume a change stream using "
                    "'resumeAfter' is not allowed from an invalidate "
                    "notification.",
                )
            self.changes.check_resumable_after(seq)
            position = seq
        elif "startAtOperationTime" in spec:
            ts = spec["startAtOperationTime"]
            if not isinstance(ts, Timestamp):
                raise type_mismatch("startAtOperationTime must be a timestamp")
            position = self.changes.seq_at_time(ts)
        else:
            # Reserve a cluster time no event holds: the reply's operationTime, which a
            # driver may resume from with startAtOperationTime, then excludes exactly
            # the events before the stream opened.
            self.clock.tick()
            position = self.changes.last_seq
        cursor = ChangeStreamCursor(
            id=next(self._cursor_ids),
            ns=f"{db}.{coll if coll else '$cmd.aggregate'}",
            changes=self.changes,
            db=scope_db,
            coll=coll,
            position=position,
            full_document=full_document,
            before_change=before,
            show_expanded=bool(spec.get("showExpandedEvents")),
            stages=pipeline[1:],
            lookup=self._lookup,
        )
        batch = cursor.collect(batch_size)
        cursor_id = 0 if cursor.invalidated else cursor.id
        if cursor_id:
            self.cursors[cursor.id] = cursor
        return {
            "cursor": {
                "firstBatch": batch,
                "id": Int64(cursor_id),
                "ns": cursor.ns,
                "postBatchResumeToken": cursor.post_batch_token(batch),
            }
        }

    def _lookup(self, db: str, coll: str, _id: Any) -> Document | None:
        collection = self.catalog.get(db, coll)
        return collection.get_by_id(_id) if collection else None

    # -- writes ---------------------------------------------------------------------------

    @staticmethod
    def _write_error(index: int, exc: MongoError) -> Document:
        err: Document = {"index": index, "code": exc.code, "errmsg": exc.message}
        if isinstance(exc, DuplicateKey):
            err["keyPattern"] = exc.extra["keyPattern"]
            err["keyValue"] = exc.extra["keyValue"]
        return err

    async def _each_statement(
        self, statements: list[Any], ordered: Any, apply: Callable[[Any, int], None]
    ) -> list[Document]:
        """Run each statement of a write command; an ordered one stops at the first error.
        The loop is yielded once a turn has run TURN_S, between statements, as mongod yields
        in a long write: a leader's 1,000-fire claim, or a bulk of several 1,000-fire
        updates, otherwise held its lease renewal, queued on another connection, for its
        whole length (past a one-second lease's renew deadline)."""
        errors: list[Document] = []
        turn = time.monotonic()
        for i, stmt in enumerate(statements):
            if time.monotonic() - turn >= TURN_S:
                await asyncio.sleep(0)
                turn = time.monotonic()
            try:
                apply(stmt, i)
            except MongoError as exc:
                errors.append(self._write_error(i, exc))
                if ordered:
                    break
        return errors

    @staticmethod
    def _with_errors(reply: Document, errors: list[Document]) -> Document:
        if errors:
            reply["writeErrors"] = errors
        return reply

    @staticmethod
    def _statements(body: Document, field: str) -> list[Any]:
        statements = body.get(field)
        if not isinstance(statements, list):
            raise type_mismatch(f"'{field}' must be an array")
        return statements

    async def _insert(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, "insert")
        docs = self._statements(body, "documents")
        coll = self.catalog.collection(db, name)
        n = 0

        def apply(doc: Any, _index: int) -> None:
            nonlocal n
            coll.insert(doc)
            n += 1

        errors = await self._each_statement(docs, body.get("ordered", True), apply)
        return self._with_errors({"n": n}, errors)

    async def _update(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, "update")
        statements = self._statements(body, "updates")
        coll = self.catalog.collection(db, name)
        n = modified = 0
        upserted: list[Document] = []

        def apply(stmt: Any, i: int) -> None:
            nonlocal n, modified
            if not isinstance(stmt, dict):
                raise type_mismatch("each update statement must be an object")
            matched, changed, new_id = self._update_one_statement(coll, stmt)
            n += matched
            modified += changed
            if new_id is not None:
                upserted.append({"index": i, "_id": new_id})

        errors = await self._each_statement(statements, body.get("ordered", True), apply)
        reply: Document = {"n": n + len(upserted), "nModified": modified}
        if upserted:
            reply["upserted"] = upserted
        return self._with_errors(reply, errors)

    def _update_one_statement(
        self, coll: Collection, stmt: Document
    ) -> tuple[int, int, Any | None]:
        q = engine.check_filter(stmt.get("q"))
        u = stmt.get("u")
        engine.validate_update(u)
        multi = bool(stmt.get("multi"))
        replacement = not isinstance(u, list) and not engine.is_operator_update(u)
        if multi and replacement:
            raise MongoError(9, "multi update is not supported for replacement-style update")
        op = self.operation()
        matches = coll.find(op, q)
        if not multi:
            matches = matches[:1]
        array_filters = stmt.get("arrayFilters")
        changed = 0
        prepared = op.prepare(q)  # once: the filter may hold a long $in list
        plan = engine.plain_update_plan(u) if array_filters is None else None
        for rid, doc in matches:
            new = engine.apply_update(op, doc, prepared, u, False, array_filters, plan)
            changed += coll.replace(
                rid,
                new,
                replacement,
                validated=plan is not None,
                touched=plan.touched if plan is not None else None,
            )
        if matches or not stmt.get("upsert"):
            return len(matches), changed, None
        return 0, 0, self._upsert(op, coll, q, u, replacement, array_filters)

    @staticmethod
    def _upsert(
        op: engine.Operation,
        coll: Collection,
        q: Document,
        u: Any,
        replacement: bool,
        array_filters: Any,
    ) -> Any:
        seed = engine.upsert_seed(q)
        if replacement:
            new = {k: v for k, v in u.items()}
            if "_id" in seed and "_id" not in new:
                new = {"_id": seed["_id"], **new}
        else:
            new = engine.apply_update(op, seed, op.prepare(q), u, True, array_filters)
        if "_id" not in new:
            new = {"_id": ObjectId(), **new}
        return coll.insert(new)

    async def _delete(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, "delete")
        statements = self._statements(body, "deletes")
        coll = self.catalog.get(db, name)
        n = 0

        def apply(stmt: Any, i: int) -> None:
            nonlocal n
            if not isinstance(stmt, dict):
                raise type_mismatch("each delete statement must be an object")
            q = engine.check_filter(stmt.get("q"))
            limit = stmt.get("limit", 0)
            if limit not in (0, 1):
                raise bad_value("delete limit must be 0 or 1")
            matches = coll.find(self.operation(), q) if coll else []
            for rid, _ in matches[:1] if limit == 1 else matches:
                coll.delete(rid)  # type: ignore[union-attr]
                n += 1

        errors = await self._each_statement(statements, body.get("ordered", True), apply)
        return self._with_errors({"n": n}, errors)

    async def _find_and_modify(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, next(iter(body)))
        q = engine.check_filter(body.get("query"))
        remove = bool(body.get("remove"))
        update = body.get("update")
        upsert = bool(body.get("upsert"))
        if remove and (update is not None or upsert or body.get("new")):
            raise MongoError(9, "Cannot specify both an update and remove=true")
        if not remove:
            if update is None:
                raise MongoError(9, "Either an update or remove=true must be specified")
            engine.validate_update(update)
        coll = self.catalog.collection(db, name)
        op = self.operation()
        sort = body.get("sort")
        matches = coll.find_sorted(op, q, sort, 1) if sort else coll.find(op, q)
        fields = body.get("fields")
        last_error: Document = {"n": 0}
        value: Document | None = None
        if matches:
            rid, doc = matches[0]
            if remove:
                coll.delete(rid)
                value = doc
            else:
                replacement = not isinstance(update, list) and not engine.is_operator_update(update)
                new = engine.apply_update(
                    op, doc, op.prepare(q), update, False, body.get("arrayFilters")
                )
                coll.replace(rid, new, replacement)
                value = new if body.get("new") else doc
                last_error["updatedExisting"] = True
            last_error["n"] = 1
        elif upsert:
            replacement = not isinstance(update, list) and not engine.is_operator_update(update)
            new_id = self._upsert(op, coll, q, update, replacement, body.get("arrayFilters"))
            last_error.update(n=1, updatedExisting=False, upserted=new_id)
            if body.get("new"):
                value = coll.get_by_id(new_id)
        elif not remove:
            last_error["updatedExisting"] = False
        if value is not None and fields:
            value = engine.project([value], fields)[0]
        return {"lastErrorObject": last_error, "value": value}

    # -- catalog --------------------------------------------------------------------------

    async def _create_indexes(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, "createIndexes")
        specs = self._statements(body, "indexes")
        existed = self.catalog.get(db, name) is not None
        coll = self.catalog.collection(db, name)
        before = len(coll.indexes)
        created = [coll.create_index(engine.require_document(s, "index spec")) for s in specs]
        self.catalog.ensure_registered(coll)
        reply: Document = {
            "numIndexesBefore": before,
            "numIndexesAfter": len(coll.indexes),
            "createdCollectionAutomatically": not existed,
        }
        if not any(created):
            reply["note"] = "all indexes already exist"
        return reply

    async def _list_indexes(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, "listIndexes")
        coll = self._existing(db, name)
        if coll is None:
            raise MongoError(26, f"ns does not exist: {db}.{name}")
        specs = [index.spec() for index in coll.indexes.values()]
        batch_size = self._batch_size((body.get("cursor") or {}).get("batchSize"))
        return self._open_cursor(self._new_result_cursor(f"{db}.{name}", specs), batch_size)

    async def _drop_indexes(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, next(iter(body)))
        coll = self._existing(db, name)
        if coll is None:
            raise MongoError(26, f"ns not found {db}.{name}")
        was = len(coll.indexes)
        target = body.get("index")
        if target == "*":
            for index_name in [n for n in coll.indexes if n != "_id_"]:
                coll.drop_index(index_name)
        elif isinstance(target, list):
            for index_name in target:
                coll.drop_index(index_name)
        else:
            coll.drop_index(target)
        return {"nIndexesWas": was}

    async def _create(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, "create")
        options = {
            k: v
            for k, v in body.items()
            if k
            not in {
                "create",
                "$db",
                "lsid",
                "$clusterTime",
                "writeConcern",
                "$readPreference",
                "apiVersion",
            }
        }
        self.catalog.create(db, name, options)
        return {}

    async def _drop(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        name = self._collection_name(body, "drop")
        coll = self._existing(db, name)
        was = len(coll.indexes) if coll else 0
        self.catalog.drop(db, name)
        return {"nIndexesWas": was, "ns": f"{db}.{name}"}

    async def _list_collections(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        filter_ = engine.check_filter(body.get("filter"))
        name_only = bool(body.get("nameOnly"))
        infos = []
        for name, coll in self.catalog.databases.get(db, {}).items():
            info: Document = {"name": name, "type": "collection"}
            if not name_only:
                info.update(
                    options=coll.options,
                    info={"readOnly": False},
                    idIndex={"v": 2, "key": {"_id": 1}, "name": "_id_"},
                )
            if engine.matches(filter_, info):
                infos.append(info)
        batch_size = self._batch_size((body.get("cursor") or {}).get("batchSize"))
        return self._open_cursor(
            self._new_result_cursor(f"{db}.$cmd.listCollections", infos), batch_size
        )

    async def _list_databases(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        filter_ = engine.check_filter(body.get("filter"))
        dbs = []
        for name, colls in self.catalog.databases.items():
            size = sum(len(c.docs) for c in colls.values()) * 256
            info: Document = {"name": name, "sizeOnDisk": Int64(size), "empty": size == 0}
            if engine.matches(filter_, info):
                dbs.append({"name": name} if body.get("nameOnly") else info)
        total = sum(int(d.get("sizeOnDisk", 0)) for d in dbs)
        return {"databases": dbs, "totalSize": Int64(total)}

    async def _drop_database(self, db: str, body: Document, ctx: ConnectionContext) -> Document:
        if db in self.catalog.databases:
            self.catalog.drop_database(db)
        return {"dropped": db}

    # -- background work ------------------------------------------------------------------

    async def reap_expired_documents(self) -> int:
        """Delete documents past their TTL index expiry (mongod's TTL monitor), TTL_CHUNK
        at a time with the loop yielded between chunks: a sweep of 10,000 expired fires
        done in one go held every client (a leader's lease renewal too) for a third of a
        second, once a second."""
        now = self.operation().now
        removed = 0
        for colls in list(self.catalog.databases.values()):
            for coll in list(colls.values()):
                expired = coll.expired(now)
                for start in range(0, len(expired), TTL_CHUNK):
                    if start:
                        await asyncio.sleep(0)
                    for rid in expired[start : start + TTL_CHUNK]:
                        if coll.still_expired(rid, now):
                            coll.delete(rid)
                            removed += 1
        return removed

    def reap_idle_cursors(self) -> int:
        cutoff = time.monotonic() - self.settings.cursor_timeout_s
        idle = [cid for cid, c in self.cursors.items() if c.last_used < cutoff]
        for cid in idle:
            del self.cursors[cid]
        return len(idle)


def _plain_count(pipeline: list[Document], matched: int) -> list[Document] | None:
    """The result of count_documents' tail (``$skip``, ``$limit``, ``$group`` summing 1).

    None for any other pipeline. Drivers send this shape for every count_documents.
    """
    skip, limit = 0, None
    for stage in pipeline[:-1]:
        if set(stage) == {"$skip"} and type(stage["$skip"]) is int and stage["$skip"] >= 0:
            skip = stage["$skip"]
        elif set(stage) == {"$limit"} and type(stage["$limit"]) is int and stage["$limit"] > 0:
            limit = stage["$limit"]
        else:
            return None
    if not pipeline or pipeline[-1] != {"$group": {"_id": 1, "n": {"$sum": 1}}}:
        return None
    n = max(matched - skip, 0)
    n = n if limit is None else min(n, limit)
    return [{"_id": 1, "n": n}] if n else []


def _shape(name: str, body: Document) -> str:
    """What a slow command asked, briefly: its filter or pipeline, or how many documents
    or statements it carried."""
    for field in ("filter", "pipeline", "query"):
        if field in body:
            return repr(body[field])[:300]
    for field in ("documents", "updates", "deletes"):
        if isinstance(body.get(field), list):
            statements = body[field]
            first = statements[0] if statements else None
            described = repr(first.get("q")) if isinstance(first, dict) and "q" in first else ""
            return f"{len(statements)} {field} {described}"[:300]
    return name
