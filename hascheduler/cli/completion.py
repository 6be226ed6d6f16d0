"""``hascheduler completion bash|zsh``: a shell completion script, made from the commands'
own parsers, so it names every command, action and option as they are."""

from __future__ import annotations

import argparse
import shlex
from typing import Any


def add_parser(sub: Any) -> None:
    completion = sub.add_parser(
        "completion",
        help='print a completion script: eval "$(hascheduler completion bash)" (or zsh)',
    )
    completion.add_argument("shell", choices=["bash", "zsh"], help="the shell it is for")
    completion.set_defaults(run=run)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--"))


def script(parser: argparse.ArgumentParser) -> str:
    """The bash completion of ``parser``'s commands, their actions and options."""
    commands = _subcommands(parser)
    cases = []
    for name, command in sorted(commands.items()):
        actions = _subcommands(command)
        words = sorted(actions) if actions else _options(command)
        cases.append(f"    {shlex.quote(name)}) words={shlex.quote(' '.join(words))} ;;")
        for action, sub in sorted(actions.items()):
            options = " ".join(_options(sub))
            cases.append(f"    {shlex.quote(name + ' ' + action)}) words={shlex.quote(options)} ;;")
    return "\n".join(
        [
            "_hascheduler() {",
            '  local cur="${COMP_WORDS[COMP_CWORD]}" key="${COMP_WORDS[1]}" words=""',
            '  [ "$COMP_CWORD" -gt 2 ] && key="${COMP_WORDS[1]} ${COMP_WORDS[2]}"',
            f'  [ "$COMP_CWORD" -eq 1 ] && words={shlex.quote(" ".join(sorted(commands)))}',
            '  [ "$COMP_CWORD" -gt 1 ] && case "$key" in',
            *cases,
            "  esac",
            '  mapfile -t COMPREPLY < <(compgen -W "$words" -- "$cur")',
            "}",
            "complete -F _hascheduler hascheduler",
        ]
    )


def run(args: argparse.Namespace) -> int:
    from hascheduler.cli.main import build_parser

    bash = script(build_parser([]))
    print(bash if args.shell == "bash" else f"autoload -U +X bashcompinit && bashcompinit\n{bash}")
    return 0
