"""Live progress for a person at a terminal, log lines for everything else, and the report.

While a job runs, :class:`Progress` shows rows done/total, rows/s, input and output tokens/s,
errors, ETA and per-replica activity (a rich live table on a TTY, a plain line every few
seconds otherwise), and writes ``progress.json`` in the job directory once a second so that
``llmbatch status`` can show the same from another terminal. Before the first answer it shows
the start-up phase instead (:data:`PHASES`), read from the replicas' heartbeats.

One set of figures: rates are computed here only, over a named window. While rows arrive, the
window is the last :data:`WINDOW_S` seconds (what the ETA needs); once the run ends, it is the
whole run since it started (start-up included: what the user waited). The last live frame,
the end-of-run summary (``stats.json``) and ``llmbatch status`` show that same final snapshot,
worded by :func:`rates_text`. Pooling tasks (embed, classify, score) generate no tokens: they
report rows/s and items/s (answers: embeddings, labels, scores).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path
from typing import Any

from llmbatch.io.files import atomic_write_json
from llmbatch.watchdog import is_fresh, read_heartbeats

WINDOW_S = 30.0
#: What a run does before its first answer, in order (the driver and the replicas' heartbeats say which).
PHASES = ("preparing the job", "starting Ray", "placing replicas", "loading the model", "waiting for the first answer")
#: What one answered row is, per pooling task (they report items/s, not generated tokens).
ITEMS = {"embed": "embeddings", "classify": "labels", "score": "scores"}
#: How often the replicas' heartbeats are read while the run starts.
BEATS_EVERY_S = 2.0


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
                 quiet: bool = False, label: str = "llmbatch", task: str = "generate", out: Any = None,
                 err: Any = None):
        """``out`` and ``err``: the terminal's streams for the live view and the log lines
        (default: ``sys.stdout`` and ``sys.stderr`` when shown)."""
        self.total = total
        self.task = task
        self.out = out
        self.err = err
        self.done_before = done_before
        self.errors_before = errors_before
        self.progress_path = progress_path
        self.tty = (err or sys.stderr).isatty() if tty is None else tty
        self.log_every = log_every
        self.quiet = quiet
        self.label = label
        self.started = time.time()
        self.first_row_at: float | None = None
        self.last_row_at: float | None = None  # the last answered rows' arrival
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
        # (t, rows, in_tokens, generated_tokens, delivered_tokens, rows by replica, answered rows)
        self._recent: collections.deque[tuple[float, int, int, int, int, dict[str, int], int]] = collections.deque()
        self.state = "running"
        self.ended_at: float | None = None
        self.phase = PHASES[0]
        self.phase_since = self.started
        self._run_id: str | None = None
        self._beats_read = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._tick_lock = threading.Lock()  # a snapshot is written whole, and never after a newer one
        self._thread: threading.Thread | None = None
        self._live = None
        self._last_log = 0.0

    # -- the start-up phase ------------------------------------------------------------------

    def set_phase(self, phase: str) -> None:
        """Enter a start-up phase (one of :data:`PHASES`); the first answer ends them."""
        if phase != self.phase:
            self.phase, self.phase_since = phase, time.time()

    def watch_replicas(self, run_id: str | None) -> None:
        """Follow the start-up of a processor run's replicas (their heartbeats) until the first
        answer: placing them, loading the model, waiting for the first answer."""
        self._run_id = run_id
        self.set_phase(PHASES[2])

    def _read_beats(self) -> None:
        if self._run_id is None or self.first_row_at is not None or time.time() - self._beats_read < BEATS_EVERY_S:
            return
        self._beats_read = time.time()
        beats = [b for b in read_heartbeats(self._run_id) if is_fresh(b)]
        if any(b.get("state") == "starting" for b in beats):
            self.set_phase(PHASES[3])
        elif beats:
            self.set_phase(PHASES[4])

    # -- counting ----------------------------------------------------------------------------

    def arrived(self) -> None:
        """Note that rows came back (the first: steady-state throughput starts here; the last:
        what the driver did after it, committing, is the end of the rows phase)."""
        self.last_row_at = time.time()
        if self.first_row_at is None:
            self.first_row_at = self.last_row_at

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
            self._recent.append((now, ok + errors, in_tokens, generated_tokens, delivered_tokens, dict(replicas or {}), ok))

    @property
    def done(self) -> int:
        return self.done_before + self.ok + self.errors

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        with self._lock:
            while self._recent and now - self._recent[0][0] > WINDOW_S:
                self._recent.popleft()
            span = max(1e-6, min(WINDOW_S, now - (self.first_row_at or now)) or 1e-6)
            per_replica: collections.Counter[str] = collections.Counter()
            for r in self._recent:
                per_replica.update(r[5])
            elapsed = (self.ended_at or now) - self.started
            if self.ended_at is None:  # running: the last WINDOW_S seconds (what the ETA needs)
                window, seconds = f"last {WINDOW_S:.0f} s", span
                counts = [sum(r[i] for r in self._recent) for i in range(1, 5)]
                items = sum(r[6] for r in self._recent)
            else:  # over: the whole run, start-up included
                window, seconds = "since start", max(1e-6, elapsed)
                counts = [self.ok + self.errors, self.in_tokens, self.generated_tokens, self.delivered_tokens]
                items = self.ok  # answered rows: an embedding, a label or a score each
            answering = self.first_row_at is not None
            rates = [round(c / seconds, 3 if i == 0 else 1) if answering else 0.0 for i, c in enumerate(counts)]
            recent_rows = sum(r[1] for r in self._recent) / span if answering else 0.0
            remaining = self.total - self.done
            eta = remaining / recent_rows if recent_rows > 0 else None
            if self.ended_at is not None:  # over: nothing left, or no run to estimate it by
                eta = 0.0 if remaining <= 0 else None
            return {
                "state": self.state,
                "task": self.task,
                "phase": "answering" if answering else self.phase,
                "phase_s": round(now - (self.first_row_at or self.phase_since), 1),
                "rows_total": self.total,
                "rows_done": self.done,
                "rows_ok": self.done_before - self.errors_before + self.ok,
                "rows_error": self.errors_before + self.errors,
                "this_run": {"ok": self.ok, "errors": self.errors, "input_tokens": self.in_tokens,
                             "generated_tokens": self.generated_tokens, "delivered_tokens": self.delivered_tokens,
                             "cached_tokens": self.cached_tokens, "deduplicated_rows": self.deduped},
                "window": window,
                "window_s": round(seconds, 2),
                "startup_s": round(self.first_row_at - self.started, 2) if answering else None,
                "rows_per_s": rates[0],
                "items_per_s": round(items / seconds, 3) if answering else 0.0,
                "input_tokens_per_s": rates[1],
                "generated_tokens_per_s": rates[2],
                "delivered_tokens_per_s": rates[3],
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
                    f"{snap['phase']} ({fmt_duration(snap['elapsed_s'])})")
        return (f"[{self.label}] {snap['rows_done']:,}/{snap['rows_total']:,} rows ({pct:.1f}%) | "
                f"{rates_text(snap)} | errors {snap['rows_error']:,} | "
                f"ETA {fmt_duration(snap['eta_s'])} | replicas {len(snap['replicas'])}")

    def _table(self, snap: dict[str, Any]):
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table(title=self.label, show_header=False, box=None)
        table.add_column(justify="right", style="bold")
        table.add_column()
        table.add_row("rows", ProgressBar(total=max(1, snap["rows_total"]), completed=snap["rows_done"], width=40))
        table.add_row("", f"{snap['rows_done']:,} / {snap['rows_total']:,}  ({snap['rows_error']:,} errors)")
        if self.first_row_at is None and snap["state"] == "running":
            table.add_row("starting", f"{snap['phase']} ({fmt_duration(snap['phase_s'])})")
        else:
            table.add_row("throughput", rates_text(snap))
        table.add_row("elapsed / ETA", f"{fmt_duration(snap['elapsed_s'])} / {fmt_duration(snap['eta_s'])}")
        if snap["state"] == "running":
            for name, rate in sorted(snap["replicas"].items()):
                table.add_row(f"replica {name}", f"{rate:.1f} rows/s")
        else:  # the run is over: what each replica did (its rate over the last seconds says nothing now)
            for name, rows in sorted(self.replicas.items()):
                table.add_row(f"replica {name}", f"{rows:,} rows")
        if snap["error_types"]:
            table.add_row("errors by type", ", ".join(f"{k}: {v}" for k, v in sorted(snap["error_types"].items())))
        return table

    def _write(self, snap: dict[str, Any]) -> None:
        if self.progress_path is None:
            return
        atomic_write_json(self.progress_path, snap, indent=None)

    def tick(self) -> None:
        try:
            self._read_beats()
        except Exception:  # noqa: BLE001 - the phase is a hint; Ray may not be up yet
            pass
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
            print(self.line(snap), file=self.err or sys.stderr, flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - progress must never break the job
                pass

    def start(self) -> "Progress":
        if self.tty and not self.quiet:
            from rich.console import Console
            from rich.live import Live

            # with streams of its own (the CLI: Ray's lines go to the job's log), nothing else
            # is redirected into the live view
            console = Console(file=self.out) if self.out is not None else None
            self._live = Live(self._table(self.snapshot()), refresh_per_second=2, transient=False, console=console,
                              redirect_stdout=self.out is None, redirect_stderr=self.out is None)
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
        """End the run: from here on the figures are the whole run's ("since start")."""
        with self._tick_lock:
            self.state = state
            self.ended_at = time.time()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._last_log = 0.0  # without a live table, the last line is printed too: the run's figures
        self.tick()
        if self._live is not None:
            self._live.stop()
            self._live = None
        return self.snapshot()


