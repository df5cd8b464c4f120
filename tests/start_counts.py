"""The suite's expensive starts, counted per test file from the start-up ledger.

Every process of the suite inherits ``LLMBATCH_START_LOG`` (llmbatch.startlog): the test
workers, the Ray clusters they start, the replicas in those clusters, the CLI drivers and the
plain-vLLM references the tests run. Each xdist worker writes its own file (``gw0.jsonl``,
...), and a line is put on the test file that ran on that worker when the start began (a
module fixture's engine on the file whose first test set it up).

Counted: engine starts (llmbatch's vLLM and SGLang engines, restarts included, an engine a job's
driver launched for its replica once: the replica's attach is none; plain-vLLM references;
``vllm serve``), Ray clusters started (by a test, or by llmbatch itself where no
cluster was there to join), and CLI processes (``llmbatch ...``, ``llmbatch serve`` included).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

#: set it to keep the ledger files after the session (else a folder of its own, removed at the end)
START_DIR_ENV = "LLMBATCH_TEST_START_DIR"
OWN_PREFIX = "lbt-starts-"
ENGINE_KINDS = ("vllm-engine", "sglang-engine", "vllm-reference", "vllm-serve")
BETWEEN = "(between tests)"


def log_here() -> None:
    """Point this process's start-up ledger at its worker's file (the folder is made once, by
    the first pytest process, and inherited by the workers it starts)."""
    folder = os.environ.get(START_DIR_ENV)
    if not folder:
        folder = tempfile.mkdtemp(prefix=OWN_PREFIX, dir="/tmp")
        os.environ[START_DIR_ENV] = folder
    Path(folder).mkdir(parents=True, exist_ok=True)  # one named by the caller may not exist yet
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.environ["LLMBATCH_START_LOG"] = str(Path(folder) / f"{worker}.jsonl")


def _file_at(phases: list[tuple[str, str, float, float]], worker: str, t0: float) -> str:
    """The test file running on ``worker`` at ``t0``; else the last one that started before."""
    best, best_start = BETWEEN, float("-inf")
    for w, path, start, stop in phases:
        if w != worker:
            continue
        if start <= t0 <= stop:
            return path
        if best_start < start <= t0:
            best, best_start = path, start
    return best


def count_starts(folder: Path, phases, file_seconds: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per test file: its seconds and its engine, Ray and CLI starts (with their seconds)."""
    table: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for path, seconds in file_seconds.items():
        table[path]["seconds"] = seconds
    detail: list[dict] = []
    for ledger in sorted(folder.glob("*.jsonl")):
        for line in ledger.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            where = _file_at(phases, ledger.stem, entry["t0"])
            row = table[where]
            kind = entry["kind"]
            if entry.get("phase") == "begin" or kind == "warm-host-stop":
                detail.append({"worker": ledger.stem, "file": where, **entry})
            # a start counts by the line of its beginning (a killed one too), its seconds by the
            # line of its end
            begins = entry.get("phase") == "begin"
            if kind in ENGINE_KINDS and entry.get("attach"):
                # a replica that attaches to the engine its driver launched starts none (the
                # launcher's line counts it), unless it fell back to its own (its line's end says)
                own = not begins and entry.get("attached") is False
                row["engines"] += own
                row["engine_s"] += (entry.get("seconds") or 0.0) if own else 0.0
            elif kind in ENGINE_KINDS:
                row["engines"] += begins
                row["engine_s"] += entry.get("seconds") or 0.0
            elif begins and (kind == "ray-cluster" or (kind == "ray-init" and not entry.get("joined"))):
                row["ray"] += 1
            elif begins and kind == "cli":
                row["cli"] += 1
            elif kind == "warm-host-stop" and entry.get("engine"):  # a warm engine stopped (and why)
                row["stops"] += 1
                table["(warm engines stopped)"][entry.get("why", "?")] += 1
    if folder.name.startswith(OWN_PREFIX):  # ours: a folder named by the one who ran pytest stays
        shutil.rmtree(folder, ignore_errors=True)
    else:  # every start with its test file, to see which starts a file could share
        (folder / "starts-by-file.json").write_text(json.dumps(sorted(detail, key=lambda d: d["t0"]), indent=1))
    return table


def format_counts(table: dict[str, dict[str, float]]) -> list[str]:
    stopped = dict(table.pop("(warm engines stopped)", {}))
    rows = sorted(table.items(), key=lambda kv: (-kv[1].get("engines", 0), -kv[1].get("seconds", 0)))
    lines = [f"{'file':52} {'seconds':>8} {'engines':>7} {'engine s':>8} {'ray':>4} {'cli':>4}"]
    totals: dict[str, float] = defaultdict(float)
    for path, row in rows:
        for key in ("seconds", "engines", "engine_s", "ray", "cli"):
            totals[key] += row.get(key, 0)
        if not any(row.get(k) for k in ("engines", "ray", "cli")):
            continue
        lines.append(f"{path:52} {row.get('seconds', 0):8.1f} {int(row.get('engines', 0)):7d} "
                     f"{row.get('engine_s', 0):8.1f} {int(row.get('ray', 0)):4d} {int(row.get('cli', 0)):4d}")
    lines.append(f"{'total':52} {totals['seconds']:8.1f} {int(totals['engines']):7d} {totals['engine_s']:8.1f} "
                 f"{int(totals['ray']):4d} {int(totals['cli']):4d}")
    lines.append(f"engine cold starts: {int(totals['engines'])} ({totals['engine_s']:.0f} s starting), "
                 f"Ray clusters started: {int(totals['ray'])}, CLI processes: {int(totals['cli'])}")
    if stopped:  # a warm engine stopped before the suite ended: its settings' next run starts one again
        lines.append(f"warm engines stopped: {sum(stopped.values()):.0f} ("
                     + ", ".join(f"{why}: {n:.0f}" for why, n in sorted(stopped.items())) + ")")
    return lines
