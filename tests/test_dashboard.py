"""The /ui dashboard in a real headless Chromium (Debian's, driven by Playwright) against a
running local cluster (`hascheduler dev`): tokens, the leader changing live when the leader
is killed, and the pause button.

HASCHEDULER_SCREENSHOT_DIR=docs keeps the screenshot (docs/dashboard.png comes from here).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from playwright.async_api import Page, async_playwright, expect
from pymongo import AsyncMongoClient

from tests.servers import DevCluster
from tests.waiting import wait_until

WRITE = "dashboard-write-token-0123456789"
READ = "dashboard-read-token-0123456789"
MARKUP = '<b>bold</b><img src=x onerror="window.injected=1">'
# Flags that keep Chromium off the network it cannot reach here, as root, without a GPU.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    """Debian's chromium; its absence is a failure, never a skip (.ci/run installs it)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "chromium is not installed: run .ci/run or `apt-get install chromium`"
    return found


def dev(cluster: DevCluster, *args: str) -> dict[str, object]:
    """``hascheduler dev ACTION --json`` against the running cluster."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hascheduler.cli",
            "dev",
            *args,
            "--json",
            "--state-dir",
            cluster.state_dir,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[DevCluster]:
    """Three replicas, devmongo, nats-server and a worker, with read and write tokens."""
    running = DevCluster(
        str(tmp_path / "dev"),
        "--replicas",
        "3",
        env={"HASCHEDULER_WRITE_TOKENS": WRITE, "HASCHEDULER_READ_TOKENS": READ},
    )
    try:
        assert len(running.replicas) == 3, running.replicas
        yield running
    finally:
        returncode = running.stop()
    assert returncode == 0


async def _create(
    api: str, sid: str, trigger: dict[str, object], name: str | None = None, **fields: object
) -> None:
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {WRITE}"}) as http,
        http.post(
            f"{api}/schedules",
            json={
                "id": sid,
                "name": name or sid.replace("-", " "),
                "target": "demo.dashboard",
                "trigger": trigger,
                **fields,
            },
        ) as r,
    ):
        assert r.status == 201, await r.text()


async def _paused(api: str, sid: str) -> bool:
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {READ}"}) as http,
        http.get(f"{api}/schedules/{sid}") as r,
    ):
        paused: bool = (await r.json())["paused"]
        return paused


async def _use_token(page: Page, token: str) -> None:
    await page.fill("#token", token)
    await page.click("#token-form button")


@pytest.mark.devmongo_only
@pytest.mark.timeout(180)
async def test_dashboard_shows_the_leader_change_live(cluster: DevCluster) -> None:
    status = dev(cluster, "status")
    leader = status["leader"]
    assert isinstance(leader, str)
    watched = next(name for name in cluster.replicas if name != leader)
    api = cluster.replicas[watched]
    await _create(api, "every-second", {"kind": "cron", "cron": "* * * * * *"})
    await _create(
        api, "weekly-report", {"kind": "cron", "cron": "0 9 * * 1", "timezone": "Europe/Paris"}
    )
    await _create(api, "poll-api", {"kind": "interval", "every": 30})
    # User data shown as text, never as markup.
    await _create(api, "markup", {"kind": "interval", "every": 3600}, name=MARKUP)
    # One fire, one run per tenant: shown as one row counting them.
    await _insert_tenants(str(status["mongodb_uri"]), ["acme", "globex", "initech"])
    await _create(
        api,
        "per-tenant",
        {"kind": "cron", "cron": "* * * * * *"},
        fan_out={"collection": "tenants"},
    )

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.goto(f"{api}/ui")
            # No token yet: the API refuses and the page says why.
            await expect(page.locator("#status")).to_contain_text("HTTP 401", timeout=10_000)

            await _use_token(page, READ)
            await expect(page.locator("#leader")).to_have_text(leader, timeout=10_000)
            await expect(page.locator("#answered-by")).to_have_text(watched)
            await expect(page.locator("#members tbody tr")).to_have_count(3, timeout=10_000)
            await expect(page.locator("#schedules tbody tr")).to_have_count(5)
            await expect(
                page.locator("#schedules tbody tr", has_text="per-tenant")
            ).to_contain_text("demo.dashboard (per tenants)")
            name_cell = page.locator("#schedules tbody tr", has_text="markup").locator("td").nth(2)
            await expect(name_cell).to_have_text(MARKUP)
            assert await page.locator("#schedules b, #schedules img").count() == 0
            assert await page.evaluate("window.injected") is None
            # Fires are claimed up to 2 s ahead, so the newest rows may still be "claimed".
            plain = page.locator("#fires tbody tr", has_text="every-second@")
            published = plain.filter(has_text="published").first
            await expect(published.locator("td").nth(4)).to_contain_text(" ms", timeout=10_000)
            # The worker's outcome of each fire, with its duration.
            ran = plain.filter(has_text="succeeded").first
            await expect(ran.locator("td").nth(5)).to_contain_text(" ms", timeout=10_000)
            fanned = page.locator("#fires tbody tr", has_text="3 tenants: 3 published").first
            await expect(fanned).to_contain_text("per-tenant@", timeout=10_000)
            await expect(
                page.locator("#fires tbody tr", has_text="per-tenant@")
                .filter(has_text="3 succeeded")
                .first
            ).to_contain_text("3 tenants", timeout=10_000)
            assert await page.locator("#fires tbody tr", has_text="/acme").count() == 0
            old_term = int(await page.inner_text("#term"))

            # A read token is offered no button that would change anything.
            assert await page.locator("button[data-schedule], button[data-run-now]").count() == 0

            killed = dev(cluster, "kill-leader", "--signal", "KILL")
            assert killed["killed"] == leader
            new_leader = killed["new_leader"]
            assert isinstance(new_leader, str)
            # The page, served by a replica that was not killed, follows on its own.
            await expect(page.locator("#leader")).to_have_text(new_leader, timeout=20_000)
            await wait_until(lambda: _term_above(page, old_term), 10, "a higher term shown")
            leader_row = page.locator("#members tbody tr", has_text="leader").first
            await expect(leader_row).to_contain_text(new_leader, timeout=10_000)
            # Standbys report the term they last saw too, so every surviving member shows it.
            new_term = str(killed["new_term"])
            await wait_until(
                lambda: _member_terms(page, new_term, leader),
                10,
                f"every surviving member showing term {new_term}",
            )

            # The write token pauses and resumes.
            await _use_token(page, WRITE)
            await page.click("button[data-schedule='poll-api']", timeout=10_000)
            row = page.locator("#schedules tbody tr", has_text="poll-api")
            await expect(row).to_contain_text("paused", timeout=5_000)
            assert await _paused(api, "poll-api")
            await expect(row.locator("button[data-schedule]")).to_have_text("resume")
            await row.locator("button[data-schedule]").click()
            await expect(row).to_contain_text("active", timeout=5_000)
            assert not await _paused(api, "poll-api")
            # Both show in the audit trail's view, by the token's name.
            changes = page.locator("#changes tbody tr", has_text="poll-api")
            await expect(changes.filter(has_text="resume").first).to_contain_text(
                "write-1", timeout=5_000
            )
            await expect(changes.filter(has_text="pause").first).to_contain_text("paused")
            # The namespace filter: another namespace shows none of these schedules.
            await page.fill("#namespace", "another-team")
            await page.click("#namespace-form button")
            await expect(page.locator("#schedules tbody tr")).to_have_count(0, timeout=5_000)
            await expect(page.locator("#changes tbody tr")).to_have_count(0)
            await page.fill("#namespace", "default")
            await page.click("#namespace-form button")
            await expect(page.locator("#schedules tbody tr")).to_have_count(5, timeout=5_000)
            await page.fill("#namespace", "")  # every namespace again
            await page.click("#namespace-form button")

            # Run now: the fire appears, made by hand, and is run by the worker.
            await page.click("button[data-run-now='weekly-report']")
            await expect(page.locator("#status")).to_contain_text(
                "fired weekly-report@manual-", timeout=5_000
            )
            manual = page.locator("#fires tbody tr", has_text="weekly-report@manual-")
            await expect(manual).to_contain_text("run now by write-1", timeout=10_000)
            await expect(manual).to_contain_text("succeeded", timeout=15_000)

            # A pause with a note and an end, made through the API, reads on the page.
            until = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
            async with (
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {WRITE}"}) as http,
                http.post(
                    f"{api}/schedules/poll-api/pause",
                    json={"note": "partner API down", "until": until.isoformat()},
                ) as r,
            ):
                assert r.status == 200, await r.text()
            await expect(row).to_contain_text("paused: partner API down (until", timeout=5_000)
            await expect(row).to_contain_text("by write-1")

            # A dead run is listed; retried from the page, the worker runs it and it leaves
            # the list.
            dead_id = await _plant_dead_run(str(status["mongodb_uri"]))
            dead_row = page.locator("#dead tbody tr", has_text=dead_id)
            await expect(dead_row).to_contain_text("PermanentFailure: planted", timeout=10_000)
            await dead_row.locator("button").click()
            await expect(page.locator("#dead tbody tr")).to_have_count(0, timeout=20_000)
            await wait_until(
                lambda: _run_state(str(status["mongodb_uri"]), dead_id, "succeeded"),
                20,
                "the replayed run to succeed",
            )

            shot = _screenshot_path(Path(cluster.state_dir))
            await page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
        finally:
            await browser.close()


async def _plant_dead_run(mongodb_uri: str) -> str:
    """A dead run as a worker leaves one (its handler raised PermanentFailure), written
    straight into the dev cluster's runs ledger: the dev workers' handler never fails."""
    nominal = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(minutes=1)
    fire_id = f"planted@{nominal.isoformat().replace('+00:00', 'Z')}"
    event = {
        "specversion": "1.0",
        "id": fire_id,
        "source": "/hascheduler",
        "type": "io.hascheduler.fire",
        "subject": "planted",
        "data": {
            "schedule_id": "planted",
            "term": 1,
            "payload": {},
            "nominal_at": nominal.isoformat().replace("+00:00", "Z"),
        },
    }
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongodb_uri, tz_aware=True)
    try:
        await client.get_default_database().runs.insert_one(
            {
                "_id": fire_id,
                "schedule_id": "planted",
                "target": "demo.dashboard",
                "nominal_at": nominal,
                "state": "dead",
                "attempts": 1,
                "worker_id": "w1",
                "started_at": nominal,
                "finished_at": nominal,
                "duration_s": 0.0,
                "last_error": "PermanentFailure: planted",
                "replays": 0,
                "event": json.dumps(event).encode(),
                "recorded_at": dt.datetime.now(dt.UTC),
            }
        )
    finally:
        await client.close()
    return fire_id


async def _insert_tenants(mongodb_uri: str, names: list[str]) -> None:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongodb_uri)
    try:
        await client.get_default_database().tenants.insert_many([{"_id": n} for n in names])
    finally:
        await client.close()


async def _run_state(mongodb_uri: str, fire_id: str, state: str) -> bool:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongodb_uri, tz_aware=True)
    try:
        doc = await client.get_default_database().runs.find_one({"_id": fire_id})
    finally:
        await client.close()
    return doc is not None and doc["state"] == state


def _screenshot_path(default_dir: Path) -> Path:
    folder = Path(os.environ.get("HASCHEDULER_SCREENSHOT_DIR") or default_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "dashboard.png"


async def _member_terms(page: Page, term: str, killed: str) -> dict[str, str] | None:
    """Replica id -> term shown, once every member but the killed one (its heartbeat ages
    out; the dev cluster starts a replacement) shows ``term``."""
    rows = await page.locator("#members tbody tr").all()
    shown = {}
    for row in rows:
        cells = await row.locator("td").all_inner_texts()
        if len(cells) >= 3 and cells[0] != killed:
            shown[cells[0]] = cells[2]
    return shown if len(shown) >= 2 and set(shown.values()) == {term} else None


async def _term_above(page: Page, term: int) -> bool:
    text = await page.inner_text("#term")
    return text.isdigit() and int(text) > term
