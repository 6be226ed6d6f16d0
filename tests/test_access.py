"""Access control: token scopes, the loopback-only default, 401/403/413/429, and TLS to
MongoDB and NATS. Pure logic first, then real replica processes."""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from hascheduler.api.access import (
    ANONYMOUS,
    MAX_TRACKED_CLIENTS,
    Access,
    AccessConfigError,
    Action,
    Denied,
    Grant,
    WriteLimit,
    WriteLimiter,
    authenticate,
    create_token,
    entry_line,
    legacy_grants,
)
from hascheduler.api.access_file import AccessFile, with_file
from hascheduler.brokers.nats.reader import read_stream
from tests.servers import ServerProcess, start_devmongo, start_nats, start_replica, with_database
from tests.waiting import wait_until

READ = "r" * 20
WRITE = "w" * 20
OTHER_WRITE = "x" * 24


# --- grants ---------------------------------------------------------------------------------


def test_todays_variables_are_tokens_named_read_n_and_write_n(tmp_path: Path) -> None:
    write_file = tmp_path / "write"
    write_file.write_text(f"# rotated on Monday\n{OTHER_WRITE}\n\n")
    access = Access(
        legacy=legacy_grants(
            {
                "HASCHEDULER_READ_TOKENS": f"{READ}, {'q' * 16}",
                "HASCHEDULER_WRITE_TOKENS": WRITE,
                "HASCHEDULER_WRITE_TOKENS_FILE": str(write_file),
            }
        )
    )
    write, other, read = (access.grant_of(t) for t in (WRITE, OTHER_WRITE, READ))
    assert write is not None
    assert other is not None
    assert read is not None
    assert (write.name, other.name, read.name) == ("write-1", "write-2", "read-1")
    assert all(write.allows(a, "any-namespace") for a in Action)  # today's meaning
    assert read.allows(Action.READ, "billing")
    assert not read.can(Action.WRITE)
    assert access.grant_of(WRITE + "x") is None
    assert access.grant_of("") is None
    assert not Access().enabled


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"HASCHEDULER_WRITE_TOKENS": "short"},
            "HASCHEDULER_WRITE_TOKENS: every token needs at least 16 characters",
        ),
        (
            {"HASCHEDULER_WRITE_TOKENS": "CHANGE-ME-write-token"},
            "HASCHEDULER_WRITE_TOKENS: a token still says CHANGE-ME",
        ),
        (
            {"HASCHEDULER_READ_TOKENS_FILE": "/nonexistent/tokens"},
            "HASCHEDULER_READ_TOKENS_FILE: cannot read /nonexistent/tokens",
        ),
    ],
)
def test_unusable_token_settings_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(AccessConfigError, match=message):
        legacy_grants(env)


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "write"
    empty.write_text("# nothing yet\n")
    with pytest.raises(AccessConfigError, match="holds no token"):
        legacy_grants({"HASCHEDULER_WRITE_TOKENS_FILE": str(empty)})


def access_file(path: Path, *entries: dict[str, object], namespaces: str = "") -> Path:
    path.write_text("tokens:\n" + "".join(entry_line(e) + "\n" for e in entries) + namespaces)
    return path


