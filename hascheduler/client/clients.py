"""``Client`` and ``AsyncClient``: the HTTP API from Python (httpx, which has both).

    from hascheduler.client import Client
    with Client("http://127.0.0.1:8080") as api:
        api.create_schedule({"id": "report", "name": "report", "target": "reports.weekly",
                             "trigger": {"kind": "cron", "cron": "0 9 * * MON",
                                         "timezone": "Europe/Paris"}})

The API's URL and token come from the arguments, else from HASCHEDULER_API and
HASCHEDULER_TOKEN. A call that is safe to repeat (reads, PUT, DELETE, pause and resume, a
trigger with an idempotency key) is retried with backoff when no answer came or the API
answered 5xx; any call refused with 429 is retried after the Retry-After the API gave; the
last failure is raised as its typed error (errors.py).
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from hascheduler.client import calls
from hascheduler.client.calls import Call, Document
from hascheduler.client.errors import HaschedulerError, RateLimited, Unavailable, error_for
from hascheduler.client.local_cluster import ControlError, find_api
from hascheduler.core import models
from hascheduler.core.health import ScheduleHealth

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_ATTEMPTS = 5
_backoff = wait_exponential_jitter(multiplier=0.2, max=5.0, jitter=0.2)


class _NotSent(Unavailable):
    """The connection was never made: nothing reached the API, so any call may go again."""


def _http_options(
    api: str | None,
    token: str | None,
    verify: bool | str,
    cert: str | tuple[str, str] | None,
    timeout_s: float,
    reason: str | None,
    origin: str | None,
) -> dict[str, Any]:
    """What httpx's Client and AsyncClient are both made with: the API named, else
    HASCHEDULER_API, else the local cluster running from this directory, as the CLI finds
    it."""
    try:
        base = find_api(api)
    except ControlError as exc:
        raise ValueError(str(exc)) from None
    token = token or os.environ.get("HASCHEDULER_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if reason is not None:  # why, in the audit trail's record of every change
        headers["X-Reason"] = reason
    if origin is not None:
        headers["X-Change-Origin"] = origin
    return {
        "base_url": base.rstrip("/"),
        "headers": headers,
        "verify": verify,
        "cert": cert,
        "timeout": timeout_s,
    }


Page = tuple[list[T], str | None]


def _retry_policy(call: Call[Any], attempts: int) -> dict[str, Any]:
    def retryable(exc: BaseException) -> bool:
        return isinstance(exc, RateLimited | _NotSent) or (
            call.idempotent and isinstance(exc, Unavailable)
        )

    def wait(state: RetryCallState) -> float:
        outcome = state.outcome
        exc = outcome.exception() if outcome is not None else None
        return exc.retry_after if isinstance(exc, RateLimited) else float(_backoff(state))

    return {
        "retry": retry_if_exception(retryable),
        "wait": wait,
        "stop": stop_after_attempt(attempts),
        "reraise": True,
    }


def _answer(call: Call[T], response: httpx.Response) -> T:
    if response.status_code >= 400:
        body: Any = None
        if response.content:
            try:
                body = response.json()
            except ValueError:
                body = None
        raise error_for(call.method, call.path, response.status_code, body, response.headers)
    return call.read(response.content)


def _transport_error(
    call: Call[Any], base: httpx.URL, exc: httpx.TransportError
) -> HaschedulerError:
    kind = _NotSent if isinstance(exc, httpx.ConnectError) else Unavailable
    return kind(f"{call.method} {call.path}: cannot reach the API at {base}: {exc!r}")


class Client:
    """The HTTP API, blocking. ``verify``: True, False or a CA bundle's path; ``cert``: a
    client certificate (a PEM path, or (certificate, key)); ``reason``: why, recorded in the
    audit trail with every change made through this client."""

    def __init__(
        self,
        api: str | None = None,
        token: str | None = None,
        *,
        verify: bool | str = True,
        cert: str | tuple[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        attempts: int = DEFAULT_ATTEMPTS,
        reason: str | None = None,
        origin: str | None = None,
    ) -> None:
        self.attempts = attempts
        self._http = httpx.Client(
            **_http_options(api, token, verify, cert, timeout_s, reason, origin)
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def send(self, call: Call[T]) -> T:
        """One call, retried as its kind allows."""
        for attempt in Retrying(**_retry_policy(call, self.attempts)):
            with attempt:
                try:
                    response = self._http.request(
                        call.method,
                        call.path,
                        params=call.params,
                        json=call.json,
                        headers=call.headers,
                    )
                except httpx.TransportError as exc:
                    raise _transport_error(call, self._http.base_url, exc) from exc
                return _answer(call, response)
        raise AssertionError("unreachable: tenacity reraises the last failure")

    def pages(self, page: Callable[[str | None], Call[Page[T]]]) -> Iterator[T]:
        """Every item of a paginated list, ``page(after)`` giving each page's call."""
        after: str | None = None
        while True:
            items, after = self.send(page(after))
            yield from items
            if after is None:
                return

    # Schedules.
    def create_schedule(self, schedule: models.ScheduleIn | Mapping[str, Any]) -> models.Schedule:
        return self.send(calls.create_schedule(schedule))

    def create_schedules(
        self, schedules: Sequence[models.ScheduleIn | Mapping[str, Any]]
    ) -> models.BatchCreated:
        """Up to 500 in one request, all checked before any is written."""
        return self.send(calls.create_schedules(schedules))

    def get_schedule(self, schedule_id: str) -> models.Schedule:
        return self.send(calls.get_schedule(schedule_id))

    def schedules(
        self,
        labels: Mapping[str, str] | None = None,
        paused: bool | None = None,
        page_size: int = 100,
        namespace: str | None = None,
    ) -> Iterator[models.Schedule]:
        """Every schedule matching, a page at a time, in id order."""
        return self.pages(
            lambda after: calls.schedules_page(labels, paused, after, page_size, namespace)
        )

    def history(self, schedule_id: str, page_size: int = 100) -> Iterator[Document]:
        """A schedule's audit records, newest first."""
        return self.pages(lambda before: calls.history_page(schedule_id, before, page_size))

    def audit(
        self,
        namespace: str | None = None,
        schedule_id: str | None = None,
        actor: str | None = None,
        since: dt.datetime | str | None = None,
        page_size: int = 100,
    ) -> Iterator[Document]:
        """The audit trail, newest first."""
        return self.pages(
            lambda before: calls.audit_page(namespace, schedule_id, actor, since, before, page_size)
        )

    def restore(
        self, schedule_id: str, revision: int, if_match: int | None = None
    ) -> models.Schedule:
        return self.send(calls.restore(schedule_id, revision, if_match))

    def replace_schedule(
        self,
        schedule_id: str,
        fields: models.ScheduleFields | Mapping[str, Any],
        if_match: int | None = None,
    ) -> models.Schedule:
        return self.send(calls.replace_schedule(schedule_id, fields, if_match))

    def update_schedule(self, schedule: models.Schedule) -> models.Schedule:
        return self.send(calls.update_schedule(schedule))

    def patch_schedule(
        self, schedule_id: str, patch: Mapping[str, Any], if_match: int | None = None
    ) -> models.Schedule:
        return self.send(calls.patch_schedule(schedule_id, patch, if_match))

    def delete_schedule(self, schedule_id: str, if_match: int | None = None) -> None:
        self.send(calls.delete_schedule(schedule_id, if_match))

    def pause(
        self,
        schedule_id: str,
        note: str | None = None,
        until: dt.datetime | str | None = None,
        if_match: int | None = None,
    ) -> models.Schedule:
        return self.send(calls.pause(schedule_id, note, until, if_match))

    def resume(self, schedule_id: str, if_match: int | None = None) -> models.Schedule:
        return self.send(calls.resume(schedule_id, if_match))

    def next_fires(
        self, schedule_id: str, count: int = 5, after: dt.datetime | str | None = None
    ) -> models.Preview:
        return self.send(calls.next_fires(schedule_id, count, after))

    # Run control.
    def trigger(
        self,
        schedule_id: str,
        payload: Mapping[str, Any] | None = None,
        overlap: str | None = None,
        force: bool = False,
        idempotency_key: str | None = None,
        priority: int | None = None,
    ) -> models.Triggered:
        return self.send(
            calls.trigger(schedule_id, payload, overlap, force, idempotency_key, priority)
        )

    def backfill(
        self,
        schedule_id: str,
        start: dt.datetime | str,
        end: dt.datetime | str,
        overlap: str | None = None,
    ) -> Document:
        return self.send(calls.backfill(schedule_id, start, end, overlap))

    def get_backfill(self, backfill_id: str) -> Document:
        return self.send(calls.get_backfill(backfill_id))

    def cancel_backfill(self, backfill_id: str) -> Document:
        return self.send(calls.cancel_backfill(backfill_id))

    def health(self, schedule_id: str) -> ScheduleHealth:
        return self.send(calls.health(schedule_id))

    # Webhooks.
    def create_webhook(self, webhook: models.WebhookIn | Mapping[str, Any]) -> models.Webhook:
        """The answer holds the webhook's secret: the only time it is shown."""
        return self.send(calls.create_webhook(webhook))

    def webhooks(self, namespace: str | None = None) -> models.WebhookList:
        return self.send(calls.webhooks(namespace))

    def get_webhook(self, webhook_id: str) -> models.Webhook:
        return self.send(calls.get_webhook(webhook_id))

    def delete_webhook(self, webhook_id: str) -> None:
        self.send(calls.delete_webhook(webhook_id))

    def webhook_deliveries(self, webhook_id: str, limit: int = 100) -> Document:
        return self.send(calls.webhook_deliveries(webhook_id, limit))

    # Fires and runs.
    def schedule_fires(self, schedule_id: str, limit: int = 50) -> Document:
        return self.send(calls.schedule_fires(schedule_id, limit))

    def schedule_runs(self, schedule_id: str, limit: int = 50) -> Document:
        return self.send(calls.schedule_runs(schedule_id, limit))

    def runs(
        self, state: str | None = None, page_size: int = 100, namespace: str | None = None
    ) -> Iterator[Document]:
        """Every run (in ``state``), most recently changed first, a page at a time."""
        return self.pages(lambda after: calls.runs_page(state, after, page_size, namespace))

    def get_run(self, fire_id: str) -> Document:
        return self.send(calls.get_run(fire_id))

    def retry_run(self, fire_id: str) -> Document:
        return self.send(calls.retry_run(fire_id))

    def cancel_run(self, fire_id: str) -> Document:
        return self.send(calls.cancel_run(fire_id))

    def get_fire(self, fire_id: str) -> Document:
        return self.send(calls.get_fire(fire_id))

    # The cluster.
    def leader(self) -> Document:
        return self.send(calls.leader())

    def cluster(self) -> Document:
        return self.send(calls.cluster())

    def readiness(self) -> Document:
        return self.send(calls.readiness())


