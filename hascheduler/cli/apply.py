"""``hascheduler apply -f PATH`` and ``hascheduler export``: schedules kept as files.

``apply`` makes the schedules a file (YAML or JSON, several documents each), a directory
of them, or standard input (``-``) declares exist exactly as written, by id; with
``--prune --selector key=value`` it deletes the schedules carrying that label that no file
declares any more. ``--dry-run`` prints the plan and writes nothing. ``export`` writes
schedules as declarations, so ``export | apply -f -`` changes nothing.

Exit codes: 0 applied (or nothing to do); 1 a write failed (the plan's other writes still
went); 2 invalid input, every problem named, nothing written.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import yaml

from hascheduler.cli.remote import (
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    Unavailable,
    common_options,
    resolve_api,
)
from hascheduler.client import Client, HaschedulerError
from hascheduler.client.apply import (
    Outcome,
    Refused,
    Step,
    converge,
    declare,
    describe,
    execute,
    exported,
    prune_scope,
    read_cluster,
    read_plan,
)
from hascheduler.core.fields import MAX_JSON_DEPTH, json_depth, loads
from hascheduler.core.history import APPLY_ORIGIN
from hascheduler.worker.app import APP_LABEL, WorkerApp, WorkerConfigError, load_app

# Bounds on what one apply reads: a schedule is a few hundred bytes, so 16 MiB is tens of
# thousands of them; a larger input is refused before it is parsed.
MAX_INPUT_BYTES = 16 * 1024 * 1024
SUFFIXES = (".yaml", ".yml", ".json")
# From about 250 declarations on, the cluster is read while the input is parsed.
READ_AHEAD_BYTES = 64 * 1024
T = TypeVar("T")


def add_parser(sub: Any) -> None:
    common = common_options(after_action=False)
    ap = sub.add_parser(
        "apply", parents=[common], help="make the schedules files declare exist exactly as written"
    )
    ap.add_argument(
        "-f",
        "--filename",
        action="append",
        dest="paths",
        default=[],
        help="a YAML or JSON file, a directory of them, or - for standard input; repeatable",
    )
    ap.add_argument(
        "--app",
        help="module:attribute naming a hascheduler.worker.WorkerApp: "
        "apply the schedules it declares, pruning its own label "
        "(app=<its name>)",
    )
    ap.add_argument(
        "--prune",
        action="store_true",
        help="delete the schedules with the --selector label that the files no longer declare",
    )
    ap.add_argument(
        "--selector",
        help="key=value: the label of the schedules these files own (needed by --prune)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    ap.set_defaults(run=run_apply)
    ex = sub.add_parser(
        "export",
        parents=[common],
        help="write schedules as declarations apply takes back unchanged",
    )
    ex.add_argument("--selector", help="key=value: only schedules with this label")
    ex.add_argument(
        "--format", choices=["yaml", "json"], default="yaml", help="the output's format (yaml)"
    )
    ex.set_defaults(run=run_export)


def _selector(text: str | None) -> tuple[str, str] | None:
    if text is None:
        return None
    key, sep, value = text.partition("=")
    if not sep or not key or not value:
        raise Refused([f"--selector {text!r}: write it as key=value"])
    return key, value


# libyaml's parser where the wheel has it: ten times the pure-Python one's speed.
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _NoAliasLoader(_LOADER):  # type: ignore[misc]
    """Refuses aliases: an alias can make a small file expand into millions of nodes, and
    a schedule never needs one. Composing shares an alias's node rather than copying it,
    so the constructor meeting a node a second time is an alias, seen before anything is
    expanded."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        if node in self.constructed_objects:
            mark = node.start_mark
            where = f"line {mark.line + 1}: " if mark is not None else ""
            raise yaml.YAMLError(f"{where}aliases (*name) are not accepted")
        return super().construct_object(node, deep)


def _yaml_documents(text: str) -> list[Any]:
    return [d for d in yaml.load_all(text, Loader=_NoAliasLoader) if d is not None]


