"""The database client every process makes (replica, worker, CLI): the async PyMongo driver,
with its condition wait made safe against a task cancelled twice on Python 3.11.

On Python before 3.12, ``asyncio.wait_for`` runs the awaited coroutine as a task of its
own. The driver waits for a server, or for a connection, with ``wait_for(condition.wait(),
timeout)`` while it holds the topology's (or the pool's) lock. A task cancelled a second
time while ``wait_for`` cancels that inner task leaves it behind: the caller's ``async
with lock`` then releases a lock another task holds, and the inner task takes it back and
never releases it. From then on every operation of the client waits for that lock, past
any timeout (a replica's API, ledger and renewals stop; seen in CI during a primary
step-down, where many tasks wait for a server and a lost term cancels them). Upstream:
PYTHON-5167 (mongodb/mongo-python-driver#2165). The replacement waits in the calling task
under ``asyncio.timeout``, which Python 3.11 has: ``Condition.wait`` takes the lock back
before any cancellation leaves it, however many arrive.

The pool also opens more connections at once than the driver's default of two
(``maxConnecting``, unless the URI sets it). When the link to the database slows, each of a
leader's loops holds its connection longer, so more are needed at once, and each new one
costs a round trip: opened two at a time, the last waited several, more than what remains
of a term for one fenced write on a slow link (docs/RELIABILITY.md, test_slow_link.py).
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

from pymongo import AsyncMongoClient

# Checked by tests/test_driver.py against the driver installed: these are the
# modules that bind the function by name.
PATCHED_MODULES = ("pymongo.lock", "pymongo.asynchronous.topology", "pymongo.asynchronous.pool")
# Connections the pool opens at once: about as many as a leader's loops use together.
MAX_CONNECTING = 10


async def _cond_wait(condition: Any, timeout: float | None) -> bool:  # noqa: ASYNC109
    """The driver's ``_async_cond_wait``: True when notified, False on the timeout."""
    try:
        async with asyncio.timeout(timeout):
            return bool(await condition.wait())
    except TimeoutError:
        return False


def _patch_condition_wait() -> None:
    # From Python 3.12 wait_for itself runs the coroutine in the caller's task; replaced
    # there too, so that every version runs the same wait (and the same tests).
    for name in PATCHED_MODULES:
        importlib.import_module(name)._async_cond_wait = _cond_wait  # type: ignore[attr-defined]


_patch_condition_wait()


def connect(uri: str, **options: Any) -> AsyncMongoClient[dict[str, Any]]:
    """An async client for ``uri``, datetimes timezone-aware (the ledger's times are UTC).
    A keyword would override the URI's own options: ``maxConnecting`` is given only when
    the URI does not set it."""
    if "maxconnecting=" not in uri.partition("?")[2].lower():
        options.setdefault("maxConnecting", MAX_CONNECTING)
    return AsyncMongoClient(uri, tz_aware=True, **options)
