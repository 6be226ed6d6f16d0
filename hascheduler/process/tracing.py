"""OpenTelemetry tracing, configured the standard way and off unless asked for.

``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) turns it on:
spans go to that OTLP/HTTP endpoint in batches; ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``/``_ARG`` and ``OTEL_BSP_*`` mean what
the OpenTelemetry specification says. Unset, ``enabled()`` is False and every caller skips
its tracing work: the hot paths (the leader's publish, the worker's claim) test that one
flag, nothing more.

A fire's context crosses processes as a W3C ``traceparent``/``tracestate`` pair: in the
CloudEvent (the distributed-tracing extension), in the broker message's headers, and on
the stored schedule (the trace of the write that last changed it, which each of its fires
links to) and on a fire run now (whose trace its publish continues).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "Context",
    "Link",
    "Span",
    "SpanKind",
    "Status",
    "StatusCode",
    "attached",
    "begin_root",
    "carried",
    "configure",
    "context_of",
    "current_traceparent",
    "enabled",
    "flush",
    "link_of",
    "log_fields",
    "parent_of",
    "sampled",
    "tracer",
    "write_span",
]

log = structlog.get_logger("hascheduler.tracing")

EXPORT_EVERY_MS = 200
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_propagator = TraceContextTextMapPropagator()
_NO_PARENT = Context()  # a root span's context: whatever span is current is not its parent
_state: dict[str, Any] = {"provider": None}


def enabled() -> bool:
    return _state["provider"] is not None


def configure(default_service: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Install the SDK's tracer provider with a batching OTLP/HTTP exporter if the
    environment names an endpoint (and ``OTEL_SDK_DISABLED`` is not true). Returns whether
    tracing is on."""
    if _state["provider"] is not None:
        return True
    if (
        not any(environ.get(v) for v in _ENDPOINT_VARIABLES)
        or environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    ):
        return False
    # Imported here: a process that does not trace never loads the SDK or protobuf.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: default_service}
    ids = _preset_ids()
    provider = TracerProvider(resource=Resource.create(attributes), id_generator=ids)
    # Exported often, in small batches, unless told otherwise: encoding a batch holds the
    # interpreter from the event loop, and 5 s worth of sampled spans at once (the SDK's
    # default) made the fires due at that moment late by as long.
    delay = None if environ.get("OTEL_BSP_SCHEDULE_DELAY") else EXPORT_EVERY_MS
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=delay))
    trace.set_tracer_provider(provider)
    _state["provider"] = provider
    _state["ids"] = ids
    _state["root_sampled"] = _root_decider(provider.sampler)
    _state["tracer"] = provider.get_tracer("hascheduler")
    log.info("tracing_on", endpoint=next(environ[v] for v in _ENDPOINT_VARIABLES if environ.get(v)))
    return True


def flush(timeout_s: float = 2.5) -> None:
    """Export what is buffered now (a process stopping; the provider's own exit hook
    shuts it down after)."""
    provider = _state["provider"]
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))


def _preset_ids() -> Any:
    """The SDK's random ids, but for a trace id set beforehand (``begin_root``): a root
    span whose sampling was decided on that id gets it. Per thread: a synchronous
    handler's thread makes spans too. (A factory: the SDK is imported only when tracing
    is on.)"""
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class PresetIds(IdGenerator):
        def __init__(self) -> None:
            self._preset = threading.local()

        def preset(self, trace_id: int) -> None:
            self._preset.trace_id = trace_id

        def generate_span_id(self) -> int:
            return random.getrandbits(64) or 1

        def generate_trace_id(self) -> int:
            trace_id: int | None = getattr(self._preset, "trace_id", None)
            if trace_id is not None:
                self._preset.trace_id = None
                return trace_id
            return random.getrandbits(128) or 1

    return PresetIds()


