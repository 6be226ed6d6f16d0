"""Every route x every action, in and out of the token's namespace, generated from the
route table: a route added without a guard, or whose guard does not reach the namespace
of what it touches, fails here."""

from __future__ import annotations

import datetime as dt
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from pymongo import MongoClient

from hascheduler.api import guards
from hascheduler.api.access import ACTIONS, Action, create_token, entry_line
from hascheduler.api.route import Route
from hascheduler.api.routes import ROUTES
from tests.servers import ServerProcess, start_replica, with_database
from tests.waiting import wait_until_sync

OPEN_PATHS = {"/metrics", "/ui", "/healthz", "/readyz", "/openapi.json", "/docs"}
ADMIN_TOKEN = "matrix-setup-token-0123"
HOME, OTHER = "team-a", "team-b"
RESOURCE_SCOPES = (guards.SCHEDULE, guards.FIRE, guards.BACKFILL, guards.WEBHOOK)


@dataclass
class Cluster:
    url: str
    secrets: dict[tuple[Action, str], str]  # (action, namespace) -> token
    ids: dict[str, str]  # scope -> an id of that kind in HOME


# In HOME's data only (a payload, a webhook's URL, a fire run now's payload): no answer to
# a token of OTHER, nor to none, may hold it.
MARK = f"home-only-{uuid.uuid4().hex}"


def _schedule(schedule_id: str, namespace: str = HOME) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "name": schedule_id,
        "target": "matrix.job",
        "namespace": namespace,
        "trigger": {"kind": "cron", "cron": "0 3 * * *", "timezone": "UTC"},
        "payload": {"mark": MARK},
    }


