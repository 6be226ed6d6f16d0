"""What every command that calls the HTTP API shares: which API (``--api``,
HASCHEDULER_API, or the ``hascheduler dev`` cluster running from this directory: its
state directory HASCHEDULER_DEV_STATE_DIR, default .hascheduler-dev), the common options,
and the exit codes: 0 done; 2 the input was refused (locally, or by the API with a 4xx
naming the field); 1 the API could not be reached or failed."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from hascheduler.client import AsyncClient, NotFound, local_cluster
from hascheduler.core.triggers import MAX_DURATION_CHARS, InvalidTrigger, parse_duration

EXIT_REFUSED = 2
EXIT_UNAVAILABLE = 1


class Refused(Exception):
    """Input refused before or by the API; the message says which field and why."""


class Unavailable(Exception):
    """The API could not be reached, or answered with a server error."""


def common_options(after_action: bool) -> argparse.ArgumentParser:
    """The options of every command, before its action or (SUPPRESS: a value given before
    is not reset) after it."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if after_action else value

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--api",
        default=default(os.environ.get("HASCHEDULER_API")),
        help="base URL of a replica's API (env HASCHEDULER_API; default: "
        "the local `hascheduler dev` cluster)",
    )
    common.add_argument(
        "--token",
        default=default(os.environ.get("HASCHEDULER_TOKEN")),
        help="API token, needed when the replicas have tokens configured "
        "(env HASCHEDULER_TOKEN; the environment keeps it out of `ps`)",
    )
    common.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON instead of a table"
    )
    common.add_argument(
        "--namespace",
        default=default(os.environ.get("HASCHEDULER_NAMESPACE")),
        help="the namespace to list, or to create in (env "
        "HASCHEDULER_NAMESPACE; default: every one the token reaches, "
        "and 'default' for a new schedule)",
    )
    common.add_argument(
        "--reason", default=default(None), help="why: recorded in the audit trail with the change"
    )
    return common


class Actions:
    """A command's actions, each taking the common options after it too."""

    def __init__(self, command: Any) -> None:
        self.actions = command.add_subparsers(dest="action", required=True)
        self.after = common_options(after_action=True)

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        return self.actions.add_parser(name, parents=[self.after], **kwargs)


def resolve_api(explicit: str | None) -> str:
    """The API to call; raises Unavailable saying how to name one."""
    try:
        return local_cluster.find_api(explicit)
    except local_cluster.ControlError as exc:
        raise Unavailable(str(exc)) from None


def duration(text: str, flag: str) -> float:
    """``text`` in seconds: a number, or a duration as the API reads one (30s, 1h30m,
    PT5M: core/triggers.parse_duration). Its bounds are the API's, which names the field;
    a number JSON cannot carry (NaN, infinite) is refused here. Raises Refused."""
    try:
        seconds = float(text)
    except ValueError:
        try:
            seconds = parse_duration(text)
        except InvalidTrigger as exc:
            raise Refused(f"{flag}: {exc}") from None
    if not math.isfinite(seconds):
        raise Refused(f"{flag} {text[:MAX_DURATION_CHARS]!r}: a finite duration")
    return seconds


async def schedule_handle(api: AsyncClient, handle: str, namespace: str | None) -> str:
    """The id of the schedule ``handle`` names: its id, or its name when no schedule has
    that id (unique in the namespaces read, else refused naming the ids)."""
    try:
        await api.get_schedule(handle)
        return handle
    except NotFound:
        pass
    named = [s.id async for s in api.schedules(namespace=namespace) if s.name == handle]
    if len(named) > 1:
        raise Refused(f"{handle!r} names {len(named)} schedules ({', '.join(named)}): use an id")
    if not named:
        raise Refused(f"schedule {handle!r} does not exist (no schedule has that id or name)")
    return named[0]
