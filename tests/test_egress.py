"""The egress policy (core/egress.py, process/egress.py): what the product sends out never
reaches loopback, link-local, private or the replica's own listeners unless the operator
allows it, in any spelling of an address, and checked again on every connection."""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

import aiohttp
import httpx
import pytest
from aiohttp import web

from hascheduler.core.egress import PUBLIC_ONLY, EgressPolicy, EgressRefused, shown_url
from hascheduler.core.errors import ConfigError
from hascheduler.process.egress import egress_session
from tests.servers import ServerProcess, start_replica, with_database

REFUSED_URLS = [
    "http://127.0.0.1:9/",
    "http://127.1/",
    "http://2130706433/",
    "http://0x7f.0.0.1/",
    "http://0177.0.0.1/",
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://169.254.169.254/latest/meta-data/",
    "http://10.1.2.3/",
    "http://172.16.0.1/",
    "http://192.168.1.1/",
    "http://100.64.0.1/",
    "http://[fc00::1]/",
    "http://[fe80::1]/",
    "http://0.0.0.0/",
    "http://224.0.0.1/",
    "http://localhost:8080/",
    "http://LOCALHOST./",
    "http://api.localhost/",
    "file:///etc/passwd",
    "gopher://example.com/",
]


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_every_spelling_of_an_inside_address_is_refused(url: str) -> None:
    assert PUBLIC_ONLY.url_refusal(url) is not None


@pytest.mark.parametrize("url", ["https://hooks.example.com/x", "http://8.8.8.8:8080/"])
def test_a_public_address_or_a_name_may_be_called(url: str) -> None:
    assert PUBLIC_ONLY.url_refusal(url) is None


def test_an_operator_allows_ranges_and_hosts_but_never_the_replicas_own_listener() -> None:
    policy = EgressPolicy.parse("127.0.0.0/8, 10.0.0.0/8, hooks.localhost")
    assert policy.url_refusal("http://127.0.0.1:9/") is None
    assert policy.url_refusal("http://10.9.9.9/") is None
    assert policy.url_refusal("http://hooks.localhost/") is None
    assert policy.url_refusal("http://192.168.1.1/") is not None
    own = policy.listening(ipaddress.ip_address("127.0.0.1"), 8080)
    assert own.url_refusal("http://127.0.0.1:8080/") is not None
    assert own.url_refusal("http://127.0.0.1:8081/") is None
    every = policy.listening(None, 8080)  # listening on every address
    assert every.url_refusal("http://10.0.0.1:8080/") is not None
    for bad in ("not a host!", "10.0.0.0/99", "-x.example"):
        with pytest.raises(ConfigError, match="neither an address range"):
            EgressPolicy.parse(bad)


def test_a_password_in_a_url_is_never_shown_back() -> None:
    assert shown_url("https://bot:s3cret@hooks.example.com/x?a=1") == (
        "https://bot:***@hooks.example.com/x?a=1"
    )
    assert shown_url("https://hooks.example.com/x") == "https://hooks.example.com/x"


@contextlib.asynccontextmanager
async def receiver() -> AsyncIterator[tuple[int, list[str]]]:
    """An HTTP server on loopback noting the paths it is asked for."""
    asked: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(text="inside")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1], asked
    finally:
        await runner.cleanup()


async def test_a_name_resolving_inside_is_refused_when_the_connection_is_made() -> None:
    """Resolved at send time: ``localhost`` (any name that resolves to loopback now, as a
    rebound one would) reaches nothing; allowed, it is reached."""
    async with receiver() as (port, asked):
        async with egress_session(PUBLIC_ONLY, 5.0, 4) as http:
            with pytest.raises(aiohttp.ClientConnectorError) as refused:
                await http.get(f"http://localhost:{port}/secret", allow_redirects=False)
        assert isinstance(refused.value.os_error, EgressRefused) or isinstance(
            refused.value.__cause__, EgressRefused
        )
        assert asked == []
        allowed = EgressPolicy.parse("127.0.0.0/8")
        async with (
            egress_session(allowed, 5.0, 4) as http,
            http.get(f"http://localhost:{port}/ok") as answer,
        ):
            assert answer.status == 200
        assert asked == ["/ok"]
        own = allowed.listening(ipaddress.ip_address("127.0.0.1"), port)
        async with egress_session(own, 5.0, 4) as http:
            with pytest.raises(aiohttp.ClientConnectorError):
                await http.get(f"http://localhost:{port}/own")
        assert asked == ["/ok"]


@pytest.fixture(scope="module")
def replica(mongo_uri: str) -> Iterator[ServerProcess]:
    """A replica with the default egress policy (public addresses only)."""
    started = start_replica(with_database(mongo_uri, f"egress_{uuid.uuid4().hex[:8]}"), "egress")
    try:
        yield started
    finally:
        started.stop(signal.SIGKILL)


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_a_webhook_inside_the_network_is_refused_when_written(
    replica: ServerProcess, url: str
) -> None:
    answer = httpx.post(
        f"{replica.uri}/webhooks", json={"url": url, "events": ["run.dead"]}, timeout=10
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["field"] == "url"


def test_a_webhooks_password_is_not_shown_to_its_readers(replica: ServerProcess) -> None:
    made = httpx.post(
        f"{replica.uri}/webhooks",
        json={"url": "https://bot:s3cret@hooks.example.com/x", "events": ["run.dead"]},
        timeout=10,
    )
    assert made.status_code == 201, made.text
    assert "s3cret" not in made.text
    shown = httpx.get(f"{replica.uri}/webhooks/{made.json()['id']}", timeout=10)
    assert shown.json()["url"] == "https://bot:***@hooks.example.com/x"
    assert "s3cret" not in httpx.get(f"{replica.uri}/webhooks", timeout=10).text
