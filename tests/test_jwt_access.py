"""Bearer JWTs from an identity provider, with keys the tests generate: accepted when
signed by the key set, in time, for this audience; refused otherwise, and never costly."""

from __future__ import annotations

import base64
import datetime as dt
import json
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from pymongo import MongoClient

from hascheduler.api.access import Access, Action, Grant, JwtKeys
from tests.servers import ServerProcess, start_replica, with_database

AUDIENCE = "hascheduler"
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())
STRANGER = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def jwks(path: Path) -> Path:
    keys = [
        json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(RSA_KEY.public_key()))
        | {"kid": "rsa-1", "alg": "RS256", "use": "sig"},
        json.loads(jwt.algorithms.ECAlgorithm.to_jwk(EC_KEY.public_key()))
        | {"kid": "ec-1", "alg": "ES256", "use": "sig"},
    ]
    path.write_text(json.dumps({"keys": keys}))
    return path


def token(key: Any = RSA_KEY, algorithm: str = "RS256", kid: str = "rsa-1", **claims: Any) -> str:
    now = dt.datetime.now(dt.UTC)
    body = {
        "sub": "alice@example.com",
        "aud": AUDIENCE,
        "exp": now + dt.timedelta(minutes=5),
        "nbf": now - dt.timedelta(seconds=5),
        "hascheduler_actions": ["read", "pause"],
        "hascheduler_namespaces": "billing",
    } | claims
    return jwt.encode(
        {k: v for k, v in body.items() if v is not None},
        key,
        algorithm=algorithm,
        headers={"kid": kid},
    )


@pytest.fixture(scope="module")
def access(tmp_path_factory: pytest.TempPathFactory) -> Access:
    path = jwks(tmp_path_factory.mktemp("jwks") / "keys.json")
    return Access(jwt_keys=JwtKeys.load(str(path), AUDIENCE))


def test_jwts_signed_in_time_for_this_audience_are_grants(access: Access) -> None:
    expected = Grant(
        "jwt:alice@example.com", frozenset({Action.READ, Action.PAUSE}), frozenset({"billing"})
    )
    assert access.grant_of(token()) == expected
    assert access.grant_of(token(EC_KEY, "ES256", "ec-1")) == expected
    scoped = access.grant_of(token(hascheduler_actions=None, scope="read trigger fly"))
    assert scoped is not None
    assert scoped.actions == {Action.READ, Action.TRIGGER}


def _unsigned(claims: dict[str, Any]) -> str:
    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}."


@pytest.mark.parametrize(
    "bad",
    [
        "expired",
        "not yet valid",
        "wrong audience",
        "no audience",
        "wrong key",
        "alg none",
        "hs256 with the public key",
        "no subject",
        "no actions",
        "a megabyte",
        "not base64",
    ],
)
def test_refused_jwts(access: Access, bad: str) -> None:
    now = dt.datetime.now(dt.UTC)
    makers: dict[str, Callable[[], str]] = {
        "expired": lambda: token(exp=now - dt.timedelta(seconds=1)),
        "not yet valid": lambda: token(nbf=now + dt.timedelta(minutes=1)),
        "wrong audience": lambda: token(aud="another-service"),
        "no audience": lambda: token(aud=None),
        "wrong key": lambda: token(STRANGER),
        "alg none": lambda: _unsigned(
            {
                "sub": "mallory",
                "aud": AUDIENCE,
                "exp": int(now.timestamp()) + 300,
                "hascheduler_actions": ["admin"],
                "hascheduler_namespaces": ["*"],
            }
        ),
        "hs256 with the public key": lambda: _hs256_with_public_key(),
        "no subject": lambda: token(sub=None),
        "no actions": lambda: token(hascheduler_actions=["fly"]),
        "a megabyte": lambda: token(padding="x" * 1_000_000),
        "not base64": lambda: "a.b.c",
    }
    assert access.grant_of(makers[bad]()) is None


def _hs256_with_public_key() -> str:
    """The classic confusion: an HMAC signed with the RSA public key's bytes."""
    header = base64.urlsafe_b64encode(json.dumps({"alg": "HS256", "kid": "rsa-1"}).encode()).rstrip(
        b"="
    )
    body = base64.urlsafe_b64encode(
        json.dumps(
            {
                "sub": "mallory",
                "aud": AUDIENCE,
                "exp": 4102444800,
                "hascheduler_actions": ["admin"],
                "hascheduler_namespaces": ["*"],
            }
        ).encode()
    ).rstrip(b"=")
    import hashlib
    import hmac

    from cryptography.hazmat.primitives import serialization

    secret = RSA_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    signature = base64.urlsafe_b64encode(
        hmac.new(secret, header + b"." + body, hashlib.sha256).digest()
    ).rstrip(b"=")
    return (header + b"." + body + b"." + signature).decode()


@pytest.fixture(scope="module")
def guarded(mongo_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = jwks(tmp_path_factory.mktemp("jwks-replica") / "keys.json")
    db_name = f"jwt_{uuid.uuid4().hex[:8]}"
    replica = start_replica(
        with_database(mongo_uri, db_name),
        "jwt",
        "--jwks-file",
        str(path),
        "--jwt-audience",
        AUDIENCE,
        env={"HASCHEDULER_WRITE_TOKENS": "jwt-setup-token-01234"},
    )
    yield replica
    replica.stop(signal.SIGKILL)
    with MongoClient[dict[str, Any]](mongo_uri) as client:
        client.drop_database(db_name)


def test_a_replica_takes_jwts_and_refuses_hostile_ones(guarded: ServerProcess) -> None:
    with httpx.Client(base_url=guarded.uri) as http:
        setup = {"Authorization": "Bearer jwt-setup-token-01234"}
        assert (
            http.post(
                "/schedules",
                headers=setup,
                json={
                    "id": "inv",
                    "name": "inv",
                    "target": "billing.invoice",
                    "namespace": "billing",
                    "trigger": {"kind": "cron", "cron": "0 1 * * *"},
                },
            ).status_code
            == 201
        )
        alice = {"Authorization": f"Bearer {token()}"}
        assert http.get("/schedules/inv", headers=alice).status_code == 200
        paused = http.post("/schedules/inv/pause", headers=alice, json={})
        assert paused.status_code == 200
        assert paused.json()["pause"]["by"] == "jwt:alice@example.com"
        refused = http.delete("/schedules/inv", headers=alice)
        assert refused.status_code == 403
        assert "jwt:alice@example.com may not write" in refused.json()["title"]
        expired = token(exp=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
        assert (
            http.get("/schedules/inv", headers={"Authorization": f"Bearer {expired}"}).status_code
            == 401
        )
        huge = http.get(
            "/schedules/inv", headers={"Authorization": "Bearer " + "a" * 500_000 + ".b.c"}
        )
        assert huge.status_code in (400, 431)  # the server's header limit, before us
        assert http.get("/healthz").status_code == 200  # and the replica is still there