@pytest.fixture(scope="module")
def cluster(mongo_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tokens = {
        (action, ns): create_token(f"{action.value}-{ns}", frozenset({action}), frozenset({ns}))
        for action in ACTIONS
        for ns in (HOME, OTHER)
    }
    path = tmp_path_factory.mktemp("matrix") / "access.yaml"
    path.write_text("tokens:\n" + "".join(entry_line(t.entry) + "\n" for t in tokens.values()))
    db_name = f"matrix_{uuid.uuid4().hex[:8]}"
    replica = start_replica(
        with_database(mongo_uri, db_name),
        "matrix",
        "--write-rate",
        "0",
        "--access-file",
        str(path),
        env={"HASCHEDULER_WRITE_TOKENS": ADMIN_TOKEN},
    )
    try:
        yield Cluster(replica.uri, {k: t.secret for k, t in tokens.items()}, _resources(replica))
    finally:
        replica.stop(signal.SIGKILL)
        with MongoClient[dict[str, Any]](mongo_uri) as client:
            client.drop_database(db_name)


def _resources(replica: ServerProcess) -> dict[str, str]:
    """A schedule in HOME, one of its fires and one of its backfills."""
    with httpx.Client(
        base_url=replica.uri, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as http:
        assert http.post("/schedules", json=_schedule("home")).status_code == 201
        assert http.post("/schedules", json=_schedule("home-gone")).status_code == 201
        wait_until_sync(lambda: http.get("/readyz").status_code == 200, 30, "the replica ready")
        fire = http.post("/schedules/home/trigger", json={"payload": {"mark": MARK}}).json()[
            "fire_id"
        ]
        end = dt.datetime.now(dt.UTC).replace(microsecond=0)
        backfill = http.post(
            "/schedules/home/backfill",
            json={"start": (end - dt.timedelta(days=2)).isoformat(), "end": end.isoformat()},
        )
        assert backfill.status_code == 202, backfill.text
        hook = http.post("/webhooks", json=_webhook())
        assert hook.status_code == 201, hook.text
    return {
        guards.SCHEDULE: "home",
        guards.FIRE: fire,
        guards.BACKFILL: backfill.json()["id"],
        guards.WEBHOOK: hook.json()["id"],
    }


def _webhook() -> dict[str, Any]:
    return {
        "url": f"http://hooks.example.com/hook/{MARK}",
        "events": ["run.dead"],
        "namespace": HOME,
    }


def _backfill() -> dict[str, Any]:
    end = dt.datetime.now(dt.UTC).replace(microsecond=0)
    return {"start": (end - dt.timedelta(days=1)).isoformat(), "end": end.isoformat()}


# The body of every route that takes one: a route added with a body and no row here fails
# test_every_route_taking_a_body_has_a_row.
BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/schedules"): lambda: _schedule(f"new-{uuid.uuid4().hex[:8]}"),
    ("POST", "/schedules:batch"): lambda: {"schedules": [_schedule(f"new-{uuid.uuid4().hex[:8]}")]},
    ("PUT", "/schedules/{id}"): lambda: {k: v for k, v in _schedule("home").items() if k != "id"},
    ("PATCH", "/schedules/{id}"): lambda: {"jitter": 1},
    ("POST", "/schedules/{id}/pause"): lambda: {"note": "matrix"},
    ("POST", "/schedules/{id}/trigger"): lambda: {},
    ("POST", "/schedules/{id}/backfill"): _backfill,
    ("POST", "/schedules/{id}/restore"): lambda: {"revision": 1},
    ("POST", "/webhooks"): _webhook,
}


def _request(route: Route, ids: dict[str, str]) -> dict[str, Any]:
    """The request for ``route`` against HOME's resources."""
    path = route.path.replace("{id}", ids.get(route.guard.scope, "home"))
    params = {"namespace": HOME} if route.guard.scope == guards.LISTING else {}
    row = BODIES.get((route.method, route.path))
    body: Any = row() if row is not None else ({} if route.method != "GET" else None)
    return {"method": route.method, "url": path, "params": params, "json": body}


def test_every_route_taking_a_body_has_a_row() -> None:
    assert set(BODIES) == {(r.method, r.path) for r in ROUTES if "requestBody" in r.operation}


def test_no_answer_outside_home_holds_a_trace_of_homes_data(cluster: Cluster) -> None:
    """Every route, as every token of OTHER and as none: no answer (a refusal, a list, the
    dashboard, the open routes) holds anything of HOME's data."""
    tried = 0
    with httpx.Client(base_url=cluster.url, timeout=30) as http:
        home = {"Authorization": f"Bearer {cluster.secrets[Action.READ, HOME]}"}
        for seen in ("/schedules/home", f"/webhooks/{cluster.ids[guards.WEBHOOK]}"):
            assert MARK in http.get(seen, headers=home).text  # the mark is there to find
        for route in sorted(ROUTES, key=lambda r: r.method == "DELETE"):
            for headers in [
                {},
                *(
                    {"Authorization": f"Bearer {cluster.secrets[action, OTHER]}"}
                    for action in ACTIONS
                ),
            ]:
                request = _request(route, cluster.ids)
                if route.guard.scope == guards.LISTING:
                    request["params"] = {}
                answer = http.request(**request, headers=headers)
                where = f"{route.method} {route.path} as {headers or 'nobody'}"
                assert answer.status_code < 500, f"{where}: {answer.status_code}"
                assert MARK not in answer.text, where
                tried += 1
    assert tried == len(ROUTES) * (len(ACTIONS) + 1)


def _guarded() -> list[Route]:
    unguarded = [r.path for r in ROUTES if r.guard.action is None and r.path not in OPEN_PATHS]
    assert not unguarded, f"routes without an action: {unguarded}"
    # Deleting last (the schedule last of all): what the others touch must still be there.
    return sorted(
        (r for r in ROUTES if r.guard.action is not None),
        key=lambda r: (r.method == "DELETE", r.path == "/schedules/{id}"),
    )


def _allowed(route: Route, action: Action) -> bool:
    return action in (route.guard.action, Action.ADMIN)


def test_every_route_refuses_every_other_action_and_namespace(cluster: Cluster) -> None:
    checked = 0
    with httpx.Client(base_url=cluster.url) as http:
        for route in _guarded():
            for action in ACTIONS:
                for namespace in (HOME, OTHER):
                    if _allowed(route, action) and (
                        namespace == HOME or route.guard.scope == guards.CLUSTER_WIDE
                    ):
                        continue
                    answer = http.request(
                        **_request(route, cluster.ids),
                        headers={"Authorization": f"Bearer {cluster.secrets[action, namespace]}"},
                    )
                    where = f"{route.method} {route.path} as {action.value} in {namespace}"
                    title = answer.json()["title"]
                    if _allowed(route, action) and route.guard.scope in RESOURCE_SCOPES:
                        # Another namespace's resource: as if nobody had used its id.
                        assert answer.status_code == 404, f"{where}: {answer.status_code}"
                        assert HOME not in answer.text, f"{where}: {answer.text}"
                    else:
                        assert answer.status_code == 403, f"{where}: {answer.status_code}"
                        assert route.guard.action is not None
                        assert f"may not {route.guard.action.value}" in title, f"{where}: {title}"
                        if _allowed(route, action):  # refused in its namespace: named
                            assert HOME in title, f"{where}: {title}"
                    checked += 1
    assert checked > len(_guarded()) * (len(ACTIONS) - 2)


def test_another_namespaces_resource_answers_as_an_unused_id_does(cluster: Cluster) -> None:
    """A token reaching the action but not the namespace gets, for each of HOME's
    resources, the very answer it gets for an id nobody used: it cannot learn that the
    resource exists, nor where."""
    compared = 0
    with httpx.Client(base_url=cluster.url) as http:
        for route in _guarded():
            if route.guard.scope not in RESOURCE_SCOPES:
                continue
            assert route.guard.action is not None
            headers = {"Authorization": f"Bearer {cluster.secrets[route.guard.action, OTHER]}"}
            home = cluster.ids[route.guard.scope]
            unused = (
                home.replace("home", "none", 1) if "home" in home else uuid.uuid4().hex[: len(home)]
            )
            hidden = http.request(**_as_other(_request(route, cluster.ids)), headers=headers)
            absent = http.request(
                **_as_other(_request(route, {**cluster.ids, route.guard.scope: unused})),
                headers=headers,
            )
            where = f"{route.method} {route.path}"
            assert hidden.status_code == absent.status_code == 404, f"{where}: {hidden.text}"
            assert hidden.text.replace(home, "ID") == absent.text.replace(unused, "ID"), where
            compared += 1
    assert compared >= 15


def _as_other(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` with a body naming OTHER, the caller's own namespace."""
    body = request["json"]
    if isinstance(body, dict) and body.get("namespace") == HOME:
        return {**request, "json": {**body, "namespace": OTHER}}
    return request


def test_every_route_lets_its_action_through_in_its_namespace(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.url) as http:
        for route in _guarded():
            for action in dict.fromkeys((route.guard.action, Action.ADMIN)):
                assert action is not None
                answer = http.request(
                    **_request(route, cluster.ids),
                    headers={"Authorization": f"Bearer {cluster.secrets[action, HOME]}"},
                )
                assert answer.status_code not in (401, 403), (
                    f"{route.method} {route.path} as {action.value}: {answer.status_code} "
                    f"{answer.text}"
                )


def test_lists_show_only_the_namespaces_a_token_reaches(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.url) as http:
        home = {"Authorization": f"Bearer {cluster.secrets[Action.READ, HOME]}"}
        other = {"Authorization": f"Bearer {cluster.secrets[Action.READ, OTHER]}"}
        assert {s["namespace"] for s in http.get("/schedules", headers=home).json()["items"]} == {
            HOME
        }
        assert http.get("/schedules", headers=other).json()["items"] == []
        assert http.get("/audit", headers=other).json()["items"] == []
        assert http.get("/audit", headers=home).json()["items"]
        assert http.get("/dashboard", headers=other).json()["schedules"] == []
        refused = http.get("/schedules", params={"namespace": "a/b"}, headers=home)
        assert refused.status_code == 422
        assert refused.json()["errors"][0]["field"] == "namespace"


def test_a_schedule_cannot_be_moved_into_a_namespace_the_token_does_not_reach(
    cluster: Cluster,
) -> None:
    with httpx.Client(base_url=cluster.url) as http:
        home = {"Authorization": f"Bearer {cluster.secrets[Action.WRITE, HOME]}"}
        assert http.post("/schedules", json=_schedule("movable"), headers=home).status_code == 201
        moved = http.patch("/schedules/movable", json={"namespace": OTHER}, headers=home)
        assert moved.status_code == 403
        assert moved.json()["namespace"] == OTHER
        bad = http.post("/schedules", json=_schedule("x", namespace="../etc"), headers=home)
        assert bad.status_code == 422
        assert bad.json()["errors"][0]["field"] == "namespace"


def test_the_fires_of_a_deleted_schedule_stay_in_its_namespace(cluster: Cluster) -> None:
    """A fire keeps its schedule's namespace for life: after the delete, its namespace's
    readers still read it, and no other namespace's do."""
    with httpx.Client(base_url=cluster.url) as http:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        fire = http.post("/schedules/home-gone/trigger", json={}, headers=admin).json()["fire_id"]
        assert http.delete("/schedules/home-gone", headers=admin).status_code == 204
        home = {"Authorization": f"Bearer {cluster.secrets[Action.READ, HOME]}"}
        other = {"Authorization": f"Bearer {cluster.secrets[Action.READ, OTHER]}"}
        assert http.get(f"/fires/{fire}", headers=home).status_code == 200
        answer = http.get(f"/fires/{fire}", headers=other)
        assert answer.status_code == 404
        assert HOME not in answer.text
        assert http.get(f"/fires/{fire}", headers=admin).status_code == 200


def test_the_route_table_is_what_the_server_serves() -> None:
    """Each route's action is in its OpenAPI operation too (x-action)."""
    from hascheduler.api.routes import _document

    operations = {
        (m.upper(), p): op for p, item in _document()["paths"].items() for m, op in item.items()
    }
    for route in ROUTES:
        action = route.guard.action.value if route.guard.action else None
        assert operations[route.method, route.path]["x-action"] == action
