"""OpenAPI 3.1 for the HTTP API, generated from the pydantic models, and a docs page."""

from __future__ import annotations

import functools
import re
from typing import Any

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from .. import __version__, models
from ..constants import MAX_PAGE, MAX_PREVIEW


class Problem(BaseModel):
    status: int
    title: str
    errors: list[dict[str, str]] = Field(
        default_factory=list, description="each with 'field' (a dotted path) and 'message'")


class MirrorStatus(BaseModel):
    ready: bool
    size: int
    digest: str
    last_applied_cluster_time: dict[str, Any] | None
    replica_id: str
    sources: dict[str, str] | None = Field(None, description="each fan-out source's mirror "
                                           "digest, by collection:fields")
    sources_ready: bool | None = None


class Run(BaseModel):
    """One fire's run in the runs ledger (instants in RFC 3339)."""

    id: str = Field(description="the fire id: every handler's idempotency key")
    schedule_id: str
    fire: str | None = Field(None, description="a fan-out run's fire: its id without the "
                                                "tenant")
    tenant: str | None = None
    target: str
    nominal_at: str | None = None
    state: str = Field(description="running, succeeded, retrying or dead")
    attempts: int
    worker_id: str | None = None
    started_at: str | None = None
    first_started_at: str | None = None
    heartbeat_at: str | None = None
    lease_until: str | None = None
    finished_at: str | None = None
    duration_s: float | None = None
    last_error: str | None = None
    next_attempt_at: str | None = None
    replays: int = 0
    recorded_at: str | None = None


class RunList(BaseModel):
    items: list[Run]
    next: str | None = Field(default=None, description="the after= of the next page (the "
                                                       "fire id of this page's last run)")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}


def _responses(ok: int, name: str | None, *errors: int) -> dict[str, Any]:
    out: dict[str, Any] = {str(ok): {"description": "success"}}
    if name:
        out[str(ok)]["content"] = {"application/json": {"schema": _ref(name)}}
    for code in (*errors, 401):  # 401 from any route but the open ones, when tokens are set
        out[str(code)] = {"description": _ERRORS[code],
                          "content": {"application/json": {"schema": _ref("Problem")}}}
    return out


_ERRORS = {400: "malformed request (JSON, If-Match)",
           401: "a token is configured and this request has none, or a wrong one",
           403: "the token has the read scope; writes need the write scope",
           404: "no such schedule (or run)",
           409: "id taken, the revision in If-Match is not current, or the run is not "
                "dead",
           413: "body too large", 415: "body is not application/json",
           422: "invalid schedule or parameter; names the field",
           429: "too many writes from this client; see Retry-After", 503: "not ready"}

# If-Match as the server reads it (app.py parses with this very pattern): "*", or a
# revision as the ETag gives it, optionally weak and quoted.
IF_MATCH = re.compile(r'\s*(?:\*|(?:W/)?"?([1-9][0-9]{0,17})"?)\s*')
# ?label=key=value, as the server splits it: a label key (a slug) and any value.
LABEL_FILTER = rf"^{models.SLUG.pattern}=[\s\S]*$"

_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_IF_MATCH = {"name": "If-Match", "in": "header", "required": False,
             "schema": {"type": "string", "pattern": f"^{IF_MATCH.pattern}$"},
             "description": "the revision from the ETag; the write fails with 409 if stale"}
_WRITE = (400, 403, 413, 415, 422, 429)
_SEMANTIC = ("Besides its shape, the body must describe a schedule that can fire: a cron "
             "expression that parses and has a day it fires on, instants in the future, no "
             "more often than the cluster's floor, a catch-up window it can replay. Each "
             "refusal is a 422 naming the field.")


