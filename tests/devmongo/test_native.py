"""The development server's compiled build (hascheduler_dev/devmongo/native.py): the server
process runs it when it matches the sources, and never a build of other sources."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import hascheduler_dev.devmongo as devmongo
import pytest
from hascheduler_dev.devmongo import native
from pymongo import MongoClient

from tests.servers import devmongo_compiled, start_devmongo


@pytest.mark.parametrize("from_sources", [False, True])
def test_the_server_process_runs_the_build_and_this_process_the_sources(from_sources: bool) -> None:
    native.build()  # set-up built it already (scripts/_venv.sh): then this is a no-op
    assert native.built() is not None
    server = start_devmongo(*(["--from-sources"] if from_sources else []))
    try:
        client: MongoClient[dict[str, Any]] = MongoClient(server.uri, serverSelectionTimeoutMS=5000)
        try:
            coll = client.native.c
            coll.create_index("k", unique=True)
            coll.insert_many([{"_id": i, "k": i % 7 if i < 7 else i} for i in range(100)])
            assert coll.count_documents({"k": {"$in": [1, 2, 99]}}) == 3
            assert coll.find_one({"_id": 50}) == {"_id": 50, "k": 50}
        finally:
            client.close()
    finally:
        server.stop()
    assert devmongo_compiled(server) is not from_sources
    # The test process imported the sources: a test replacing a function in them (as
    # tests/devmongo/test_storage.py does) replaces what runs.
    assert not native.running_compiled()


def test_a_build_is_for_its_exact_sources_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "devmongo"
    shutil.copytree(native.SOURCES, sources, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(native, "SOURCES", sources)
    monkeypatch.setattr(native, "BUILDS", tmp_path / "builds")
    before = native.digest()
    where = native.build_dir()
    assert where is not None
    (where / "devmongo").mkdir(parents=True)
    (where / "complete").write_text("")
    assert native.built() == where
    storage = sources / "storage.py"
    storage.write_text(storage.read_text() + "\n# an edit\n")
    assert native.digest() != before
    assert native.built() is None
    # load() then uses nothing: the modules come from their sources.
    path = list(devmongo.__path__)
    assert native.load() is False
    assert list(devmongo.__path__) == path


def test_load_refuses_once_the_sources_are_in_use() -> None:
    import hascheduler_dev.devmongo.storage  # noqa: F401 - the sources, in this process

    assert native.built() is not None or native.build()
    path = list(devmongo.__path__)
    assert native.load() is False
    assert list(devmongo.__path__) == path
