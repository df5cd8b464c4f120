"""Live progress for a person at a terminal, log lines for everything else, and the report.

While a job runs, :class:`Progress` shows rows done/total, rows/s, input and output tokens/s,
errors, ETA and per-replica activity (a rich live table on a TTY, a plain line every few
seconds otherwise), and writes ``progress.json`` in the job directory once a second so that
``llmbatch status`` can show the same from another terminal.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path
from typing import Any

from llmbatch.errors import MissingDependencyError
from llmbatch.io.files import atomic_write_json

WINDOW_S = 30.0


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


class Progress:
    """Counts what a run commits and shows it (see module docstring)."""

    def __init__(self, total: int, done_before: int = 0, errors_before: int = 0, *,
                 progress_path: Path | None = None, tty: bool | None = None, log_every: float = 10.0,
                 quiet: bool = False, label: str = "llmbatch"):
        self.total = total
        self.done_before = done_before
        self.errors_before = errors_before
        self.progress_path = progress_path
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.log_every = log_every
        self.quiet = quiet
        self.label = label
        self.started = time.time()
        self.first_row_at: float | None = None
        #: moments of the run (``ray_ready``...) that stats.json turns into start-up phases
        self.marks: dict[str, float] = {}
        self.ok = 0
        self.errors = 0
        self.in_tokens = 0
        self.generated_tokens = 0   # what the engine produced
        self.delivered_tokens = 0   # what the output holds (answers copied by dedup included)
        self.cached_tokens = 0
        self.deduped = 0
        self.error_types: collections.Counter[str] = collections.Counter()
        self.replicas: collections.Counter[str] = collections.Counter()
        self.timeline: list[tuple[float, int, int, int]] = []  # (t, rows, in_tokens, generated_tokens)
        self._recent: collections.deque[tuple[float, int, int, int, int, dict[str, int]]] = collections.deque()
        self.state = "running"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._tick_lock = threading.Lock()  # a snapshot is written whole, and never after a newer one
        self._thread: threading.Thread | None = None
        self._live = None
        self._last_log = 0.0

    # -- counting ----------------------------------------------------------------------------

    def arrived(self) -> None:
        """Note that rows have started to come back (steady-state throughput starts here)."""
        if self.first_row_at is None:
            self.first_row_at = time.time()

    def add(self, ok: int, errors: int, in_tokens: int, generated_tokens: int, delivered_tokens: int = 0,
            cached_tokens: int = 0, deduped: int = 0, error_types: dict[str, int] | None = None,
            replicas: dict[str, int] | None = None) -> None:
        now = time.time()
        with self._lock:
            if self.first_row_at is None:
                self.first_row_at = now
            self.ok += ok
            self.errors += errors
            self.in_tokens += in_tokens
            self.generated_tokens += generated_tokens
            self.delivered_tokens += delivered_tokens
            self.cached_tokens += cached_tokens
            self.deduped += deduped
            self.error_types.update(error_types or {})
            self.replicas.update(replicas or {})
            self._recent.append((now, ok + errors, in_tokens, generated_tokens, delivered_tokens, dict(replicas or {})))

    @property
    def done(self) -> int:
        return self.done_before + self.ok + self.errors

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        with self._lock:
            while self._recent and now - self._recent[0][0] > WINDOW_S:
                self._recent.popleft()
            span = max(1e-6, min(WINDOW_S, now - (self.first_row_at or now)) or 1e-6)
            recent_rows = sum(r[1] for r in self._recent)
            recent_in = sum(r[2] for r in self._recent)
            recent_gen = sum(r[3] for r in self._recent)
            recent_del = sum(r[4] for r in self._recent)
            per_replica: collections.Counter[str] = collections.Counter()
            for r in self._recent:
                per_replica.update(r[5])
            elapsed = now - self.started
            rows_per_s = recent_rows / span if self.first_row_at else 0.0
            remaining = self.total - self.done
            eta = remaining / rows_per_s if rows_per_s > 0 else None
            return {
                "state": self.state,
                "rows_total": self.total,
                "rows_done": self.done,
                "rows_ok": self.done_before - self.errors_before + self.ok,
                "rows_error": self.errors_before + self.errors,
                "this_run": {"ok": self.ok, "errors": self.errors, "input_tokens": self.in_tokens,
                             "generated_tokens": self.generated_tokens, "delivered_tokens": self.delivered_tokens,
                             "cached_tokens": self.cached_tokens, "deduplicated_rows": self.deduped},
                "rows_per_s": round(rows_per_s, 3),
                "input_tokens_per_s": round(recent_in / span, 1) if self.first_row_at else 0.0,
                "generated_tokens_per_s": round(recent_gen / span, 1) if self.first_row_at else 0.0,
                "delivered_tokens_per_s": round(recent_del / span, 1) if self.first_row_at else 0.0,
                "elapsed_s": round(elapsed, 1),
                "eta_s": None if eta is None else round(eta, 1),
                "error_types": dict(self.error_types),
                "replicas": {k: round(v / span, 2) for k, v in per_replica.items()},
                "updated_at": now,
            }

    # -- showing -----------------------------------------------------------------------------

    def line(self, snap: dict[str, Any]) -> str:
        pct = 100.0 * snap["rows_done"] / max(1, snap["rows_total"])
        if self.first_row_at is None:
            return (f"[{self.label}] {snap['rows_done']:,}/{snap['rows_total']:,} rows ({pct:.1f}%) | starting: "
                    f"engine replicas are loading the model ({fmt_duration(snap['elapsed_s'])})")
        return (f"[{self.label}] {snap['rows_done']:,}/{snap['rows_total']:,} rows ({pct:.1f}%) | "
                f"{snap['rows_per_s']:.1f} rows/s | in {snap['input_tokens_per_s']:.0f} tok/s | "
                f"out {_out_rates(snap)} | errors {snap['rows_error']:,} | "
                f"ETA {fmt_duration(snap['eta_s'])} | replicas {len(snap['replicas'])}")

    def _table(self, snap: dict[str, Any]):
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table(title=self.label, show_header=False, box=None)
        table.add_column(justify="right", style="bold")
        table.add_column()
        table.add_row("rows", ProgressBar(total=max(1, snap["rows_total"]), completed=snap["rows_done"], width=40))
        table.add_row("", f"{snap['rows_done']:,} / {snap['rows_total']:,}  ({snap['rows_error']:,} errors)")
        table.add_row("throughput", f"{snap['rows_per_s']:.1f} rows/s   in {snap['input_tokens_per_s']:.0f} tok/s   "
                                    f"out {_out_rates(snap)}")
        table.add_row("elapsed / ETA", f"{fmt_duration(snap['elapsed_s'])} / {fmt_duration(snap['eta_s'])}")
        for name, rate in sorted(snap["replicas"].items()):
            table.add_row(f"replica {name}", f"{rate:.1f} rows/s")
        if snap["error_types"]:
            table.add_row("errors by type", ", ".join(f"{k}: {v}" for k, v in sorted(snap["error_types"].items())))
        return table

    def _write(self, snap: dict[str, Any]) -> None:
        if self.progress_path is None:
            return
        atomic_write_json(self.progress_path, snap, indent=None)

    def tick(self) -> None:
        with self._tick_lock:
            snap = self.snapshot()
            self.timeline.append((snap["updated_at"], snap["rows_done"], self.in_tokens, self.generated_tokens))
            self._write(snap)
        if self.quiet:
            return
        if self._live is not None:
            self._live.update(self._table(snap))
        elif time.time() - self._last_log >= self.log_every:
            self._last_log = time.time()
            print(self.line(snap), file=sys.stderr, flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - progress must never break the job
                pass

    def start(self) -> "Progress":
        if self.tty and not self.quiet:
            from rich.live import Live

            self._live = Live(self._table(self.snapshot()), refresh_per_second=2, transient=False)
            self._live.start()
        self._thread = threading.Thread(target=self._loop, name="llmbatch-progress", daemon=True)
        self._thread.start()
        return self

    def mark(self, state: str) -> dict[str, Any]:
        """Record a new state after :meth:`stop` (e.g. stopped while the output was written)."""
        with self._tick_lock:
            self.state = state
            snap = self.snapshot()
            self._write(snap)
        return snap

    def stop(self, state: str) -> dict[str, Any]:
        with self._tick_lock:
            self.state = state
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.tick()
        if self._live is not None:
            self._live.stop()
            self._live = None
        return self.snapshot()


def _out_rates(snap: dict[str, Any]) -> str:
    """Output tokens/s: generated by the engine, and delivered (with dedup copies) when more."""
    gen, delivered = snap["generated_tokens_per_s"], snap["delivered_tokens_per_s"]
    text = f"{gen:.0f} tok/s generated"
    if delivered > gen + 0.5:
        text += f" ({delivered:.0f} delivered)"
    return text


def check_report_dependencies() -> None:
    """Raise :class:`MissingDependencyError` unless :func:`write_report` can run (call it before
    the work, so that a missing matplotlib is said at once, not after the job)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError("--report", "matplotlib")


def write_report(timeline: list[tuple[float, int, int, int]], path: Path, title: str = "llmbatch throughput") -> Path:
    """A PNG chart of rows/s and output tokens/s over the run (needs matplotlib)."""
    check_report_dependencies()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if len(timeline) < 2:
        timeline = list(timeline) + [timeline[-1]] if timeline else [(0, 0, 0, 0), (1, 0, 0, 0)]
    t0 = timeline[0][0]
    xs, rows_s, out_s = [], [], []
    for (ta, ra, _, oa), (tb, rb, _, ob) in zip(timeline, timeline[1:]):
        dt = max(1e-6, tb - ta)
        xs.append(tb - t0)
        rows_s.append((rb - ra) / dt)
        out_s.append((ob - oa) / dt)
    fig, ax1 = plt.subplots(figsize=(9, 4))
    ax1.plot(xs, rows_s, color="tab:blue", label="rows/s")
    ax1.set_xlabel("seconds since start")
    ax1.set_ylabel("rows/s", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(xs, out_s, color="tab:orange", label="generated tokens/s")
    ax2.set_ylabel("generated tokens/s", color="tab:orange")
    ax1.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
