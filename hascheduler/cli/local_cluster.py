"""The local cluster's control API as a client sees it: where ``hascheduler dev`` writes its
address (the state file in its state directory) and one call to it. The supervisor lives in
the development tools (hascheduler_dev); this is the whole contract between the two, so
``schedules`` and ``runs`` find a local cluster without importing them."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
DEFAULT_STATE_DIR = ".hascheduler-dev"


class ControlError(Exception):
    """No running cluster, or it refused the request (message says why)."""


def state_dir_from_env() -> Path:
    return Path(os.environ.get("HASCHEDULER_DEV_STATE_DIR", DEFAULT_STATE_DIR))


def control_url(state_dir: Path) -> str:
    try:
        return str(json.loads((state_dir / STATE_FILE).read_text())["control_url"])
    except (OSError, ValueError, KeyError):
        raise ControlError(
            f"no running cluster found in {state_dir}/ (start one with `hascheduler dev`)"
        ) from None


def call(
    state_dir: Path,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """One request to the supervisor's control API. Raises ControlError."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        control_url(state_dir) + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError):
            detail = json.loads(detail).get("error", detail)
        raise ControlError(detail) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ControlError(f"the cluster's control API does not answer: {exc}") from None