def test_named_tokens_are_stored_hashed_and_grant_their_actions_and_namespaces(
    tmp_path: Path,
) -> None:
    billing = create_token(
        "billing-ci", frozenset({Action.READ, Action.TRIGGER}), frozenset({"billing"})
    )
    path = access_file(tmp_path / "access.yaml", billing.entry)
    assert billing.secret not in path.read_text()  # only a salted hash is kept
    assert billing.secret[21:] not in path.read_text()  # the part after hst_<id>_
    access = with_file(Access(), str(path))
    grant = access.grant_of(billing.secret)
    assert grant == Grant(
        "billing-ci", frozenset({Action.READ, Action.TRIGGER}), frozenset({"billing"})
    )
    assert grant.allows(Action.TRIGGER, "billing")
    assert not grant.allows(Action.TRIGGER, "payroll")
    assert not grant.allows(Action.WRITE, "billing")
    forged = billing.secret[:-1] + ("A" if billing.secret[-1] != "A" else "B")
    assert access.grant_of(forged) is None
    admin = Grant("ops", frozenset({Action.ADMIN}), frozenset({"*"}))
    assert all(admin.allows(a, "anything") for a in Action)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("tokens: [{name: x}]\n", "name, id, salt, hash, actions, namespaces"),
        ("other: 1\n", "'tokens' and 'namespaces' only"),
        ("tokens: [\n", "--access-file"),
        ("namespaces: {'a/b': {}}\n", "not a namespace name"),
        ("namespaces: {billing: {max_schedules: -1}}\n", "max_schedules is a whole number"),
        (
            "namespaces: {billing: {quota: 1}}\n",
            "max_fan_out, max_fires_per_second, max_schedules, require_reason only",
        ),
        ("namespaces: {billing: {max_fires_per_second: 0}}\n", "a number above 0"),
        ("namespaces: {billing: {max_fan_out: 1.5}}\n", "max_fan_out is a whole number"),
    ],
)
def test_a_bad_access_file_is_refused_naming_what(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "access.yaml"
    path.write_text(content)
    with pytest.raises(AccessConfigError, match=re.escape(message)):
        with_file(Access(), str(path))


def test_the_access_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    first = create_token("first", frozenset({Action.READ}), frozenset({"a"}))
    second = create_token("second", frozenset({Action.READ}), frozenset({"b"}))
    path = access_file(tmp_path / "access.yaml", first.entry)
    watched = AccessFile(Access(), str(path))
    assert watched.current.grant_of(first.secret) is not None
    assert not watched.reload_if_changed()
    access_file(tmp_path / "next.yaml", second.entry).replace(path)  # as a Secret swaps it
    assert watched.reload_if_changed()
    assert watched.current.grant_of(first.secret) is None  # revoked
    assert watched.current.grant_of(second.secret) is not None
    path.write_text("tokens: [\n")  # a broken edit keeps what was in force
    assert not watched.reload_if_changed()
    assert watched.current.grant_of(second.secret) is not None


def test_ten_thousand_tokens_are_looked_up_by_id(tmp_path: Path) -> None:
    tokens = [
        create_token(f"t{i}", frozenset({Action.READ}), frozenset({"a"})) for i in range(10_000)
    ]
    access = with_file(
        Access(), str(access_file(tmp_path / "access.yaml", *(t.entry for t in tokens)))
    )
    assert len(access.named) == 10_000
    assert access.grant_of(tokens[-1].secret) == Grant(
        "t9999", frozenset({Action.READ}), frozenset({"a"})
    )
    assert access.grant_of(tokens[0].secret.replace("_", "-")) is None


@pytest.mark.parametrize(
    ("header", "status", "title"),
    [
        (None, 401, "this API needs a token"),
        ("Basic abc", 401, "must be 'Bearer <token>'"),
        ("Bearer ", 401, "must be 'Bearer <token>'"),
        (f"Bearer {WRITE}x", 401, "the token is not valid"),
        (f"Bearer {READ}", None, "read-1"),
        (f"bearer {WRITE}", None, "write-1"),
    ],
)
def test_authenticate(header: str | None, status: int | None, title: str) -> None:
    found = authenticate(
        Access(
            legacy=legacy_grants(
                {"HASCHEDULER_READ_TOKENS": READ, "HASCHEDULER_WRITE_TOKENS": WRITE}
            )
        ),
        header,
    )
    if status is None:
        assert isinstance(found, Grant)
        assert found.name == title
    else:
        assert isinstance(found, Denied)
        assert (found.status, "WWW-Authenticate" in found.headers) == (status, True)
        assert title in found.title


def test_without_tokens_everyone_is_anonymous() -> None:
    assert authenticate(Access(), None) is ANONYMOUS


# --- the write limiter ----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_write_limiter_allows_a_burst_then_the_rate() -> None:
    clock = FakeClock()
    limiter = WriteLimiter(WriteLimit(per_second=2, burst=3), clock)
    assert [limiter.take("a") for _ in range(3)] == [0, 0, 0]
    assert limiter.take("a") == pytest.approx(0.5)
    assert limiter.take("b") == 0  # per client
    clock.now += 0.5
    assert limiter.take("a") == 0
    assert limiter.take("a") == pytest.approx(0.5)
    clock.now += 60
    assert [limiter.take("a") for _ in range(4)][:3] == [0, 0, 0]  # refilled to the burst


def test_write_limiter_off_and_bounded() -> None:
    off = WriteLimiter(WriteLimit(per_second=0))
    assert all(off.take("a") == 0 for _ in range(10_000))
    limiter = WriteLimiter(WriteLimit(per_second=1, burst=1), FakeClock())
    for i in range(MAX_TRACKED_CLIENTS + 10):
        limiter.take(f"10.0.{i // 256}.{i % 256}")
    assert len(limiter._buckets) == MAX_TRACKED_CLIENTS


@pytest.mark.parametrize(("rate", "burst"), [(-1, 10), (float("nan"), 10), (5, 0)])
def test_write_limit_settings_are_validated(rate: float, burst: int) -> None:
    with pytest.raises(AccessConfigError):
        WriteLimit(per_second=rate, burst=burst)


# --- a real replica with tokens -------------------------------------------------------------


@pytest.fixture
def guarded(mongo_uri: str, tmp_path: Path) -> Iterator[ServerProcess]:
    """Write tokens from a file (as a mounted Secret), read tokens from the environment,
    listening on every address, two writes per second in bursts of 5."""
    write_file = tmp_path / "write-tokens"
    write_file.write_text(WRITE + "\n")
    process = start_replica(
        with_database(mongo_uri, f"access_{uuid.uuid4().hex[:8]}"),
        "guarded",
        "--broker",
        "log:",
        "--http-host",
        "0.0.0.0",
        "--write-rate",
        "2",
        "--write-burst",
        "5",
        env={"HASCHEDULER_WRITE_TOKENS_FILE": str(write_file), "HASCHEDULER_READ_TOKENS": READ},
    )
    yield process
    assert process.stop() == 0


def _schedule(sid: str) -> dict[str, object]:
    return {
        "id": sid,
        "name": sid,
        "target": "access.test",
        "trigger": {"kind": "cron", "cron": "0 9 * * 1"},
    }


async def test_tokens_guard_a_real_replica(guarded: ServerProcess) -> None:
    assert guarded.uri.startswith("http://0.0.0.0:")  # tokens: listens where asked
    api = guarded.uri.replace("0.0.0.0", "127.0.0.1")
    read = {"Authorization": f"Bearer {READ}"}
    write = {"Authorization": f"Bearer {WRITE}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{api}/schedules") as r:
            assert r.status == 401
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            assert "needs a token" in (await r.json())["title"]
        async with http.post(f"{api}/schedules", json=_schedule("a")) as r:
            assert r.status == 401
        async with http.post(f"{api}/schedules", json=_schedule("a"), headers=read) as r:
            assert r.status == 403
            assert "read-1 may not write" in (await r.json())["title"]
        async with http.get(f"{api}/schedules", headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
            assert (await r.json())["title"] == "the token is not valid"
        async with http.post(f"{api}/schedules", json=_schedule("a"), headers=write) as r:
            assert r.status == 201
        async with http.get(f"{api}/schedules/a", headers=read) as r:
            assert r.status == 200
        for open_path in ("/healthz", "/metrics", "/ui"):
            async with http.get(f"{api}{open_path}") as r:
                assert r.status in {200, 503}, open_path  # readiness may still be loading
        huge = json.dumps(_schedule("big") | {"payload": {"x": "y" * 300_000}})
        async with http.post(
            f"{api}/schedules", data=huge, headers=write | {"Content-Type": "application/json"}
        ) as r:
            assert r.status == 413
            assert (await r.json())["errors"][0]["field"] == "body"
        async with http.get(f"{api}/schedules/big", headers=read) as r:
            assert r.status == 404  # nothing stored

        # Burst of 5, two of which are spent above (201 and 413): three more then 429.
        statuses = []
        for i in range(4):
            async with http.post(
                f"{api}/schedules/a/pause" if i % 2 else f"{api}/schedules/a/resume", headers=write
            ) as r:
                statuses.append(r.status)
                if r.status == 429:
                    body = await r.json()
                    retry_after = r.headers["Retry-After"]
        assert statuses == [200, 200, 200, 429]
        assert int(retry_after) >= 1
        assert "too many writes from 127.0.0.1: at most 2 per second" in body["title"]
        async with http.get(f"{api}/schedules/a", headers=read) as r:
            assert r.status == 200  # reads are not limited

        async def refilled() -> bool:
            async with http.post(f"{api}/schedules/a/resume", headers=write) as r:
                return r.status == 200

        await wait_until(refilled, 5, "the write limit to let a write through again", 0.2)


def test_without_a_token_the_api_serves_loopback_only_and_says_so(mongo_uri: str) -> None:
    process = start_replica(
        with_database(mongo_uri, f"open_{uuid.uuid4().hex[:8]}"),
        "open",
        "--broker",
        "log:",
        "--http-host",
        "0.0.0.0",
        env={"HASCHEDULER_WRITE_TOKENS": "", "HASCHEDULER_READ_TOKENS": ""},
    )
    try:
        assert process.uri.startswith("http://127.0.0.1:")
    finally:
        assert process.stop() == 0
    assert process.log_path is not None
    lines = [
        json.loads(line)
        for line in Path(process.log_path).read_text().splitlines()
        if line.startswith("{")
    ]
    warning = next(line for line in lines if line["event"] == "api_unauthenticated")
    assert warning["listening_on"] == "127.0.0.1"
    assert warning["asked_for"] == "0.0.0.0"
    assert "without authentication" in warning["message"]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([], {"HASCHEDULER_WRITE_TOKENS": "short"}, "HASCHEDULER_WRITE_TOKENS: every token needs"),
        ([], {"HASCHEDULER_WRITE_TOKENS_FILE": "/nonexistent"}, "cannot read /nonexistent"),
        (["--write-rate", "fast"], {}, "--write-rate / HASCHEDULER_WRITE_RATE: 'fast' is not"),
        (["--write-rate", "-2"], {}, "--write-rate / HASCHEDULER_WRITE_RATE: the write rate"),
        (["--write-burst", "0"], {}, "--write-burst / HASCHEDULER_WRITE_BURST"),
        (["--broker", "nats://h:4222?tls_ca_file=/nonexistent"], {}, "TLS files in the broker URL"),
        (["--broker", "nats://h:4222?tls_cert_file=/a"], {}, "tls_cert_file and tls_key_file"),
        (["--broker", "nats://h:4222?tsl_ca_file=/a"], {}, "unknown broker URL option"),
        (["--broker", "nats://h:4222?replicas=0"], {}, "replicas='0' in the broker URL"),
        (["--broker", "nats://h:4222?replicas=7"], {}, "replicas='7' in the broker URL"),
        (["--broker", "nats://h:4222?replicas=three"], {}, "use 1 to 5, or auto"),
        (["--broker", "nats://h:4222,,h2:4222"], {}, "an empty server between commas"),
        (["--tls-cert-file", "/a.pem"], {}, "--tls-cert-file and --tls-key-file"),
        (
            ["--tls-cert-file", "/nonexistent.pem", "--tls-key-file", "/nonexistent.key"],
            {},
            "--tls-cert-file / --tls-key-file: [Errno 2]",
        ),
    ],
)
def test_bad_access_settings_exit_2(args: list[str], env: dict[str, str], message: str) -> None:
    import os

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hascheduler.cli",
            "serve",
            "--mongodb-uri",
            "mongodb://127.0.0.1:1/?replicaSet=rs0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