def _operations() -> dict[tuple[str, str], dict[str, Any]]:
    """Every route's OpenAPI operation, by (method, path)."""
    return {
        ("POST", "/schedules"): {
            "summary": "create a schedule", "description": _SEMANTIC,
            "requestBody": _json_body("ScheduleIn"),
            "responses": _responses(201, "Schedule", *_WRITE, 409)},
        ("GET", "/schedules"): {
            "summary": "list schedules (id order, cursor pagination)",
            "parameters": [
                {"name": "label", "in": "query", "description": "key=value; repeat to AND",
                 "schema": {"type": "string", "pattern": LABEL_FILTER}},
                {"name": "paused", "in": "query",
                 "schema": {"type": "string", "enum": ["true", "false"]}},
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {"name": "limit", "in": "query",
                 "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}}],
            "responses": _responses(200, "ScheduleList", 422)},
        ("GET", "/schedules/{id}"): {
            "summary": "one schedule", "responses": _responses(200, "Schedule", 404)},
        ("PUT", "/schedules/{id}"): {
            "summary": "replace a schedule", "description": _SEMANTIC,
            "parameters": [_IF_MATCH], "requestBody": _json_body("ScheduleFields"),
            "responses": _responses(200, "Schedule", *_WRITE, 404, 409)},
        ("PATCH", "/schedules/{id}"): {
            "summary": "change some fields (JSON merge patch: null removes a field)",
            "description": _SEMANTIC, "parameters": [_IF_MATCH],
            "requestBody": {"required": True, "content": {
                "application/merge-patch+json": {"schema": _ref("SchedulePatch")},
                "application/json": {"schema": _ref("SchedulePatch")}}},
            "responses": _responses(200, "Schedule", *_WRITE, 404, 409)},
        ("DELETE", "/schedules/{id}"): {
            "summary": "delete a schedule", "parameters": [_IF_MATCH],
            "responses": _responses(204, None, 400, 403, 404, 409, 429)},
        ("POST", "/schedules/{id}/pause"): {
            "summary": "pause", "parameters": [_IF_MATCH],
            "responses": _responses(200, "Schedule", 400, 403, 404, 409, 429)},
        ("POST", "/schedules/{id}/resume"): {
            "summary": "resume", "parameters": [_IF_MATCH],
            "responses": _responses(200, "Schedule", 400, 403, 404, 409, 429)},
        ("GET", "/schedules/{id}/next"): {
            "summary": "the next nominal and jittered fire times",
            "parameters": [
                {"name": "count", "in": "query",
                 "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PREVIEW}},
                {"name": "after", "in": "query",
                 "schema": {"type": "string", "format": "date-time"}}],
            "responses": _responses(200, "Preview", 404, 422)},
        ("GET", "/schedules/{id}/fires"): {
            "summary": "the fire ledger of a schedule, newest first (a skipped range is one "
                       "entry with last_nominal_at and count)",
            "parameters": [{"name": "limit", "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}}],
            "responses": _responses(200, None, 404, 422, 503)},
        ("GET", "/schedules/{id}/runs"): {
            "summary": "the runs of a schedule's fires, newest nominal time first; by=fire: "
                       "its latest fires, each with its ledger entries (fires) and its runs "
                       "counted by state (a fan-out fire has one of each per tenant)",
            "parameters": [{"name": "limit", "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}},
                           {"name": "by", "in": "query",
                            "schema": {"type": "string", "enum": ["fire"]}}],
            "responses": _responses(200, None, 404, 422, 503)},
        ("GET", "/runs"): {
            "summary": "runs, most recently changed first (state=dead: the dead letters)",
            "parameters": [
                {"name": "state", "in": "query", "schema": {
                    "type": "string", "enum": ["running", "succeeded", "retrying", "dead"]}},
                {"name": "after", "in": "query", "schema": {"type": "string"},
                 "description": "the next of the previous page: the fire id of its last run "
                                "(404 once that run has expired)"},
                {"name": "limit", "in": "query",
                 "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}}],
            "responses": _responses(200, "RunList", 404, 422, 503)},
        ("GET", "/runs/{id}"): {"summary": "one fire's run",
                                "responses": _responses(200, "Run", 404, 503)},
        ("POST", "/runs/{id}/retry"): {
            "summary": "replay a dead run: it is published again and runs with a fresh "
                       "attempt budget",
            "responses": _responses(202, "Run", 403, 404, 409, 429, 503)},
        ("GET", "/mirror/{id}"): {
            "summary": "what this replica's mirror holds for a schedule (revision, paused, "
                       "next nominal time)", "responses": _responses(200, None, 404)},
        ("GET", "/leader"): {"summary": "the lease: holder, term, expiry; who answered",
                             "responses": _responses(200, None, 503)},
        ("GET", "/cluster"): {"summary": "members seen recently (heartbeats)",
                              "responses": _responses(200, None, 503)},
        ("GET", "/dashboard"): {"summary": "what /ui shows: leader, members, schedules with "
                                           "their next fire, recent fires",
                                "responses": _responses(200, None, 503)},
        ("GET", "/healthz"): {"summary": "the process is alive (no token needed)",
                              "security": [], "responses": {"200": {"description": "alive"}}},
        ("GET", "/readyz"): {
            "summary": "the mirror is in sync (no token needed)", "security": [],
            "responses": {
                "200": {"description": "ready", "content": {
                    "application/json": {"schema": _ref("MirrorStatus")}}},
                "503": {"description": "not ready", "content": {
                    "application/json": {"schema": _ref("MirrorStatus")}}}}},
        ("GET", "/metrics"): {"summary": "Prometheus metrics (no token needed)", "security": [],
                              "responses": {"200": {"description": "text exposition format"}}},
        ("GET", "/ui"): {"summary": "the dashboard page (it asks for a token itself)",
                         "security": [], "responses": {"200": {"description": "HTML"}}},
        ("GET", "/openapi.json"): {"summary": "this document", "security": [],
                                   "responses": {"200": {"description": "OpenAPI 3.1"}}},
        ("GET", "/docs"): {"summary": "this document for a person", "security": [],
                           "responses": {"200": {"description": "HTML"}}},
    }


def _patch_schema(fields: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch of ScheduleFields: any of its fields, each also null (removed);
    an object-valued field (trigger, payload, labels) is itself a merge patch, any object."""
    def patched(schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") == "object" or "discriminator" in schema:
            return {"type": ["object", "null"]}
        return {"anyOf": [schema, {"type": "null"}]}

    return {"title": "SchedulePatch", "type": "object", "additionalProperties": False,
            "properties": {name: patched(schema)
                           for name, schema in fields["properties"].items()}}


@functools.cache
def openapi_spec(routes: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """The document for exactly these (method, path) routes, the ones the server serves:
    a route without an operation here is a KeyError, so the two cannot drift."""
    _, schemas = models_json_schema(
        [(m, "validation") for m in (models.ScheduleIn, models.ScheduleFields)]
        + [(m, "serialization") for m in (models.Schedule, models.ScheduleList,
                                          models.Preview, Problem, MirrorStatus, Run,
                                          RunList)],
        ref_template="#/components/schemas/{model}")
    definitions = schemas["$defs"]
    definitions["SchedulePatch"] = _patch_schema(definitions["ScheduleFields"])
    operations = _operations()
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes:
        item = paths.setdefault(path, {"parameters": [_ID]} if "{id}" in path else {})
        item[method.lower()] = operations[(method, path)]
    return {
        "openapi": "3.1.0",
        "info": {"title": "hascheduler", "version": __version__,
                 "description": "Schedules, fired exactly once by the cluster's leader."},
        "paths": paths,
        # Bearer tokens when the replicas have them (HASCHEDULER_*_TOKENS); none otherwise.
        "security": [{}, {"bearer": []}],
        "components": {"schemas": definitions, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "a read token for GET, a write token for changes"}}},
    }


DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>hascheduler API</title>
<style>body{font:15px/1.5 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}
code,pre{background:#f4f4f4;padding:.1rem .3rem}h2{margin-top:2rem}.m{font-weight:bold;
display:inline-block;width:4.5rem}</style></head>
<body><h1>hascheduler HTTP API</h1>
<p>The machine-readable description is <a href="/openapi.json">/openapi.json</a> (OpenAPI
3.1). Errors are JSON with <code>status</code>, <code>title</code> and
<code>errors[].field</code> naming what to fix.</p>
<div id="paths">loading…</div>
<script>
fetch('/openapi.json').then(r => r.json()).then(spec => {
  const out = [];
  for (const [path, item] of Object.entries(spec.paths)) {
    for (const [method, op] of Object.entries(item)) {
      if (method === 'parameters') continue;
      const codes = Object.keys(op.responses).join(', ');
      out.push(`<div><span class="m">${method.toUpperCase()}</span><code>${path}</code>
        — ${op.summary} <small>(${codes})</small></div>`);
    }
  }
  document.getElementById('paths').innerHTML = out.join('');
});
</script></body></html>
"""
