"""Settings as tables: each command states its settings once, as (flag, environment
variable, default, parser), and the argument parser, the help and the error messages come
from the table. A flag wins over its environment variable, which wins over the default; a
value from either that does not parse is ``ConfigError`` (exit 2) naming both."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pymongo import uri_parser
from pymongo.errors import ConfigurationError, InvalidURI

from hascheduler.core.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    flag: str
    default: Any  # a value, not text; None when there is none
    parse: Callable[[str], Any]  # text to value; raises ValueError saying why not
    help: str
    env: str | None = None  # default HASCHEDULER_<FLAG>
    fallback_env: str | None = None  # read when ``env`` is unset (POD_NAME)
    required: bool = False
    switch: bool = False  # a flag without a value (its environment variable says true)

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env_name(self) -> str:
        return self.env or "HASCHEDULER_" + self.dest.upper()


def add_command(
    sub: Any,
    name: str,
    table: Sequence[Setting],
    run: Callable[[argparse.Namespace], int],
    **parser: Any,
) -> None:
    """A command whose options are exactly ``table``."""
    command = sub.add_parser(name, **parser)
    add_settings(command, table)
    command.set_defaults(run=run)


def add_settings(parser: argparse.ArgumentParser, table: Sequence[Setting]) -> None:
    for s in table:
        env = s.env_name + (f" or {s.fallback_env}" if s.fallback_env else "")
        default = f"; default {s.default}" if s.default not in (None, "") else ""
        if s.switch:
            parser.add_argument(
                s.flag,
                action="store_const",
                const="true",
                default=None,
                help=f"{s.help} (env {env}=true)",
            )
        else:
            parser.add_argument(s.flag, default=None, help=f"{s.help} (env {env}{default})")


def resolve(
    args: argparse.Namespace, table: Sequence[Setting], environ: Mapping[str, str] = os.environ
) -> dict[str, Any]:
    """Every setting of ``table`` as a value, by its ``dest``. Raises ConfigError: for a
    value that does not parse first, then for a required setting that has none."""
    values: dict[str, Any] = {}
    missing = []
    for s in table:
        text = getattr(args, s.dest, None)
        if text is None:
            text = (
                environ.get(s.env_name)
                or (environ.get(s.fallback_env) if s.fallback_env else None)
                or None
            )
        if text is None:
            if s.required:
                missing.append(s)
            values[s.dest] = s.default
            continue
        try:
            values[s.dest] = s.parse(text)
        except ValueError as exc:
            raise ConfigError(f"{s.flag} / {s.env_name}: {exc}") from None
    if missing:
        raise ConfigError(f"{missing[0].flag} (or {missing[0].env_name}) is required")
    return values


# Parsers: text to value, or ValueError with the reason.


def text(value: str) -> str:
    return value


def whole_number(minimum: int = 1) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a whole number") from None
        if number < minimum:
            raise ValueError(f"{value!r} must be at least {minimum}")
        return number

    return parse


positive_int = whole_number(1)


def port(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a port number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"{number} is not a port number (0-65535; 0 picks a free one)")
    return number


def positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number") from None
    if not number > 0:
        raise ValueError(f"{value!r} must be greater than 0")
    return number


def number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number") from None


def boolean(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"true", "1", "yes"}:
        return True
    if lowered in {"false", "0", "no", ""}:
        return False
    raise ValueError(f"{value!r} is not true or false")


def mongodb_uri(value: str) -> str:
    try:
        uri_parser.parse_uri(value)
    except (InvalidURI, ValueError, ConfigurationError) as exc:
        raise ValueError(f"{value!r} is not a MongoDB URI: {exc}") from None
    return value
