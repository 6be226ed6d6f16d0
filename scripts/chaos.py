#!/usr/bin/env python3
"""Chaos soak of the local cluster; see bench/chaos.py (`scripts/chaos.py --help`).

Runs from a clean checkout with only Python 3.11+: it first makes sure .venv holds the
project, then runs itself there.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"

if __name__ == "__main__":
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        subprocess.run(
            ["bash", "-c", "source scripts/_venv.sh && ensure_venv"], cwd=ROOT, check=True
        )
        os.execv(VENV_PYTHON, [str(VENV_PYTHON), __file__, *sys.argv[1:]])
    sys.path.insert(0, str(ROOT))
    from bench.chaos import main

    sys.exit(main())
