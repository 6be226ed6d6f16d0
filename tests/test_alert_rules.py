"""The shipped alert rules (k8s/monitoring/): promtool checks them and runs their unit
tests (every alert both firing and not), the Operator's copy is their rendering, and a real
Prometheus scraping a real cluster sees the flapping alert fire as leaders are killed."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.servers import ServerProcess, free_port, start_replica, with_database
from tests.waiting import wait_until_sync

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "k8s" / "monitoring"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: scripts/test installs Debian's prometheus"
    return subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=120, cwd=MONITORING
    )


def test_promtool_checks_the_rules() -> None:
    checked = promtool("check", "rules", "rules.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def test_promtool_unit_tests_pass() -> None:
    tested = promtool("test", "rules", "rules_test.yaml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    rules = yaml.safe_load((MONITORING / "rules.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    cases = yaml.safe_load((MONITORING / "rules_test.yaml").read_text())["tests"]
    checks = [c for case in cases for c in case["alert_rule_test"]]
    fired = {c["alertname"] for c in checks if c["exp_alerts"]}
    quiet = {c["alertname"] for c in checks if not c["exp_alerts"]}
    assert alerts - fired == set(), "alerts never seen firing in rules_test.yaml"
    assert alerts - quiet == set(), "alerts never seen quiet in rules_test.yaml"
    assert len(alerts) >= 9


def test_the_operators_resource_is_the_rendering_of_the_rules() -> None:
    checked = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "monitoring-rules"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr
    rules = yaml.safe_load((MONITORING / "rules.yaml").read_text())
    resource = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"]["groups"] == rules["groups"]


class Prometheus:
    def __init__(self, targets: list[str], tmp: Path) -> None:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(MONITORING / "rules.yaml")],
            "scrape_configs": [
                {"job_name": "hascheduler", "static_configs": [{"targets": targets}]}
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        binary = shutil.which("prometheus")
        assert binary, "prometheus is missing: scripts/test installs Debian's prometheus"
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_until_sync(self.ready, 60, "prometheus to be ready", 0.2)

    def ready(self) -> bool:
        assert self.process.poll() is None, (Path(self.log.name).read_text())[-2000:]
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5)
        result: list[dict[str, Any]] = answer.json()["data"]["result"]
        return result

    def firing(self, name: str) -> dict[str, Any] | None:
        alerts = httpx.get(f"{self.url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        return next(
            (a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"), None
        )

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.log.close()


@pytest.fixture(name="replicas")
def replicas_fixture(mongo_uri: str) -> Iterator[list[ServerProcess]]:
    uri = with_database(mongo_uri, f"t_{uuid.uuid4().hex[:12]}")
    started = [
        start_replica(
            uri,
            f"r{i}",
            "--http-port",
            str(free_port()),
            "--lease-ttl",
            "2",
            "--renew-deadline",
            "1.4",
            "--renew-interval",
            "0.4",
        )
        for i in range(5)
    ]
    yield started
    for replica in started:
        replica.stop()


# Alone: five replicas failing over four times and a Prometheus scraping them every second
# load the machine enough to perturb the timed tests running beside them.
@pytest.mark.alone
def test_a_real_prometheus_sees_leadership_flapping(
    replicas: list[ServerProcess], tmp_path: Path
) -> None:
    alive = {f"r{i}": r for i, r in enumerate(replicas)}  # by replica id

    def leader() -> tuple[str, int] | None:
        for replica in alive.values():
            try:
                lease = httpx.get(f"{replica.uri}/leader", timeout=2).json()
            except httpx.HTTPError:
                continue
            if lease["holder"] in alive:
                return lease["holder"], int(lease["term"])
        return None

    holder, term = wait_until_sync(leader, 30, "a first leader")
    prometheus = Prometheus([r.uri.removeprefix("http://") for r in replicas], tmp_path)
    try:
        wait_until_sync(
            lambda: prometheus.query("hascheduler:term:max"), 30, "the term recorded by the rule"
        )
        assert prometheus.firing("HaschedulerLeadershipFlapping") is None
        for _ in range(4):
            alive.pop(holder).stop(signal.SIGKILL)

            def next_leader(after: int = term) -> tuple[str, int] | None:
                found = leader()
                return found if found is not None and found[1] > after else None

            holder, term = wait_until_sync(next_leader, 30, "the next leader")

            def scraped(wanted: int = term) -> bool:
                samples = prometheus.query("hascheduler:term:max")
                return any(float(s["value"][1]) >= wanted for s in samples)

            wait_until_sync(scraped, 30, f"term {term} scraped")
        alert = wait_until_sync(
            lambda: prometheus.firing("HaschedulerLeadershipFlapping"),
            30,
            "the flapping alert to fire",
        )
        assert alert["labels"]["severity"] == "page"
        changes = re.fullmatch(
            r"the lease changed hands (\d+) times in 10 minutes", alert["annotations"]["summary"]
        )
        assert changes is not None
        assert int(changes[1]) >= 4
        assert prometheus.firing("HaschedulerNoLeader") is None  # each failover was quick
    finally:
        prometheus.stop()
