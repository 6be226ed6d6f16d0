"""An OTLP/HTTP trace receiver in the test's process: what the OpenTelemetry Collector's
``otlp`` receiver does on ``POST /v1/traces`` (protobuf), keeping each span it is sent."""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int  # SpanKind as OTLP numbers it: 2 server, 3 client, 4 producer, 5 consumer
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace id, span id)
    status: int  # 0 unset, 1 ok, 2 error


@dataclass
class OtlpReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> OtlpReceiver:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._export)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.requests += 1
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name")),
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=[
                                (e.name, {a.key: _value(a.value) for a in e.attributes})
                                for e in s.events
                            ],
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            status=s.status.code,
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def named(self, name: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.name == name]