def _texts(paths: list[str]) -> Iterator[tuple[str, bytes]]:
    total = 0
    for name in paths:
        if name == "-":
            files: list[tuple[str, Path | None]] = [("<stdin>", None)]
        else:
            path = Path(name)
            if path.is_dir():
                files = [
                    (str(p), p)
                    for p in sorted(path.rglob("*"))
                    if p.is_file() and p.suffix in SUFFIXES
                ]
            elif path.is_file():
                files = [(name, path)]
            else:
                raise Refused([f"{name}: no such file or directory"])
        for origin, file in files:
            size = file.stat().st_size if file is not None else 0
            if size > MAX_INPUT_BYTES - total:
                raise Refused(
                    [
                        f"{origin}: more than {MAX_INPUT_BYTES // 2**20} MiB in all: "
                        "split it into several applies"
                    ]
                )
            data = (
                sys.stdin.buffer.read(MAX_INPUT_BYTES - total + 1)
                if file is None
                else file.read_bytes()
            )
            total += len(data)
            if total > MAX_INPUT_BYTES:
                raise Refused(
                    [
                        f"{origin}: more than {MAX_INPUT_BYTES // 2**20} MiB in all: "
                        "split it into several applies"
                    ]
                )
            yield origin, data


def documents(paths: list[str]) -> list[tuple[str, Any]]:
    """Every document the paths hold, each with where it came from. Raises Refused."""
    return _parsed(list(_texts(paths)))


def _parsed(texts: list[tuple[str, bytes]]) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    problems: list[str] = []
    for origin, data in texts:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"{origin}: not UTF-8 text (byte {exc.start})")
            continue
        try:
            if origin.endswith(".json"):
                parsed = loads(text)
                items = parsed if isinstance(parsed, list) else [parsed]
            else:
                if json_depth(data) > MAX_JSON_DEPTH:
                    raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
                items = _yaml_documents(text)
        except (yaml.YAMLError, ValueError) as exc:
            problems.append(f"{origin}: {exc}")
            continue
        except RecursionError:  # block nesting, by indentation alone, past the parser
            problems.append(f"{origin}: nested too deep to read")
            continue
        found += [(f"{origin}#{i + 1}", item) for i, item in enumerate(items)]
    if problems:
        raise Refused(problems)
    return found


def _in_background(work: Callable[[], T]) -> Future[T]:
    """``work`` on a daemon thread: a refused input returns at once, never waiting for a
    read it no longer needs (an executor's threads are joined at exit)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as exc:  # handed to whoever asks for the result
            future.set_exception(exc)

    threading.Thread(target=run, name="apply-read-ahead", daemon=True).start()
    return future


def plan_files(
    api: Client,
    paths: list[str],
    selector: tuple[str, str] | None,
    prune: bool,
    namespace: str | None = None,
) -> tuple[list[Step], frozenset[str]]:
    """The plan for the files at ``paths`` (declared in ``namespace`` when one is named),
    and the namespaces a prune deletes in. Raises Refused before any write. A large input
    is parsed while the cluster is read: parsing is this process's work, reading mostly
    the server's."""
    texts = list(_texts(paths))
    ahead = None
    if sum(len(data) for _, data in texts) >= READ_AHEAD_BYTES:
        ahead = _in_background(functools.partial(read_cluster, api, selector if prune else None))
    declared = declare(_parsed(texts), dt.datetime.now(dt.UTC), selector, namespace)
    scope = prune_scope(declared, namespace) if prune else frozenset()
    steps = read_plan(
        api,
        declared,
        selector if prune else None,
        ahead.result() if ahead is not None else None,
        scope,
    )
    return steps, scope


def declared_by(app: WorkerApp) -> tuple[list[tuple[str, Any]], tuple[str, str]]:
    """An app's declarations as documents, and the selector that owns them."""
    documents = [(f"{app.name}:{d['id']}", d) for d in app.declarations()]
    return documents, (APP_LABEL, str(app.name))


