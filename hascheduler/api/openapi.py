"""OpenAPI 3.1 for the HTTP API, generated from the pydantic models, and a docs page."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from hascheduler import __version__
from hascheduler.api.run_view import Run, RunList
from hascheduler.core import fields, models
from hascheduler.core.constants import MAX_IDEMPOTENCY_KEY_CHARS
from hascheduler.core.health import ScheduleHealth
from hascheduler.storage.backfills import Backfill


class Problem(BaseModel):
    status: int
    title: str
    errors: list[dict[str, str]] = Field(
        default_factory=list, description="each with 'field' (a dotted path) and 'message'"
    )


class SourcesStatus(BaseModel):
    count: int = Field(description="fan-out sources mirrored")
    digest: str = Field(description="of all their copies: equal on replicas in sync")


class MirrorStatus(BaseModel):
    ready: bool
    size: int
    digest: str
    last_applied_cluster_time: dict[str, Any] | None
    replica_id: str
    sources: SourcesStatus | None = Field(
        None, description="the fan-out sources' mirrors (never their names)"
    )
    sources_ready: bool | None = None


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": ref(name)}}}


def responses(ok: int, name: str | None, *errors: int) -> dict[str, Any]:
    out: dict[str, Any] = {str(ok): {"description": "success"}}
    if name:
        out[str(ok)]["content"] = {"application/json": {"schema": ref(name)}}
    for code in (*errors, 401):  # 401 from any route but the open ones, when tokens are set
        out[str(code)] = {
            "description": _ERRORS[code],
            "content": {"application/json": {"schema": ref("Problem")}},
        }
    return out


_ERRORS = {
    400: "malformed request (JSON, If-Match, a query parameter the route does not take)",
    401: "a token is configured and this request has none, or a wrong one",
    403: "the token has the read scope; writes need the write scope",
    404: "no such schedule (or run)",
    409: "id taken, the revision in If-Match is not current, or the run is not dead",
    413: "body too large",
    415: "body is not application/json",
    422: "invalid schedule or parameter; names the field",
    429: "too many writes from this client; see Retry-After",
    503: "not ready",
}

# If-Match as the server reads it (app.py parses with this very pattern): "*", or a
# revision as the ETag gives it, optionally weak and quoted.
IF_MATCH = re.compile(r'\s*(?:\*|(?:W/)?"?([1-9][0-9]{0,17})"?)\s*')
# ?label=key=value, as the server splits it: a label key (a slug) and any value.
LABEL_FILTER = rf"^{fields.SLUG.pattern}=[\s\S]*$"

ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
NAMESPACE_PARAM = {
    "name": "namespace",
    "in": "query",
    "required": False,
    "schema": {"type": "string", "pattern": f"^{fields.NAMESPACE.pattern}$"},
    "description": "one namespace (the token must reach it); without it, every namespace "
    "the token reaches",
}
IF_MATCH_HEADER = {
    "name": "If-Match",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "pattern": f"^{IF_MATCH.pattern}$"},
    "description": "the revision from the ETag; the write fails with 409 if stale",
}
IDEMPOTENCY_KEY_HEADER = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "pattern": f"^[\\x21-\\x7e]{{1,{MAX_IDEMPOTENCY_KEY_CHARS}}}$"},
    "description": "a retried request with the same key (within 24 hours at least) answers "
    "with the first one's fire instead of firing again",
}
WRITE = (400, 403, 413, 415, 422, 429)
SEMANTIC = (
    "Besides its shape, the body must describe a schedule that can fire: a cron "
    "expression that parses and has a day it fires on, instants in the future, no "
    "more often than the cluster's floor, a catch-up window it can replay. Each "
    "refusal is a 422 naming the field."
)


def _patch_schema(fields: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch of ScheduleFields: any of its fields, each also null (removed);
    an object-valued field (trigger, payload, labels) is itself a merge patch, any object."""

    def patched(schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") == "object" or "discriminator" in schema:
            return {"type": ["object", "null"]}
        return {"anyOf": [schema, {"type": "null"}]}

    return {
        "title": "SchedulePatch",
        "type": "object",
        "additionalProperties": False,
        "properties": {name: patched(schema) for name, schema in fields["properties"].items()},
    }


def document(routes: list[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    """The document of these routes, each (method, path, operation): the server's own
    route table (api/routes.py)."""
    _, schemas = models_json_schema(
        [
            (m, "validation")
            for m in (
                models.ScheduleIn,
                models.ScheduleFields,
                models.ScheduleBatchIn,
                models.TriggerIn,
                models.PauseIn,
                models.BackfillIn,
                models.RestoreIn,
                models.WebhookIn,
            )
        ]
        + [
            (m, "serialization")
            for m in (
                models.Schedule,
                models.ScheduleList,
                models.Preview,
                Problem,
                MirrorStatus,
                Run,
                RunList,
                models.Triggered,
                Backfill,
                models.BatchCreated,
                ScheduleHealth,
                models.Webhook,
                models.WebhookList,
            )
        ],
        ref_template="#/components/schemas/{model}",
    )
    definitions = schemas["$defs"]
    definitions["SchedulePatch"] = _patch_schema(definitions["ScheduleFields"])
    paths: dict[str, dict[str, Any]] = {}
    for method, path, operation in routes:
        item = paths.setdefault(path, {"parameters": [ID]} if "{id}" in path else {})
        # Every route refuses a query parameter it does not take (app.known_query).
        unknown = {
            "description": "a query parameter the route does not take",
            "content": {"application/json": {"schema": ref("Problem")}},
        }
        item[method.lower()] = {
            **operation,
            "responses": {"400": unknown, **operation["responses"]},
        }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "hascheduler",
            "version": __version__,
            "description": "Schedules, fired exactly once by the cluster's leader.",
        },
        "paths": paths,
        # Bearer tokens when the replicas have them (HASCHEDULER_*_TOKENS); none otherwise.
        "security": [{}, {"bearer": []}],
        "components": {
            "schemas": definitions,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a read token for GET, a write token for changes",
                }
            },
        },
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