class AsyncClient:
    """The HTTP API for asyncio; the same methods as ``Client``, awaited."""

    def __init__(
        self,
        api: str | None = None,
        token: str | None = None,
        *,
        verify: bool | str = True,
        cert: str | tuple[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        attempts: int = DEFAULT_ATTEMPTS,
        reason: str | None = None,
        origin: str | None = None,
    ) -> None:
        self.attempts = attempts
        self._http = httpx.AsyncClient(
            **_http_options(api, token, verify, cert, timeout_s, reason, origin)
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def send(self, call: Call[T]) -> T:
        """One call, retried as its kind allows."""
        async for attempt in AsyncRetrying(**_retry_policy(call, self.attempts)):
            with attempt:
                try:
                    response = await self._http.request(
                        call.method,
                        call.path,
                        params=call.params,
                        json=call.json,
                        headers=call.headers,
                    )
                except httpx.TransportError as exc:
                    raise _transport_error(call, self._http.base_url, exc) from exc
                return _answer(call, response)
        raise AssertionError("unreachable: tenacity reraises the last failure")

    async def pages(self, page: Callable[[str | None], Call[Page[T]]]) -> AsyncIterator[T]:
        """Every item of a paginated list, ``page(after)`` giving each page's call."""
        after: str | None = None
        while True:
            items, after = await self.send(page(after))
            for item in items:
                yield item
            if after is None:
                return

    async def create_schedule(
        self, schedule: models.ScheduleIn | Mapping[str, Any]
    ) -> models.Schedule:
        return await self.send(calls.create_schedule(schedule))

    async def create_schedules(
        self, schedules: Sequence[models.ScheduleIn | Mapping[str, Any]]
    ) -> models.BatchCreated:
        return await self.send(calls.create_schedules(schedules))

    async def get_schedule(self, schedule_id: str) -> models.Schedule:
        return await self.send(calls.get_schedule(schedule_id))

    def schedules(
        self,
        labels: Mapping[str, str] | None = None,
        paused: bool | None = None,
        page_size: int = 100,
        namespace: str | None = None,
    ) -> AsyncIterator[models.Schedule]:
        return self.pages(
            lambda after: calls.schedules_page(labels, paused, after, page_size, namespace)
        )

    def history(self, schedule_id: str, page_size: int = 100) -> AsyncIterator[Document]:
        return self.pages(lambda before: calls.history_page(schedule_id, before, page_size))

    def audit(
        self,
        namespace: str | None = None,
        schedule_id: str | None = None,
        actor: str | None = None,
        since: dt.datetime | str | None = None,
        page_size: int = 100,
    ) -> AsyncIterator[Document]:
        return self.pages(
            lambda before: calls.audit_page(namespace, schedule_id, actor, since, before, page_size)
        )

    async def restore(
        self, schedule_id: str, revision: int, if_match: int | None = None
    ) -> models.Schedule:
        return await self.send(calls.restore(schedule_id, revision, if_match))

    async def replace_schedule(
        self,
        schedule_id: str,
        fields: models.ScheduleFields | Mapping[str, Any],
        if_match: int | None = None,
    ) -> models.Schedule:
        return await self.send(calls.replace_schedule(schedule_id, fields, if_match))

    async def update_schedule(self, schedule: models.Schedule) -> models.Schedule:
        return await self.send(calls.update_schedule(schedule))

    async def patch_schedule(
        self, schedule_id: str, patch: Mapping[str, Any], if_match: int | None = None
    ) -> models.Schedule:
        return await self.send(calls.patch_schedule(schedule_id, patch, if_match))

    async def delete_schedule(self, schedule_id: str, if_match: int | None = None) -> None:
        await self.send(calls.delete_schedule(schedule_id, if_match))

    async def pause(
        self,
        schedule_id: str,
        note: str | None = None,
        until: dt.datetime | str | None = None,
        if_match: int | None = None,
    ) -> models.Schedule:
        return await self.send(calls.pause(schedule_id, note, until, if_match))

    async def resume(self, schedule_id: str, if_match: int | None = None) -> models.Schedule:
        return await self.send(calls.resume(schedule_id, if_match))

    async def next_fires(
        self, schedule_id: str, count: int = 5, after: dt.datetime | str | None = None
    ) -> models.Preview:
        return await self.send(calls.next_fires(schedule_id, count, after))

    async def trigger(
        self,
        schedule_id: str,
        payload: Mapping[str, Any] | None = None,
        overlap: str | None = None,
        force: bool = False,
        idempotency_key: str | None = None,
        priority: int | None = None,
    ) -> models.Triggered:
        return await self.send(
            calls.trigger(schedule_id, payload, overlap, force, idempotency_key, priority)
        )

    async def backfill(
        self,
        schedule_id: str,
        start: dt.datetime | str,
        end: dt.datetime | str,
        overlap: str | None = None,
    ) -> Document:
        return await self.send(calls.backfill(schedule_id, start, end, overlap))

    async def get_backfill(self, backfill_id: str) -> Document:
        return await self.send(calls.get_backfill(backfill_id))

    async def cancel_backfill(self, backfill_id: str) -> Document:
        return await self.send(calls.cancel_backfill(backfill_id))

    async def health(self, schedule_id: str) -> ScheduleHealth:
        return await self.send(calls.health(schedule_id))

    async def create_webhook(self, webhook: models.WebhookIn | Mapping[str, Any]) -> models.Webhook:
        return await self.send(calls.create_webhook(webhook))

    async def webhooks(self, namespace: str | None = None) -> models.WebhookList:
        return await self.send(calls.webhooks(namespace))

    async def get_webhook(self, webhook_id: str) -> models.Webhook:
        return await self.send(calls.get_webhook(webhook_id))

    async def delete_webhook(self, webhook_id: str) -> None:
        await self.send(calls.delete_webhook(webhook_id))

    async def webhook_deliveries(self, webhook_id: str, limit: int = 100) -> Document:
        return await self.send(calls.webhook_deliveries(webhook_id, limit))

    async def schedule_fires(self, schedule_id: str, limit: int = 50) -> Document:
        return await self.send(calls.schedule_fires(schedule_id, limit))

    async def schedule_runs(self, schedule_id: str, limit: int = 50) -> Document:
        return await self.send(calls.schedule_runs(schedule_id, limit))

    def runs(
        self, state: str | None = None, page_size: int = 100, namespace: str | None = None
    ) -> AsyncIterator[Document]:
        return self.pages(lambda after: calls.runs_page(state, after, page_size, namespace))

    async def get_run(self, fire_id: str) -> Document:
        return await self.send(calls.get_run(fire_id))

    async def retry_run(self, fire_id: str) -> Document:
        return await self.send(calls.retry_run(fire_id))

    async def cancel_run(self, fire_id: str) -> Document:
        return await self.send(calls.cancel_run(fire_id))

    async def get_fire(self, fire_id: str) -> Document:
        return await self.send(calls.get_fire(fire_id))

    async def leader(self) -> Document:
        return await self.send(calls.leader())

    async def cluster(self) -> Document:
        return await self.send(calls.cluster())

    async def readiness(self) -> Document:
        return await self.send(calls.readiness())