def _num(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{value:,.0f}"


def rates_text(snap: dict[str, Any]) -> str:
    """The rates of a snapshot (the live view, ``progress.json``) or of ``stats.json``, with
    their window: rows/s and tokens/s, or for a pooling task rows/s and items/s."""
    window = snap.get("window") or "since start"
    if snap.get("window_s") is not None:
        window = f"over {fmt_duration(snap['window_s'])} {window}" if window == "since start" else window
        if window.endswith("since start") and snap.get("startup_s") is not None:
            window += f", start-up {fmt_duration(snap['startup_s'])}"
    text = f"{snap.get('rows_per_s') or 0:.1f} rows/s"
    items = ITEMS.get(snap.get("task") or "generate")
    if items:
        per_s = snap.get("items_per_s")
        per_s = snap.get("rows_per_s") or 0 if per_s is None else per_s
        return f"{text}, {per_s:.1f} items/s ({items}), in {_num(snap.get('input_tokens_per_s') or 0)} tok/s ({window})"
    gen, delivered = snap.get("generated_tokens_per_s") or 0, snap.get("delivered_tokens_per_s") or 0
    text += f", in {_num(snap.get('input_tokens_per_s') or 0)} tok/s, out {_num(gen)} tok/s generated"
    if delivered > gen * 1.001 + 0.05:
        text += f" ({_num(delivered)} delivered)"
    return f"{text} ({window})"
