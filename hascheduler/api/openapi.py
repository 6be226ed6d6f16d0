"""OpenAPI 3.1 for the HTTP API, generated from the pydantic models, and a docs page."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from .. import __version__, models


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
           404: "no such schedule",
           409: "id taken, or the revision in If-Match is not current",
           413: "body too large", 415: "body is not application/json",
           422: "invalid schedule or parameter; names the field",
           429: "too many writes from this client; see Retry-After", 503: "not ready"}

_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_IF_MATCH = {"name": "If-Match", "in": "header", "required": False,
             "schema": {"type": "string"},
             "description": "the revision from the ETag; the write fails with 409 if stale"}


@functools.cache
def openapi_spec() -> dict[str, Any]:
    _, schemas = models_json_schema(
        [(m, "validation") for m in (models.ScheduleIn, models.ScheduleFields)]
        + [(m, "serialization") for m in (models.Schedule, models.ScheduleList,
                                          models.Preview, Problem, MirrorStatus)],
        ref_template="#/components/schemas/{model}")
    write = (400, 403, 413, 415, 422, 429)
    return {
        "openapi": "3.1.0",
        "info": {"title": "hascheduler", "version": __version__,
                 "description": "Schedules, fired exactly once by the cluster's leader."},
        "paths": {
            "/schedules": {
                "post": {"summary": "create a schedule", "requestBody": _json_body("ScheduleIn"),
                         "responses": _responses(201, "Schedule", *write, 409)},
                "get": {"summary": "list schedules (id order, cursor pagination)",
                        "parameters": [
                            {"name": "label", "in": "query", "schema": {"type": "string"},
                             "description": "key=value; repeat to AND"},
                            {"name": "paused", "in": "query",
                             "schema": {"type": "string", "enum": ["true", "false"]}},
                            {"name": "after", "in": "query", "schema": {"type": "string"}},
                            {"name": "limit", "in": "query",
                             "schema": {"type": "integer", "minimum": 1, "maximum": 500}}],
                        "responses": _responses(200, "ScheduleList", 422)},
            },
            "/schedules/{id}": {
                "parameters": [_ID],
                "get": {"summary": "one schedule", "responses": _responses(200, "Schedule", 404)},
                "put": {"summary": "replace a schedule", "parameters": [_IF_MATCH],
                        "requestBody": _json_body("ScheduleFields"),
                        "responses": _responses(200, "Schedule", *write, 404, 409)},
                "patch": {"summary": "change some fields (JSON merge patch)",
                          "parameters": [_IF_MATCH],
                          "requestBody": {"required": True, "content": {
                              "application/merge-patch+json": {"schema": {"type": "object"}},
                              "application/json": {"schema": {"type": "object"}}}},
                          "responses": _responses(200, "Schedule", *write, 404, 409)},
                "delete": {"summary": "delete a schedule", "parameters": [_IF_MATCH],
                           "responses": _responses(204, None, 400, 403, 404, 409, 429)},
            },
            "/schedules/{id}/pause": {"parameters": [_ID], "post": {
                "summary": "pause", "parameters": [_IF_MATCH],
                "responses": _responses(200, "Schedule", 400, 403, 404, 409, 429)}},
            "/schedules/{id}/resume": {"parameters": [_ID], "post": {
                "summary": "resume", "parameters": [_IF_MATCH],
                "responses": _responses(200, "Schedule", 400, 403, 404, 409, 429)}},
            "/schedules/{id}/next": {"parameters": [_ID], "get": {
                "summary": "the next nominal and jittered fire times",
                "parameters": [
                    {"name": "count", "in": "query",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                    {"name": "after", "in": "query",
                     "schema": {"type": "string", "format": "date-time"}}],
                "responses": _responses(200, "Preview", 404, 422)}},
            "/schedules/{id}/fires": {"parameters": [_ID], "get": {
                "summary": "the fire ledger of a schedule, newest first",
                "parameters": [{"name": "limit", "in": "query",
                                "schema": {"type": "integer", "minimum": 1, "maximum": 500}}],
                "responses": _responses(200, None, 422, 503)}},
            "/leader": {"get": {"summary": "the lease: holder, term, expiry; who answered",
                                "responses": _responses(200, None, 503)}},
            "/cluster": {"get": {"summary": "members seen recently (heartbeats)",
                                 "responses": _responses(200, None, 503)}},
            "/dashboard": {"get": {"summary": "what /ui shows: leader, members, schedules "
                                              "with their next fire, recent fires",
                                   "responses": _responses(200, None, 503)}},
            "/healthz": {"get": {"summary": "the process is alive (no token needed)",
                                 "security": [],
                                 "responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"summary": "the mirror is in sync (no token needed)",
                                "security": [],
                                "responses": {"200": {"description": "ready", "content": {
                                    "application/json": {"schema": _ref("MirrorStatus")}}},
                                    "503": {"description": "not ready", "content": {
                                        "application/json": {
                                            "schema": _ref("MirrorStatus")}}}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (no token needed)",
                                 "security": [], "responses": {"200": {
                                     "description": "text exposition format"}}}},
            "/ui": {"get": {"summary": "the dashboard page (it asks for a token itself)",
                            "security": [], "responses": {"200": {"description": "HTML"}}}},
        },
        # Bearer tokens when the replicas have them (HASCHEDULER_*_TOKENS); none otherwise.
        "security": [{}, {"bearer": []}],
        "components": {"schemas": schemas["$defs"], "securitySchemes": {
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
