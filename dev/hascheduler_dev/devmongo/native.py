"""The development server's hot modules compiled to C with mypyc, and loaded in its process.

The server is one Python process that every replica, worker and benchmark shares; at 10,000
fires a second it is the busiest process on the machine. mypyc (part of mypy, which the
project already type-checks with) compiles the modules every write runs through (storage,
engine, values, changes) from the same typed sources, with no change to what they do.

A build is kept in ``dev/.compiled/devmongo-<digest>``, where the digest covers those
sources, mypy's version and the interpreter: an edited source, another mypy or another
Python has no build, and the server then runs the sources as they are (never a stale
build). Only ``hascheduler devmongo`` loads a build (``load()``, before it imports the
server); a process that imports the modules otherwise, such as the test process, runs the
sources, so tests that replace a function in them keep doing so.

    python -m hascheduler_dev.devmongo.native build   # or: status
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import hascheduler_dev
import hascheduler_dev.devmongo as package

COMPILED = ("values", "changes", "engine", "storage")
SOURCES = Path(package.__file__).parent
BUILDS = Path(hascheduler_dev.__file__).parent.parent / ".compiled"
BUILD_TIMEOUT_S = 600.0


def digest() -> str:
    """What a build is valid for: the compiled sources, mypyc's version, the interpreter."""
    from mypy.version import __version__ as mypy_version

    h = hashlib.sha256()
    for name in COMPILED:
        h.update(name.encode() + b"\0" + (SOURCES / f"{name}.py").read_bytes() + b"\0")
    h.update(f"{mypy_version}\0{sys.version}\0{sysconfig.get_config_var('EXT_SUFFIX')}".encode())
    return h.hexdigest()[:20]


def build_dir() -> Path | None:
    """Where the build for these sources lives (whether or not it exists); None when mypy,
    and so mypyc, is not installed (the image's development target)."""
    try:
        return BUILDS / f"devmongo-{digest()}"
    except ImportError:
        return None


def built() -> Path | None:
    where = build_dir()
    return where if where is not None and (where / "complete").is_file() else None


def load() -> bool:
    """Use the build for these sources, if there is one, for the modules imported from now
    on; whether it will be used. Call before anything imports the compiled modules."""
    where = built()
    if where is None:
        return False
    if any(f"{package.__name__}.{name}" in sys.modules for name in COMPILED):
        return False  # the sources are in use already: mixing the two is not supported
    sys.path.insert(0, str(where / "lib"))  # the modules' shared library
    package.__path__.insert(0, str(where / "devmongo"))
    return True


def running_compiled() -> bool:
    """Whether this process's storage module is the compiled one."""
    from hascheduler_dev.devmongo import storage

    return not str(storage.__file__).endswith(".py")


def build() -> Path:
    """Compile the modules for the current sources unless already built; the build's
    directory. Raises RuntimeError (with mypyc's output) when compiling fails."""
    where = build_dir()
    if where is None:
        raise RuntimeError("mypy (which carries mypyc) is not installed")
    if (where / "complete").is_file():
        return where
    BUILDS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BUILDS, prefix="building-") as tmp:
        work = Path(tmp)
        tree = work / "hascheduler_dev" / "devmongo"
        tree.mkdir(parents=True)
        # The whole package beside the compiled modules, so that mypyc's type check
        # resolves their imports of the other modules as it does in the repository.
        shutil.copy(SOURCES.parent / "__init__.py", tree.parent)
        for source in SOURCES.glob("*.py"):
            shutil.copy(source, tree)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "mypyc",
                *(f"hascheduler_dev/devmongo/{n}.py" for n in COMPILED),
            ],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
            env={**os.environ, "MYPY_CACHE_DIR": str(work / ".mypy_cache")},
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"mypyc failed ({done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
            )
        out = work / "out"
        (out / "lib").mkdir(parents=True)
        (out / "devmongo").mkdir()
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        for shared in work.glob(f"*__mypyc{suffix}"):
            shutil.move(shared, out / "lib")
        for name in COMPILED:
            shutil.move(tree / f"{name}{suffix}", out / "devmongo")
        (out / "complete").write_text("")
        try:
            out.rename(where)  # atomic: a concurrent build of the same digest won first
        except OSError:
            if not (where / "complete").is_file():
                raise
    for stale in BUILDS.glob("devmongo-*"):
        if stale != where:
            shutil.rmtree(stale, ignore_errors=True)
    return where


def main(argv: list[str]) -> int:
    if argv == ["build"]:
        try:
            print(f"development server compiled: {build()}")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(
                f"development server not compiled (it runs from its sources): {exc}",
                file=sys.stderr,
            )
            return 1
        return 0
    if argv == ["status"]:
        where = built()
        print(f"compiled: {where}" if where else "not compiled for these sources")
        return 0
    print("usage: python -m hascheduler_dev.devmongo.native build|status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
