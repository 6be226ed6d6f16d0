"""A worker handler for tests: appends each fire id to the file named by RECORD_FIRES_TO."""

from __future__ import annotations

import os
from typing import Any


def handle(event: dict[str, Any]) -> None:
    with open(os.environ["RECORD_FIRES_TO"], "a") as out:
        out.write(f"{event['id']} {event['data']['term']}\n")
