"""The ``hascheduler`` command: one subcommand per module of this package; the development
tools (``devmongo``, ``dev``) join by entry point when installed."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from hascheduler.core.errors import ConfigError
from hascheduler.process import gcpolicy, logs

# A command module (hascheduler.cli.<module>) offers add_parser(subparsers), which adds
# these commands and sets ``run`` (args -> exit code) as their parsers' default. Only the
# named command's module is imported: a command that talks to the API need not load the
# replica and the worker (tests/test_layout.py).
COMMAND_MODULES = {
    "serve": "serve",
    "worker": "worker",
    "schedules": "schedules",
    "audit-log": "schedules",
    "runs": "schedules",
    "webhooks": "schedules",
    "backfills": "schedules",
    "apply": "apply",
    "export": "apply",
    "audit": "audit",
    "token": "tokens",
    "completion": "completion",
}
# The entry point group the development tools register their commands in (dev/pyproject.toml).
PLUGIN_GROUP = "hascheduler.commands"
DEVELOPMENT_COMMANDS = {
    "devmongo": "run the MongoDB-wire-compatible development server",
    "dev": "run the whole cluster locally, or control it",
}


class _FirstLook(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)  # the full parser reports it, with the right usage


def _command_in(argv: Sequence[str] | None) -> str | None:
    """The command ``argv`` names, read before the full parser is built (None when it
    names none it can read)."""
    first = _FirstLook(add_help=False)
    first.add_argument("--log-level")
    first.add_argument("command", nargs="?")
    try:
        named: str | None = first.parse_known_args(argv)[0].command
    except ValueError:
        return None
    return named


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for the command ``argv`` names: only its module is imported, and of the
    commands that come by entry point only the one named (the development server's, for
    one, imports mongomock: no replica's start pays for that). With no command, or one
    that does not exist, every built-in command is listed."""
    parser = argparse.ArgumentParser(
        prog="hascheduler",
        description="A highly available scheduler cluster: replicas "
        "(serve), workers (worker), the HTTP API from a terminal (schedules, runs, audit), "
        "and schedules kept as files (apply, export).",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the least severe log events written (info)",
    )
    parser.add_argument("--version", action="version", version=f"hascheduler {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = _command_in(argv)
    if wanted in COMMAND_MODULES:
        # The other commands are not listed: reading every installed package's entry
        # points was most of the time building the parser took.
        with gcpolicy.importing():
            command = importlib.import_module(f"hascheduler.cli.{COMMAND_MODULES[wanted]}")
        command.add_parser(sub)
        return parser
    from importlib.metadata import entry_points

    plugins = {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}
    if wanted not in plugins:  # no command, or one to refuse: the full list, for the
        # usage and the error
        for module in dict.fromkeys(COMMAND_MODULES.values()):
            importlib.import_module(f"hascheduler.cli.{module}").add_parser(sub)
    for name in sorted(plugins.keys() | DEVELOPMENT_COMMANDS.keys()):
        text = DEVELOPMENT_COMMANDS.get(
            name, f"from {plugins[name].value}" if name in plugins else ""
        )
        if name in plugins and name == wanted:
            with gcpolicy.importing():
                plugin = plugins[name].load()
            plugin.add_parser(sub)
        elif name in plugins:
            sub.add_parser(name, help=text)  # listed; built when it is the one asked for
        else:
            missing = sub.add_parser(
                name, help=f"{text} (needs the development tools)", add_help=False
            )
            missing.set_defaults(run=_not_installed)
    return parser


def _not_installed(args: argparse.Namespace) -> int:
    raise ConfigError(
        "comes with the development tools, which are not installed here: "
        "pip install 'hascheduler[dev]' (./scripts/hascheduler installs them)"
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hascheduler")
    except PackageNotFoundError:
        return "(not installed)"


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The parser of the (sub)command ``args`` ran: an unknown flag is reported with its
    usage, not the top-level one."""
    found: Any = parser
    for dest in ("command", "action"):
        chosen = getattr(args, dest, None)
        subparsers = [a for a in found._actions if isinstance(a, argparse._SubParsersAction)]
        if chosen is None or not subparsers or chosen not in subparsers[0].choices:
            break
        found = subparsers[0].choices[chosen]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argv)
    args, rest = parser.parse_known_args(argv)
    if rest and args.run is not _not_installed:
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(rest)}")
    logs.configure(args.log_level)
    try:
        code: int = args.run(args)
    except ConfigError as exc:  # every command reports a wrong setting the same way
        print(f"hascheduler {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `| head` closed the pipe: what was wanted was read
        # Python flushes stdout at exit again; pointed at nothing, that says nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code