def sync_app(app: WorkerApp, api: str | None, token: str | None) -> int:
    """Apply what ``app`` declares and prune what it no longer does, converging with any
    other process doing the same (``worker --sync-schedules``, ``apply --app``)."""
    if not app.name:
        print(
            "--sync-schedules and apply --app need a named app: WorkerApp(name=...), "
            "whose name labels its schedules",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    try:
        documents, selector = declared_by(app)
        declared = declare(documents, dt.datetime.now(dt.UTC), selector)
        with Client(resolve_api(api), token, origin=APPLY_ORIGIN) as client:
            outcome = converge(client, declared, selector, prune_scope(declared, None))
    except (Refused, WorkerConfigError) as exc:
        return _refused(
            f"schedules of {app.name}", exc.problems if isinstance(exc, Refused) else [str(exc)]
        )
    except (HaschedulerError, Unavailable) as exc:
        print(f"schedules of {app.name}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    print(
        f"schedules of {app.name}: {len(declared)} declared, {len(outcome.done)} written",
        flush=True,
    )
    return _failures(f"schedules of {app.name}", outcome)


def _refused(who: str, problems: list[str]) -> int:
    print(f"{who}: nothing written:\n  " + "\n  ".join(problems), file=sys.stderr)
    return EXIT_REFUSED


def _failures(who: str, outcome: Outcome) -> int:
    """Each write that failed, and the exit code."""
    for step, reason in outcome.failed:
        print(f"{who}: {step.action} {step.schedule_id} failed: {reason}", file=sys.stderr)
    return EXIT_UNAVAILABLE if outcome.failed else 0


def run_apply(args: argparse.Namespace) -> int:
    if args.app:
        if args.paths or args.selector:
            print(
                "hascheduler apply: --app applies what the app declares, pruning by its "
                "name: without -f or --selector",
                file=sys.stderr,
            )
            return EXIT_REFUSED
        try:
            app = load_app(args.app, None, None)
        except WorkerConfigError as exc:
            print(f"hascheduler apply: {exc}", file=sys.stderr)
            return EXIT_REFUSED
        return sync_app(app, args.api, args.token)
    if not args.paths:
        print("hascheduler apply: -f PATH (or --app) is required", file=sys.stderr)
        return EXIT_REFUSED
    try:
        selector = _selector(args.selector)
        if args.prune and selector is None:
            raise Refused(
                ["--prune needs --selector key=value: it never deletes schedules outside it"]
            )
        with Client(
            resolve_api(args.api), args.token, reason=args.reason, origin=APPLY_ORIGIN
        ) as api:
            steps, scope = plan_files(api, args.paths, selector, args.prune, args.namespace)
            if args.prune and selector is not None:
                print(
                    f"prune: schedules labelled {selector[0]}={selector[1]} that no file "
                    f"declares, in {', '.join(sorted(scope)) or 'no namespace'}"
                )
            print(describe(steps))
            if args.dry_run:
                return 0
            outcome = execute(api, steps)
    except Refused as exc:
        return _refused("hascheduler apply", exc.problems)
    except (HaschedulerError, Unavailable) as exc:
        print(f"hascheduler apply: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    written = len(outcome.done)
    print(
        "nothing to do"
        if not written and not outcome.failed
        else f"applied: {written} written, {len(outcome.failed)} failed"
    )
    return _failures("hascheduler apply", outcome)


def run_export(args: argparse.Namespace) -> int:
    try:
        selector = _selector(args.selector)
        with Client(resolve_api(args.api), args.token) as api:
            items = [
                exported(s) for s in api.schedules(labels=dict([selector]) if selector else None)
            ]
    except Refused as exc:
        print("hascheduler export: " + "; ".join(exc.problems), file=sys.stderr)
        return EXIT_REFUSED
    except (HaschedulerError, Unavailable) as exc:
        print(f"hascheduler export: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.format == "json":
        print(json.dumps(items, indent=2))
    else:
        print(yaml.safe_dump_all(items, sort_keys=False), end="")
    return 0
