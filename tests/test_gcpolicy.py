"""The garbage-collector policy: survivors of a full collection are frozen, and handed back
every THAW_EVERY_S so that cyclic garbage frozen while alive is reclaimed."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from hascheduler.process import gcpolicy


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, gcpolicy._SurvivorFreezer)]


def test_survivors_of_a_full_collection_are_frozen_and_young_ones_are_not() -> None:
    freezer = gcpolicy._SurvivorFreezer(gcpolicy.THAW_EVERY_S)
    freezer("stop", {"generation": 1, "collected": 0, "uncollectable": 0})
    assert gc.get_freeze_count() == 0
    freezer("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    assert gc.get_freeze_count() > 0


def test_frozen_objects_are_handed_back_after_the_thaw_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    freezer = gcpolicy._SurvivorFreezer(gcpolicy.THAW_EVERY_S)
    freezer("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    assert gc.get_freeze_count() > 0
    later = freezer.thawed_at + gcpolicy.THAW_EVERY_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    freezer("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    assert gc.get_freeze_count() == 0
    assert freezer.thawed_at == later


def test_a_process_that_never_thaws_keeps_its_survivors_frozen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    freezer = gcpolicy._SurvivorFreezer(None)  # the development server's policy
    freezer("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    frozen = gc.get_freeze_count()
    assert frozen > 0
    later = freezer.thawed_at + 100 * gcpolicy.THAW_EVERY_S
    monkeypatch.setattr(time, "monotonic", lambda: later)
    freezer("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    assert gc.get_freeze_count() >= frozen


def test_installing_twice_adds_one_callback() -> None:
    gcpolicy.freeze_survivors()
    gcpolicy.freeze_survivors()
    assert sum(isinstance(cb, gcpolicy._SurvivorFreezer) for cb in gc.callbacks) == 1
