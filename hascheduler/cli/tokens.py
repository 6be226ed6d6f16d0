"""``hascheduler token create``: a named token for the access file. The secret is printed
once, here; the file keeps only its salted hash, so nothing that reads the file (or a
backup of the Secret holding it) can act with it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hascheduler.api.access import (
    AccessConfigError,
    create_token,
    entry_line,
    parse_actions,
    parse_namespaces,
)
from hascheduler.cli.remote import EXIT_REFUSED


def add_parser(sub: Any) -> None:
    token = sub.add_parser("token", help="named API tokens for the access file")
    actions = token.add_subparsers(dest="action", required=True)
    create = actions.add_parser(
        "create",
        help="make a token: print its secret once, and "
        "the line to add under tokens: in the "
        "access file",
    )
    create.add_argument(
        "--name", required=True, help="who acts with it: the audit trail's actor (e.g. billing-ci)"
    )
    create.add_argument(
        "--actions",
        required=True,
        help="comma-separated: read, write, trigger, pause, cancel, admin",
    )
    create.add_argument(
        "--namespaces", required=True, help="comma-separated namespaces it may act in, or *"
    )
    create.add_argument(
        "--json", action="store_true", help="the secret and the entry as one JSON object"
    )
    create.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        made = create_token(
            args.name,
            parse_actions(args.actions, "--actions"),
            parse_namespaces(args.namespaces, "--namespaces"),
        )
    except AccessConfigError as exc:
        print(f"hascheduler token create: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        print(json.dumps({"secret": made.secret, "entry": made.entry}))
        return 0
    print(f"secret (shown once; give it to {args.name} as HASCHEDULER_TOKEN):")
    print(f"  {made.secret}")
    print("add under tokens: in the access file (--access-file), which re-reads it:")
    print(entry_line(made.entry))
    return 0