def begin_root(name: str, kind: SpanKind) -> tuple[Span | None, dict[str, str]]:
    """A span starting a trace, and the trace context it passes on; None for the span when
    the sampler does not sample it. The leader begins one for each of 10,000 fires a
    second, nearly all unsampled: those are decided on a trace id drawn here, by the
    configured sampler itself, and never become SDK spans (a third of the cost); a sampled
    one is made by the SDK with that very trace id, so the decision stands."""
    trace_id = random.getrandbits(128) or 1
    if not _state["root_sampled"](trace_id, name, kind):
        return None, {"traceparent": f"00-{trace_id:032x}-{random.getrandbits(64) or 1:016x}-00"}
    _state["ids"].preset(trace_id)
    span = tracer().start_span(name, context=_NO_PARENT, kind=kind)
    return span, carried(span)


def _root_decider(sampler: Any) -> Any:
    """How the configured sampler decides for a span without a parent, as one test of the
    trace id where the sampler is one of the SDK's ratio or fixed samplers (under
    ParentBased or alone), else by asking it."""
    from opentelemetry.sdk.trace import sampling

    root = sampler._root if isinstance(sampler, sampling.ParentBased) else sampler
    if isinstance(root, sampling.TraceIdRatioBased):
        limit, bound = root.TRACE_ID_LIMIT, root.bound
        return lambda trace_id, name, kind: trace_id & limit < bound
    if root is sampling.ALWAYS_ON or root is sampling.ALWAYS_OFF:
        decision = root is sampling.ALWAYS_ON
        return lambda trace_id, name, kind: decision
    return lambda trace_id, name, kind: sampler.should_sample(
        _NO_PARENT, trace_id, name, kind
    ).decision.is_sampled()


def tracer() -> Tracer:
    found: Tracer = _state.get("tracer") or trace.get_tracer("hascheduler")
    return found


def context_of(
    traceparent: str | None, tracestate: str | None = None
) -> otel_context.Context | None:
    """The remote parent a ``traceparent`` names, or None for none (or a malformed one:
    it came over a wire, and is ignored as the W3C specification says)."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    ctx = _propagator.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


@functools.lru_cache(maxsize=4096)
def link_of(traceparent: str | None) -> tuple[Link, ...]:
    """A link to the span a ``traceparent`` names (none if it names none). Cached: every
    fire of a schedule links to the same write."""
    ctx = context_of(traceparent)
    if ctx is None:
        return ()
    return (Link(trace.get_current_span(ctx).get_span_context()),)


def carried(span: Span) -> dict[str, str]:
    """The W3C ``traceparent`` (and ``tracestate`` when there is one) passing ``span`` on,
    formatted here rather than by the propagator: the leader does it for every fire."""
    ctx = span.get_span_context()
    carrier = {
        "traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    }
    if ctx.trace_state:
        carrier["tracestate"] = ctx.trace_state.to_header()
    return carrier


def sampled(span: Span) -> bool:
    """Whether the span's trace is sampled (recorded and exported), ended or not."""
    return bool(span.get_span_context().trace_flags.sampled)


def parent_of(span: Span) -> otel_context.Context:
    """A context whose current span is ``span``: its children's parent."""
    return trace.set_span_in_context(span)


def current_traceparent() -> str | None:
    """The current span's ``traceparent`` (None when tracing is off or no span is
    current): what a schedule's write stores for its fires to link to."""
    if not enabled():
        return None
    span = trace.get_current_span()
    return carried(span)["traceparent"] if span.get_span_context().is_valid else None


@contextlib.contextmanager
def write_span(action: str, count: int) -> Iterator[str | None]:
    """A span around one write of ``count`` schedules (storage's WriteTracer): its
    traceparent is what the write stores, for the schedule's fires to link to."""
    if not enabled():
        yield None
        return
    with tracer().start_as_current_span(
        f"schedule {action}",
        attributes={"hascheduler.action": action, "hascheduler.schedules": count},
    ) as span:
        yield carried(span)["traceparent"]


@contextlib.contextmanager
def attached(ctx: otel_context.Context | None) -> Iterator[None]:
    """Make ``ctx`` current for the block (nothing if None)."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def log_fields(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: the current span's ``trace_id`` and ``span_id`` on a line
    logged inside one (so logs and traces join)."""
    if _state["provider"] is not None:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            event.setdefault("trace_id", format(context.trace_id, "032x"))
            event.setdefault("span_id", format(context.span_id, "016x"))
    return event
