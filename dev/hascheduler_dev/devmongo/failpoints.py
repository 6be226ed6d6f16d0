"""``failCommand``, as mongod's ``configureFailPoint`` test command defines it.

Supported: modes alwaysOn / off / {times: n} / {skip: n} / {activationProbability: p};
data fields failCommands, errorCode, errorLabels, closeConnection, blockConnection with
blockTimeMS, writeConcernError, appName, namespace; and ``waitForFailPoint`` (its
timesEntered counted since the fail point was last configured, where mongod counts over
the process's life). One development-server extension:
``closeConnectionAfterExecution`` runs the command and then closes the connection instead
of replying (a write applied but its reply lost); a real mongod ignores unknown data
fields, so tests using it run against the development server only.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from hascheduler_dev.devmongo.errors import MongoError, bad_value
from hascheduler_dev.devmongo.values import Document


@dataclass
class FailCommand:
    commands: frozenset[str]
    error_code: int | None = None
    error_labels: list[str] = field(default_factory=list)
    close_connection: bool = False
    close_after_execution: bool = False
    block_ms: int = 0
    write_concern_error: Document | None = None
    app_name: str | None = None
    namespace: str | None = None


@dataclass
class Action:
    """What the server does to one command the fail point caught."""

    rule: FailCommand


class FailPoints:
    def __init__(self) -> None:
        self._rule: FailCommand | None = None
        self._mode: str = "off"
        self._count = 0  # times left, or skips left
        self._probability = 1.0
        self.times_entered = 0
        self._entered = asyncio.Event()  # set, and replaced, at each entry

    def configure(self, cmd: Document) -> Document:
        """Handle ``configureFailPoint``; returns the reply fields."""
        name = cmd.get("configureFailPoint")
        if name != "failCommand":
            raise MongoError(
                2, f"unknown fail point: {name!r} (the development server implements failCommand)"
            )
        mode = cmd.get("mode")
        previous = self.times_entered
        if mode == "off":
            self._mode, self._rule = "off", None
            return {"count": previous}
        data = cmd.get("data")
        if not isinstance(data, dict):
            raise bad_value("failCommand needs a data document")
        commands = data.get("failCommands")
        if not isinstance(commands, list) or not all(isinstance(c, str) for c in commands):
            raise bad_value("failCommand data.failCommands must be an array of command names")
        rule = FailCommand(
            commands=frozenset(commands),
            error_code=_opt_int(data, "errorCode"),
            error_labels=list(data.get("errorLabels") or []),
            close_connection=bool(data.get("closeConnection")),
            close_after_execution=bool(data.get("closeConnectionAfterExecution")),
            block_ms=(_opt_int(data, "blockTimeMS") or 0) if data.get("blockConnection") else 0,
            write_concern_error=data.get("writeConcernError"),
            app_name=data.get("appName"),
            namespace=data.get("namespace"),
        )
        if mode == "alwaysOn":
            self._mode, self._count = "alwaysOn", 0
        elif isinstance(mode, dict) and "times" in mode:
            self._mode, self._count = "times", int(mode["times"])
        elif isinstance(mode, dict) and "skip" in mode:
            self._mode, self._count = "skip", int(mode["skip"])
        elif isinstance(mode, dict) and "activationProbability" in mode:
            self._mode, self._probability = "random", float(mode["activationProbability"])
        else:
            raise bad_value(f"unknown fail point mode: {mode!r}")
        self._rule = rule
        self.times_entered = 0
        return {"count": previous}

    def check(self, command: str, app_name: str | None, namespace: str | None) -> Action | None:
        """The action for this command, consuming one activation if the fail point fires."""
        rule = self._rule
        if rule is None or command not in rule.commands or command == "configureFailPoint":
            return None
        if rule.app_name is not None and rule.app_name != app_name:
            return None
        if rule.namespace is not None and rule.namespace != namespace:
            return None
        if self._mode == "times":
            if self._count <= 0:
                return None
            self._count -= 1
            if self._count == 0:
                self._rule, self._mode = None, "off"
        elif self._mode == "skip":
            if self._count > 0:
                self._count -= 1
                return None
        elif self._mode == "random" and random.random() >= self._probability:
            return None
        self.times_entered += 1
        self._entered.set()
        self._entered = asyncio.Event()
        return Action(rule)

    async def wait_entered(self, times: int) -> None:
        """Return once the fail point has caught ``times`` commands since it was
        configured (a test's proof that a command is held, say, before it acts)."""
        while self.times_entered < times:
            await self._entered.wait()


def _opt_int(data: Document, key: str) -> int | None:
    value: Any = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_value(f"failCommand data.{key} must be a number")
    return int(value)
