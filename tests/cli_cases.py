"""Several ``llmbatch ARGS`` cases in one process of their own, for cases whose own process is
the point only for how it is set up: file permissions a root process gave up before it ran, or a
variable read once at import (``HF_HUB_OFFLINE``). One start of Python and llmbatch's imports
for all of them instead of one per case; each case runs the CLI's own entry point as
``tests/inproc.py`` does, with its own folder and variables.

``python tests/cli_cases.py CASES.json RESULTS.json``: CASES is a JSON list of
``{"args": [...], "cwd": "...", "env": {...}}``; RESULTS gets, in the same order,
``{"returncode", "stdout", "stderr"}`` of each (a file, not stdout: what a case prints must not
mix with them). The start-up ledger counts this process as one CLI process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from inproc import llmbatch

from llmbatch import startlog


def main() -> None:
    cases_path, results_path = sys.argv[1:3]
    cases = json.loads(Path(cases_path).read_text())
    with startlog.timed("cli", command="cases"):
        results = [llmbatch(*case["args"], cwd=case["cwd"], env=case["env"]) for case in cases]
    Path(results_path).write_text(json.dumps(
        [{"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr} for r in results]))


if __name__ == "__main__":
    main()
