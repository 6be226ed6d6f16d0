"""The CloudEvent a fire becomes: the rendered bytes are exactly json.dumps of the event."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from hascheduler.core.events import EventTemplate
from hascheduler.core.triggers import fire_id, iso_utc

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@given(
    schedule_id=st.text(min_size=1),
    name=st.text(),
    payload=st.dictionaries(st.text(), JSON),
    term=st.integers(1, 2**40),
    attempt=st.integers(1, 10),
    tenant=st.none() | st.text(min_size=1),
    namespace=st.sampled_from(["default", "team-a"]),
    nominal=st.datetimes(
        dt.datetime(2000, 1, 1), dt.datetime(2100, 1, 1), timezones=st.just(dt.UTC)
    ),
)
def test_event_template_renders_what_json_dumps_of_the_event_gives(
    schedule_id: str,
    name: str,
    payload: dict[str, Any],
    term: int,
    attempt: int,
    tenant: str | None,
    namespace: str,
    nominal: dt.datetime,
) -> None:
    fired = nominal + dt.timedelta(milliseconds=3)
    fire = fire_id(schedule_id, nominal)
    schedule = {
        "_id": schedule_id,
        "name": name,
        "payload": payload,
        "target": "t.x",
        "namespace": namespace,
    }
    message = EventTemplate.of(schedule).render(
        fire, nominal, tenant, term, attempt, iso_utc(fired)
    )
    event = {
        "specversion": "1.0",
        "id": fire,
        "source": "/hascheduler",
        "type": "io.hascheduler.fire",
        "subject": schedule_id,
        "time": iso_utc(fired),
        "datacontenttype": "application/json",
        "data": {
            "schedule_id": schedule_id,
            "name": name,
            "namespace": namespace,
            "nominal_at": iso_utc(nominal),
            "fired_at": iso_utc(fired),
            "term": term,
            "attempt": attempt,
            **({"tenant": tenant} if tenant is not None else {}),
            "payload": payload,
        },
    }
    assert message.body == json.dumps(event, separators=(",", ":")).encode()
    assert (message.fire_id, message.target, message.term) == (fire, "t.x", term)


def test_a_traced_fire_carries_the_distributed_tracing_extension() -> None:
    nominal = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    template = EventTemplate.of(
        {
            "_id": "s",
            "name": "n",
            "target": "t.x",
            "payload": {},
            "trace": "00-" + "c" * 32 + "-" + "d" * 16 + "-01",
        }
    )
    trace = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": 'vendor=x"y'}
    message = template.render("s@x", nominal, None, 1, 1, iso_utc(nominal), trace)
    event = json.loads(message.body)
    assert event["traceparent"] == trace["traceparent"]
    assert event["tracestate"] == trace["tracestate"]
    assert (message.traceparent, message.tracestate) == (trace["traceparent"], trace["tracestate"])
    assert list(event)[:8] == [
        "specversion",
        "id",
        "source",
        "type",
        "subject",
        "time",
        "traceparent",
        "tracestate",
    ]
    # The schedule's own trace is the link of its fires' spans, never their parent.
    assert template.written_in == "00-" + "c" * 32 + "-" + "d" * 16 + "-01"
    untraced = template.render("s@x", nominal, None, 1, 1, iso_utc(nominal))
    assert "traceparent" not in json.loads(untraced.body)
    assert untraced.traceparent is None
