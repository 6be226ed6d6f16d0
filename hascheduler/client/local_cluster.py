"""The local cluster's control API as a client sees it: where ``hascheduler dev`` writes its
address (the state file in its state directory) and one call to it. The supervisor lives in
the development tools (hascheduler_dev); this is the whole contract between the two, so
the CLI and ``Client()`` find a local cluster without importing them."""

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


def local_api(state_dir: Path) -> str:
    """The URL of a ready replica of the cluster running from ``state_dir``. Raises
    ControlError saying why there is none."""
    status = call(state_dir, "GET", "/status", timeout_s=10)
    ready = [r["url"] for r in status.get("replicas", []) if r.get("ready")]
    if not ready:
        raise ControlError(f"the local cluster in {state_dir}/ has no ready replica")
    return str(ready[0]).rstrip("/")


def find_api(explicit: str | None) -> str:
    """The API to call: ``explicit``, else HASCHEDULER_API, else the local cluster running
    from this directory (HASCHEDULER_DEV_STATE_DIR). Raises ControlError naming all
    three."""
    named = explicit or os.environ.get("HASCHEDULER_API")
    if named:
        return named.rstrip("/")
    try:
        return local_api(state_dir_from_env())
    except ControlError as exc:
        raise ControlError(
            f"no API named (--api or HASCHEDULER_API), and no local cluster: {exc}"
        ) from None
