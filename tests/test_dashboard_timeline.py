"""The dashboard's timeline, run page and schedule page in a real headless Chromium
(Debian's) against a replica, a real nats-server and a worker: a late fire (the leader
stalled by SIGSTOP), skipped fires (overlap: skip) and a dead run are marks in their
colors; a run's page lists its attempts; the buttons shown are the ones the token's
scopes allow, and they work.

HASCHEDULER_SCREENSHOT_DIR=docs keeps the screenshots (docs/dashboard-timeline.png,
docs/dashboard-run.png come from here).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from playwright.async_api import Page, async_playwright, expect

from hascheduler.api.access import Action, create_token, entry_line
from tests.servers import ServerProcess, start_cli, start_nats, start_replica, with_database
from tests.test_dashboard import CHROMIUM_ARGS, chromium_path
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(240)]

# The colors of docs/OPERATIONS.md's legend, as the browser computes them.
COLORS = {
    "on_time": "rgb(22, 163, 74)",
    "late": "rgb(245, 158, 11)",
    "skipped": "rgb(156, 163, 175)",
    "dead": "rgb(126, 34, 206)",
}


@dataclass
class Setup:
    api: str
    tokens: dict[str, str]  # role -> secret
    replica: ServerProcess


@pytest.fixture
async def setup(mongo_uri: str, tmp_path: Path) -> AsyncIterator[Setup]:
    roles = {
        "reader": {Action.READ},
        "trigger": {Action.READ, Action.TRIGGER},
        "operator": {Action.READ, Action.TRIGGER, Action.PAUSE, Action.CANCEL, Action.WRITE},
    }
    made = {
        role: create_token(role, frozenset(actions), frozenset({"default"}))
        for role, actions in roles.items()
    }
    access = tmp_path / "access.yaml"
    access.write_text("tokens:\n" + "".join(entry_line(t.entry) + "\n" for t in made.values()))
    uri = with_database(mongo_uri, f"timeline_{uuid.uuid4().hex[:8]}")
    nats = start_nats()
    replica = await asyncio.to_thread(
        start_replica,
        uri,
        "ui",
        "--broker",
        nats.uri,
        "--access-file",
        str(access),
        "--write-rate",
        "0",
        "--trace-url",
        "https://traces.example/trace/{trace_id}",
    )
    worker = None
    try:
        worker = await asyncio.to_thread(
            start_cli,
            [
                "worker",
                "--broker",
                nats.uri,
                "--mongodb-uri",
                uri,
                "--app",
                "tests.helpers.record_handler:app",
                "--durable",
                "ui",
                "--concurrency",
                "4",
            ],
            "worker ",
            30.0,
            {"RECORD_FIRES_TO": str(tmp_path / "attempts.txt")},
        )
        yield Setup(replica.uri, {r: t.secret for r, t in made.items()}, replica)
    finally:
        if worker is not None:
            worker.stop(signal.SIGTERM)
        replica.stop(signal.SIGKILL)
        nats.stop()


async def _call(setup: Setup, method: str, path: str, body: Any = None, status: int = 200) -> Any:
    headers = {"Authorization": f"Bearer {setup.tokens['operator']}"}
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.request(method, setup.api + path, json=body) as r,
    ):
        assert r.status == status, await r.text()
        return await r.json()


async def _kinds(setup: Setup) -> set[str]:
    timeline = await _call(setup, "GET", "/timeline?hours=0.25")
    return {m["kind"] for s in timeline["schedules"] for m in s["marks"]}


async def _use_token(page: Page, token: str) -> None:
    await page.fill("#token", token)
    await page.click("#token-form button")


def _screenshot(name: str, fallback: Path) -> Path:
    folder = Path(os.environ.get("HASCHEDULER_SCREENSHOT_DIR") or fallback)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


async def test_the_timeline_shows_late_skipped_and_dead_fires_and_buttons_follow_scopes(
    setup: Setup, tmp_path: Path
) -> None:
    bodies: dict[str, dict[str, Any]] = {
        "tick": {"trigger": {"kind": "interval", "every": 1}},
        # Runs of 2.5 s at a fire a second: the fires between are skipped.
        "busy": {
            "trigger": {"kind": "interval", "every": 1},
            "overlap": "skip",
            "payload": {"sleep": 2.5},
        },
        "doomed": {"trigger": {"kind": "interval", "every": 3600}, "payload": {"permanent": True}},
    }
    for sid, body in bodies.items():
        await _call(
            setup,
            "POST",
            "/schedules",
            {"id": sid, "name": sid, "target": f"jobs.{sid}", **body},
            201,
        )
    dead_fire = (await _call(setup, "POST", "/schedules/doomed/trigger", {}, 202))["fire_id"]
    await wait_until(lambda: _call(setup, "GET", "/timeline?hours=0.25"), 10, "a timeline")
    # The leader stalls for 3 s: the fires due meanwhile are published late.
    assert setup.replica.process is not None
    setup.replica.process.send_signal(signal.SIGSTOP)
    await asyncio.sleep(3)  # the stall itself is what is measured, not a wait for a state
    setup.replica.process.send_signal(signal.SIGCONT)
    await wait_until(
        lambda: _has(setup, {"late", "skipped", "dead", "on_time"}),
        60,
        "late, skipped, dead and on-time marks",
    )

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 1000})
            await page.goto(setup.api + "/ui")
            await _use_token(page, setup.tokens["reader"])
            await expect(page.locator("#timeline tbody tr")).to_have_count(3, timeout=10_000)
            for kind, color in COLORS.items():
                mark = page.locator(f"#timeline rect[data-kind='{kind}']").first
                await expect(mark).to_be_attached(timeout=10_000)
                fill = await mark.evaluate("e => getComputedStyle(e).fill")
                assert fill == color, (kind, fill)
            # The late marks are the tick's, after the stall; the skipped ones the busy one's.
            assert (
                await page.locator("tr[data-schedule='tick'] rect[data-kind='late']").count() >= 1
            )
            assert (
                await page.locator("tr[data-schedule='busy'] rect[data-kind='skipped']").count()
                >= 1
            )
            await expect(page.locator("#lateness-chart polyline")).to_have_count(2)
            assert await page.locator("#lateness-chart circle").count() >= 2
            # Zoomed in to the last 5 minutes, as the screenshot shows it.
            await page.click(".zoom button[data-hours='0.0833']")
            await expect(page.locator(".zoom button[data-hours='0.0833']")).to_have_attribute(
                "aria-pressed", "true", timeout=10_000
            )
            # A read token: no button anywhere that would change something.
            await expect(page.locator("#schedules tbody tr")).to_have_count(3)
            assert (
                await page.locator(
                    "main button[data-schedule], main button[data-run-now],"
                    " main button[data-run], main button[data-cancel]"
                ).count()
                == 0
            )
            await page.screenshot(
                path=str(_screenshot("dashboard-timeline.png", tmp_path)), full_page=True
            )

            # A token that may trigger: run now, not pause.
            await _use_token(page, setup.tokens["trigger"])
            await expect(page.locator("button[data-run-now='tick']")).to_be_visible(timeout=10_000)
            assert await page.locator("button[data-schedule]").count() == 0

            # The dead run's page: its attempt, its error, a retry (trigger may).
            detail = page.locator("#detail")
            await _open_mark(page, dead_fire)
            await expect(detail).to_contain_text("no longer exists")
            await expect(detail.locator("tbody tr")).to_have_count(1)
            await expect(detail.locator("button[data-run]")).to_have_text("retry")
            await page.screenshot(
                path=str(_screenshot("dashboard-run.png", tmp_path)), full_page=True
            )

            # The operator, on the busy schedule's page: health, history, and a pause with
            # a note that the API then shows.
            await _use_token(page, setup.tokens["operator"])
            await page.goto(setup.api + "/ui#schedule=busy")
            await expect(detail).to_contain_text("Schedule busy", timeout=10_000)
            await expect(detail).to_contain_text("health")
            await expect(detail.locator("button[data-backfill]")).to_be_visible()
            await _type_note(page, "partner asked")
            await page.click("button[data-pause-with-note='busy']")
            try:
                await wait_until(
                    lambda: _paused_with(setup, "busy", "partner asked"),
                    20,
                    "the pause with its note",
                )
            except AssertionError as exc:  # say what the page and the API show instead
                raise AssertionError(
                    f"{exc}; the page says {await page.inner_text('#status')!r}; the "
                    f"schedule is {await _call(setup, 'GET', '/schedules/busy')}; the panel "
                    f"shows {(await page.inner_text('#detail'))[:500]!r}"
                ) from None
            await expect(detail.locator("button[data-resume]")).to_be_visible(timeout=10_000)
            await expect(detail).to_contain_text("pause")  # in its history
        finally:
            await browser.close()


async def _type_note(page: Page, note: str) -> None:
    """Type the pause note until it shows. Once in six suite runs the typed note was gone
    from the field right after typing (the cause is not yet found: the panel keeps what
    is typed across a redraw): typing again, as an operator would, is what is checked
    here; the pause with its note is checked after."""
    for _ in range(5):
        await page.fill("#pause-note", note)
        try:
            await expect(page.locator("#pause-note")).to_have_value(note, timeout=2_000)
            return
        except AssertionError:
            continue
    detail = await page.inner_text("#detail")
    raise AssertionError(f"the pause note would not stay typed: {detail!r}")


async def _open_mark(page: Page, fire_id: str) -> None:
    """Click a fire's mark until its run's page shows: the timeline is drawn again every
    few seconds, and a click may land as its strip is being replaced."""
    detail = page.locator("#detail")
    for _ in range(5):
        await page.click(f"#timeline rect[data-fire='{fire_id}']")
        try:
            await expect(detail).to_contain_text(f"Run {fire_id}", timeout=4_000)
            return
        except AssertionError:
            continue
    await expect(detail).to_contain_text(f"Run {fire_id}", timeout=4_000)


async def _has(setup: Setup, kinds: set[str]) -> bool:
    return kinds <= await _kinds(setup)


async def _paused_with(setup: Setup, sid: str, note: str) -> bool:
    schedule = await _call(setup, "GET", f"/schedules/{sid}")
    return bool(schedule["paused"] and (schedule.get("pause") or {}).get("note") == note)
