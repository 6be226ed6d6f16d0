"""One trace from a run-now request to the handler's own span, across a replica, a real
broker (nats-server, RabbitMQ) and a worker, collected by an OTLP receiver in the test:
each span's parent is the one before it, the fire links to the write that made its
schedule, a retry is an event, and every process's log lines inside a span name its trace.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hascheduler.process import tracing
from tests.helpers.otlp import OtlpReceiver, ReceivedSpan
from tests.servers import (
    RabbitServer,
    log_lines,
    start_cli,
    start_nats,
    start_replica,
    with_database,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(180)]

SERVER, PRODUCER, CONSUMER = 2, 4, 5
ERROR, OK = 2, 1


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    r = await OtlpReceiver().start()
    yield r
    await r.close()


@pytest.fixture(params=["nats", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "nats":
        nats = start_nats()
        yield nats.uri
        nats.stop()
        return
    rabbit: RabbitServer = request.getfixturevalue("rabbit")
    yield f"{rabbit.url}?exchange=traces-{uuid.uuid4().hex[:8]}"


async def test_one_trace_from_the_run_now_request_to_the_handlers_own_span(
    mongo_uri: str, receiver: OtlpReceiver, broker_url: str, tmp_path: Path
) -> None:
    uri = with_database(mongo_uri, f"traces_{uuid.uuid4().hex[:8]}")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "RECORD_FIRES_TO": str(tmp_path / "attempts.txt"),
    }
    replica = await asyncio.to_thread(start_replica, uri, "traced", "--broker", broker_url, env=env)
    worker = None
    try:
        worker = await asyncio.to_thread(
            start_cli,
            [
                "worker",
                "--broker",
                broker_url,
                "--mongodb-uri",
                uri,
                "--app",
                "tests.helpers.record_handler:app",
                "--durable",
                "traced",
                "--worker-id",
                "w-traced",
            ],
            "worker ",
            30.0,
            env,
        )
        async with aiohttp.ClientSession() as http:

            async def leading() -> bool:
                async with http.get(replica.uri + "/leader") as r:
                    return r.status == 200 and (await r.json())["answered_by_leader"]

            await wait_until(leading, 30, "the replica to lead")
            body = {
                "id": "traced-report",
                "name": "report",
                "target": "traced.report",
                "trigger": {"kind": "cron", "cron": "0 0 1 1 *"},
            }
            async with http.post(replica.uri + "/schedules", json=body) as r:
                assert r.status == 201, await r.text()
            async with http.post(
                replica.uri + "/schedules/traced-report/trigger", json={"payload": {"fail": 1}}
            ) as r:
                assert r.status == 202, await r.text()
                fire_id = (await r.json())["fire_id"]

        # Two attempts (the first fails), each with its claim, its run and the handler's
        # span: a run's span ends after its handler's, and may come in a later export, so
        # the trace is complete once both runs' spans are in too, and the publish's: it
        # ends when the replica reads the broker's ack, which on a busy machine can come
        # after the worker has run both attempts.
        def complete() -> list[ReceivedSpan]:
            handlers = receiver.named("handler work")
            runs = receiver.named("run traced.report")
            published = [
                s
                for s in receiver.named("publish traced.report")
                if s.attributes["messaging.message.id"] == fire_id
            ]
            return handlers if len(handlers) == 2 and len(runs) == 2 and published else []

        handlers = await wait_until(complete, 30, "the handler's spans of both attempts")
    finally:
        if worker is not None:
            worker.stop(signal.SIGTERM)
        replica.stop(signal.SIGTERM)

    spans = {s.span_id: s for s in receiver.spans}
    request = [s for s in receiver.named("POST /schedules/{id}/trigger")]
    assert len(request) == 1
    request_span = request[0]
    trace_id = request_span.trace_id
    assert (request_span.kind, request_span.service, request_span.parent_span_id) == (
        SERVER,
        "hascheduler",
        "",
    )
    assert request_span.attributes["http.response.status_code"] == 202

    (publish,) = [
        s
        for s in receiver.named("publish traced.report")
        if s.attributes["messaging.message.id"] == fire_id
    ]
    assert (publish.kind, publish.trace_id, publish.parent_span_id) == (
        PRODUCER,
        trace_id,
        request_span.span_id,
    )
    # The fire links to the write that made its schedule (another trace: its own request).
    (write,) = receiver.named("schedule create")
    assert publish.links == [(write.trace_id, write.span_id)]
    assert spans[write.parent_span_id].name == "POST /schedules"

    claims = [s for s in receiver.named("claim traced.report") if s.trace_id == trace_id]
    runs = sorted(
        (s for s in receiver.named("run traced.report") if s.trace_id == trace_id),
        key=lambda s: s.attributes["hascheduler.attempt"],
    )
    assert len(claims) == 2
    assert len(runs) == 2
    for claim in claims:
        assert (claim.kind, claim.service, claim.parent_span_id) == (
            CONSUMER,
            "hascheduler-worker",
            publish.span_id,
        )
    assert {spans[r.parent_span_id].name for r in runs} == {"claim traced.report"}
    assert {r.parent_span_id for r in runs} == {c.span_id for c in claims}
    first, second = runs
    assert first.status == ERROR
    assert [name for name, _ in first.events] == ["retry"]
    assert "transient failure on attempt 1" in str(first.events[0][1]["error"])
    assert second.status == OK
    assert not second.events
    # The handler's own spans nest in their attempt's.
    assert sorted(spans[h.parent_span_id].span_id for h in handlers) == sorted(
        r.span_id for r in runs
    )
    assert {h.trace_id for h in handlers} == {trace_id}

    # Log lines inside a span carry its trace and span ids, in each process.
    requested = [line for line in log_lines(replica) if line["event"] == "fire_requested"]
    assert [(line["trace_id"], line["span_id"]) for line in requested] == [
        (trace_id, request_span.span_id)
    ]
    published = [
        line
        for line in log_lines(replica)
        if line["event"] == "fire_traced" and line["fire_id"] == fire_id
    ]
    assert [(line["trace_id"], line["span_id"]) for line in published] == [
        (trace_id, publish.span_id)
    ]
    assert worker is not None
    working = [line for line in log_lines(worker) if line["event"] == "handler_working"]
    assert sorted((str(line["trace_id"]), str(line["span_id"])) for line in working) == sorted(
        (h.trace_id, h.span_id) for h in handlers
    )


def test_tracing_is_off_unless_an_endpoint_is_named() -> None:
    assert not tracing.configure("x", environ={})
    assert not tracing.configure(
        "x", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318", "OTEL_SDK_DISABLED": "true"}
    )
    assert not tracing.enabled()
    assert tracing.current_traceparent() is None
    with tracing.write_span("update", 1) as trace:
        assert trace is None


@pytest.mark.parametrize(
    "traceparent",
    [
        None,
        "",
        "garbage",
        "00-" + "0" * 32 + "-" + "1" * 16 + "-01",  # an all-zero trace id
        "00-" + "a" * 32 + "-" + "0" * 16 + "-01",  # an all-zero span id
        "ff-" + "a" * 32 + "-" + "b" * 16 + "-01",  # version ff is invalid
        "00-" + "A" * 32 + "-" + "b" * 16 + "-01",  # upper case
        "00-" + "a" * 32 + "-" + "b" * 16 + "-01" + "x" * 10_000,
    ],
)
def test_a_malformed_traceparent_from_a_wire_is_ignored(traceparent: str | None) -> None:
    assert tracing.context_of(traceparent) is None
    assert tracing.link_of(traceparent) == ()


@pytest.mark.parametrize("sampler", ["ratio", "parent-ratio", "on", "off", "other"])
def test_a_root_fire_is_sampled_as_the_configured_sampler_would_sample_it(sampler: str) -> None:
    """The leader decides an unsampled fire without an SDK span (tracing.begin_root): the
    decision is the configured sampler's, for every trace id."""
    import random

    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import sampling

    class EveryThird(sampling.Sampler):
        def should_sample(
            self, parent_context: Any, trace_id: int, name: str, *args: Any, **kwargs: Any
        ) -> sampling.SamplingResult:
            return sampling.SamplingResult(
                sampling.Decision.RECORD_AND_SAMPLE if trace_id % 3 == 0 else sampling.Decision.DROP
            )

        def get_description(self) -> str:
            return "every third"

    configured = {
        "ratio": sampling.TraceIdRatioBased(0.25),
        "parent-ratio": sampling.ParentBased(sampling.TraceIdRatioBased(0.25)),
        "on": sampling.ALWAYS_ON,
        "off": sampling.ALWAYS_OFF,
        "other": EveryThird(),
    }[sampler]
    decide = tracing._root_decider(configured)
    ids = [random.getrandbits(128) or 1 for _ in range(2000)]
    ours = [decide(i, "publish t", tracing.SpanKind.PRODUCER) for i in ids]
    theirs = [
        configured.should_sample(Context(), i, "publish t").decision
        == sampling.Decision.RECORD_AND_SAMPLE
        for i in ids
    ]
    assert ours == theirs
    assert (0 < sum(ours) < len(ours)) is (sampler not in ("on", "off"))