# --- TLS to MongoDB and NATS ----------------------------------------------------------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private CA and a server certificate for 127.0.0.1, made with openssl (used by
    the development server, nats-server and the replica's API)."""
    folder = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=hascheduler test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    )
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    )
    (folder / "server-with-key.pem").write_text(
        (folder / "server.pem").read_text() + (folder / "server.key").read_text()
    )
    return folder


def test_devmongo_refuses_a_bad_certificate_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hascheduler.cli",
            "devmongo",
            "--port",
            "0",
            "--tls-certificate-key-file",
            str(bogus),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "--tls-certificate-key-file" in done.stderr


async def test_a_replica_reaches_mongodb_and_nats_over_tls(certificates: Path) -> None:
    """TLS options ride in the URIs: tls/tlsCAFile for MongoDB, tls_ca_file for NATS; and
    the replica serves its API over HTTPS."""
    ca = certificates / "ca.pem"
    mongo = start_devmongo("--tls-certificate-key-file", str(certificates / "server-with-key.pem"))
    nats = start_nats(
        extra=(
            "--tls",
            "--tlscert",
            str(certificates / "server.pem"),
            "--tlskey",
            str(certificates / "server.key"),
        )
    )
    replica: ServerProcess | None = None
    try:
        assert "tls=true" in mongo.uri
        mongodb_uri = with_database(mongo.uri, "tls") + f"&tlsCAFile={ca}"
        broker = f"{nats.uri}?tls_ca_file={ca}"
        replica = start_replica(
            mongodb_uri,
            "tls1",
            "--broker",
            broker,
            "--tls-cert-file",
            str(certificates / "server.pem"),
            "--tls-key-file",
            str(certificates / "server.key"),
        )
        assert replica.uri.startswith("https://127.0.0.1:")
        async with aiohttp.ClientSession() as plain:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await plain.get(f"{replica.uri}/healthz")  # the CA is not trusted here
        trusting = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(ca)))
        async with aiohttp.ClientSession(connector=trusting) as http:

            async def ready() -> bool:
                async with http.get(f"{replica.uri}/readyz") as r:
                    return r.status == 200

            await wait_until(ready, 20, "the replica to be ready over TLS")
            async with http.post(
                f"{replica.uri}/schedules",
                json={
                    "id": "tick",
                    "name": "tick",
                    "target": "tls.test",
                    "trigger": {"kind": "cron", "cron": "* * * * * *"},
                },
            ) as r:
                assert r.status == 201

        async def published() -> bool:
            try:
                messages = await read_stream(broker)
            except Exception:  # the stream is created by the first publish
                return False
            return any(m.event["data"]["schedule_id"] == "tick" for m in messages)

        await wait_until(published, 20, "a fire stored in JetStream over TLS", 0.3)
        # A client that does not trust the CA is refused: TLS is really in use.
        host, port = mongo.uri.split("//")[1].split("/")[0].split(":")
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.open_connection(host, int(port), ssl=ssl.create_default_context())
        _, writer = await asyncio.open_connection(
            host, int(port), ssl=ssl.create_default_context(cafile=str(ca))
        )
        assert writer.get_extra_info("peercert")["subject"] == ((("commonName", "127.0.0.1"),),)
        writer.close()
        await writer.wait_closed()
    finally:
        if replica is not None:
            assert replica.stop() == 0
        nats.stop()
        mongo.stop()


def test_the_schedules_cli_sends_its_token(guarded: ServerProcess) -> None:
    import os

    api = guarded.uri.replace("0.0.0.0", "127.0.0.1")

    def cli(*args: str, token: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "HASCHEDULER_TOKEN"}
        if token is not None:
            env["HASCHEDULER_TOKEN"] = token
        return subprocess.run(
            [sys.executable, "-m", "hascheduler.cli", "schedules", "--api", api, *args],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )

    refused = cli("list", token=None)
    assert refused.returncode == 2, refused.stderr  # refused by the API
    assert "HTTP 401: this API needs a token" in refused.stderr
    forbidden = cli(
        "add", "--id", "cli", "--name", "cli", "--target", "t", "--every", "60", token=READ
    )
    assert forbidden.returncode == 2
    assert "HTTP 403" in forbidden.stderr
    added = cli(
        "add", "--id", "cli", "--name", "cli", "--target", "t", "--every", "60", token=WRITE
    )
    assert added.returncode == 0, added.stderr
    listed = cli("--json", "list", token=READ)
    assert listed.returncode == 0, listed.stderr
    assert [s["id"] for s in json.loads(listed.stdout)["items"]] == ["cli"]
