"""Processes whose wall clock is wrong, for tests and the soak: libfaketime (Debian's
faketime package) moves a process's wall clock by a fixed offset and leaves its monotonic
clock alone."""

from __future__ import annotations

import glob


def moved_clock_env(offset_s: float) -> dict[str, str]:
    """The environment that runs a process with its wall clock ``offset_s`` ahead (or,
    negative, behind). Raises RuntimeError when libfaketime is missing."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        raise RuntimeError(
            "libfaketime is missing: install Debian's faketime package (scripts/test does)"
        )
    return {
        "LD_PRELOAD": found[0],
        "FAKETIME": f"{offset_s:+g}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
