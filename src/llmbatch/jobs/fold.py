"""Folding a job's identical rows before the engine: one row of each group goes through the
processor, the others take its answer as Arrow columns in the driver.

A job whose requests come from its prompt templates (``RowsKind.fold_columns``) asks the same
question of every row whose template fields hold the same values. Sending each such row
through Ray Data and the replica's stages only to copy an answer there cost most of a
repetitive job's time (issue 29: 200,000 customers, 22,053 distinct companies). So a pass
groups its rows by those fields, sends the first row of each group (its *representative*),
and when the representative's output row comes back the driver builds every other row of
the group (its *followers*) from its own input columns and the representative's answer
columns, a few column operations per batch, and commits them like any other rows.

Nothing about the guarantees changes: followers are committed rows with ``deduped`` in their
stats; a follower whose representative was lost stays to do and is folded again in the next
pass (or after a crash: its group's answer is then a committed answer record, copied without
the engine). Rows with a read error are never folded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from llmbatch.codec import has_text
from llmbatch.jobs.ingest import KEY_COLUMN
from llmbatch.rows import (
    ANSWER,
    ENGINE_OUTPUT_COLUMNS,
    ERROR_COLUMN,
    REQUEST_COLUMNS,
    ROW_ID,
    STATS,
)

#: Columns the processor writes on a row (besides the engine's output columns): an input
#: column of one of these names is replaced in the output, so a job whose input has one is
#: not folded (its followers' value would be ambiguous).
WRITTEN_COLUMNS = frozenset({*ENGINE_OUTPUT_COLUMNS, *REQUEST_COLUMNS, "messages", "prompt", "text_1", "text_2",
                             "logprobs", "prompt_logprobs", "completions", "structured_output_error", "model"})

#: Followers of one input file are built once this many are ready (or all of the file's are),
#: and at every timed commit and at the end of the stream.
EMIT_ROWS = 4096
#: Input files kept in memory, decoded, between the builds of their followers (bytes of Arrow
#: tables, the least recently used let go first; a file whose followers are all built goes at
#: once). A file's followers are built a few thousand at a time as their representatives come
#: back, so without it a 2,000,000-row job read each of its input files about 150 times: 135 s
#: of the driver's 195 s in ``bench/driver_costs.py --stream``.
INPUT_CACHE_BYTES = 512 << 20
#: Followers built at most per answered batch and per timed commit (the end of the stream builds
#: the rest). The driver takes the next answers between slices: a skewed job's first answers
#: have hundreds of thousands of followers (839,470 for the first 4,352 answers of the seeds'
#: 2,000,000 customers), and building them at once held every answer behind them uncommitted.
BUILD_SLICE = 65536


def group_codes(table: pa.Table, columns: list[str]) -> np.ndarray:
    """A group number per row (0, 1, ... dense): rows with equal values in ``columns`` share
    one (an empty value is a value: such rows fail alike)."""
    codes = []
    for name in columns:
        column = table.column(name)
        try:
            encoded = pc.dictionary_encode(column).combine_chunks()
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):  # lists, structs: their text
            encoded = pc.dictionary_encode(pa.array([repr(v) for v in column.to_pylist()], pa.string()))
        codes.append(pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64))
    if not codes or not len(codes[0]):
        return np.empty(0, np.int64)
    stacked = codes[0] if len(codes) == 1 else np.stack(codes, axis=1)
    _, inverse = np.unique(stacked, axis=0 if len(codes) > 1 else None, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64)


@dataclass
class _Answers:
    """The representatives' answers (their output rows less the followers' own columns), as
    they arrived: ``chunks[c]`` row ``r``, and each chunk's whole column order."""

    chunks: list[pa.Table | None] = field(default_factory=list)
    orders: list[list[str]] = field(default_factory=list)
    #: per chunk, its groups whose followers are not all built yet (at 0 the chunk is let go)
    live: list[int] = field(default_factory=list)
    chunk_of: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # per group, -1: not yet
    row_of: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


class Fold:
    """One pass's groups: which rows to send, and the followers that are ready to commit."""

    def __init__(self, files: list[Path], per_file: int, todo: np.ndarray, columns: list[str]):
        self.files = files
        self.per_file = per_file
        inputs = dict.fromkeys(n for path in files for n in pq.read_schema(path).names)
        #: the input columns a follower keeps as its own (its row id among them)
        self.own = frozenset(n for n in inputs if n not in WRITTEN_COLUMNS and n not in (ERROR_COLUMN, STATS, ANSWER,
                                                                                          KEY_COLUMN))
        rows = len(todo)
        self.group_of = np.full(rows, -1, dtype=np.int64)
        keys = []
        for path in files:
            errors = [ERROR_COLUMN] if ERROR_COLUMN in pq.read_schema(path).names else []
            table = pq.read_table(path, columns=[ROW_ID, *errors, *columns])
            keep = todo[table.column(ROW_ID).to_numpy()]
            if errors:  # a row that could not be read is an error row of its own
                keep &= ~has_text(table.column(ERROR_COLUMN))
            if keep.any():
                keys.append(table.filter(pa.array(keep)).select([ROW_ID, *columns]))
        if keys:
            table = pa.concat_tables(keys, promote_options="permissive")
            self.group_of[table.column(ROW_ID).to_numpy()] = group_codes(table, columns)
        self._groups = int(self.group_of.max()) + 1 if rows else 0
        folded = np.flatnonzero(self.group_of >= 0)  # ascending ids
        order = np.argsort(self.group_of[folded], kind="stable")
        self.ids_by_group = folded[order]
        groups = self.group_of[self.ids_by_group]
        self.start = np.searchsorted(groups, np.arange(self._groups), side="left")
        self.end = np.searchsorted(groups, np.arange(self._groups), side="right")
        self.is_rep = np.zeros(rows, dtype=bool)
        self.is_rep[self.ids_by_group[self.start[self.end > self.start]]] = True
        self.send = todo & ((self.group_of < 0) | self.is_rep)
        followers = np.flatnonzero((self.group_of >= 0) & ~self.is_rep)
        self.pending = np.bincount(followers // per_file, minlength=len(files)) if len(files) else np.zeros(0, int)
        self.ready_count = np.zeros(len(files), dtype=np.int64)
        self.ready: dict[int, list[np.ndarray]] = {}
        self.answers = _Answers(chunk_of=np.full(self._groups, -1, np.int64), row_of=np.full(self._groups, -1, np.int64))
        self.followers = len(followers)
        #: per group, its followers not built yet
        self.left = np.maximum(self.end - self.start - 1, 0)
        self._inputs: OrderedDict[int, pa.Table] = OrderedDict()

    # -- as representatives come back -------------------------------------------------------

    def answered(self, table: pa.Table, done: np.ndarray, limit: int | None = None) -> list[pa.Table]:
        """Note the representatives in ``table`` (a committed batch); the followers now ready
        to commit (files whose followers are all ready, or at least :data:`EMIT_ROWS`; files
        after the first ``limit`` rows wait for the next call)."""
        ids = table.column(ROW_ID).to_numpy()
        groups = self.group_of[ids]
        reps = self.is_rep[ids] & (groups >= 0)
        if reps.any():
            reps[reps] = self.answers.chunk_of[groups[reps]] < 0  # (a representative that came twice)
        if reps.any():
            chunk = len(self.answers.chunks)
            rows = np.flatnonzero(reps)
            new = groups[rows]
            live = int((self.left[new] > 0).sum())
            self.answers.orders.append(table.column_names)
            self.answers.chunks.append(table.drop_columns([n for n in table.column_names if n in self.own])
                                       if live else None)
            self.answers.live.append(live)
            self.answers.chunk_of[new] = chunk
            self.answers.row_of[new] = rows
            ready = [self.ids_by_group[self.start[g] + 1:self.end[g]] for g in new]
            ready_ids = np.concatenate(ready) if ready else np.empty(0, np.int64)
            if len(ready_ids):
                files = ready_ids // self.per_file
                np.add.at(self.ready_count, files, 1)
                for f in np.unique(files):
                    self.ready.setdefault(int(f), []).append(ready_ids[files == f])
        return self.emit(done, limit=limit)

    def emit(self, done: np.ndarray, everything: bool = False, limit: int | None = None) -> list[pa.Table]:
        """The ready followers of the files due (of every file: ``everything``), file by file
        until ``limit`` rows are taken (the other files' wait for the next call), built together."""
        batch: list[tuple[int, np.ndarray]] = []
        taken: list[tuple[int, np.ndarray]] = []
        built = 0
        for f in sorted(self.ready):
            if limit is not None and built >= limit:
                break
            due = self.ready_count[f] >= min(self.pending[f], EMIT_ROWS)
            if everything or due:
                ids = np.concatenate(self.ready.pop(f))
                self.pending[f] -= self.ready_count[f]
                self.ready_count[f] = 0
                fresh = np.sort(ids[~done[ids]])
                if len(fresh):
                    batch.append((f, fresh))
                    built += len(fresh)
                taken.append((f, ids))
        out = self._build(batch) if batch else []
        for f, ids in taken:  # their answers and input files can go once no other follower needs them
            self._built(self.group_of[ids])
            if self.pending[f] <= 0:
                self._inputs.pop(f, None)
        return out

    def _input(self, f: int) -> pa.Table:
        """Input file ``f``'s rows as followers take them (see :data:`INPUT_CACHE_BYTES`)."""
        table = self._inputs.get(f)
        if table is not None:
            self._inputs.move_to_end(f)
            return table
        table = pq.read_table(self.files[f])
        table = table.drop_columns([c for c in (KEY_COLUMN, ERROR_COLUMN) if c in table.column_names])
        self._inputs[f] = table
        while len(self._inputs) > 1 and sum(t.nbytes for t in self._inputs.values()) > INPUT_CACHE_BYTES:
            self._inputs.popitem(last=False)
        return table

    def _built(self, groups: np.ndarray) -> None:
        """Followers of ``groups`` (one entry each) are built: let go of the answers no
        follower needs any more (a job of many distinct prompts keeps only those in use)."""
        np.subtract.at(self.left, groups, 1)
        finished = np.unique(groups)
        finished = finished[self.left[finished] == 0]
        chunks, counts = np.unique(self.answers.chunk_of[finished], return_counts=True)
        for c, n in zip(chunks.tolist(), counts.tolist()):
            self.answers.live[c] -= n
            if self.answers.live[c] <= 0:
                self.answers.chunks[c] = None

    def _build(self, batch: list[tuple[int, np.ndarray]]) -> list[pa.Table]:
        """The followers of ``batch`` (per input file, its followers' ids, ascending): their own
        input columns, their group's answer. The answer chunks of one column order are joined
        (without a copy) and taken once for the whole batch, then cut per file: a take joins
        the chunks it takes from into one copy and costs about as much for one row as for a
        thousand, so once per file per chunk (76,603 takes for the seeds' 2,000,000 rows) or once
        per file (each copying every answer chunk its followers use) made most of the driver's
        work on four GPUs."""
        ids = np.concatenate([fresh for _, fresh in batch])
        bounds = np.cumsum([0, *(len(fresh) for _, fresh in batch)])
        groups = self.group_of[ids]
        chunks = self.answers.chunk_of[groups]
        rows = self.answers.row_of[groups]
        by_order: dict[tuple[str, ...], list[int]] = {}
        for c in np.unique(chunks).tolist():
            by_order.setdefault(tuple(self.answers.orders[c]), []).append(c)
        tables = []
        for column_order, used in by_order.items():
            used_chunks = np.array(used, dtype=np.int64)  # ascending
            pick = np.flatnonzero(np.isin(chunks, used_chunks))
            parts = [self.answers.chunks[c] for c in used]
            try:
                joined = pa.concat_tables(parts, promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # answers of other types: a table per chunk
                mine = [pick[chunks[pick] == c] for c in used]
                pieces = [(chosen, part.take(pa.array(rows[chosen]))) for chosen, part in zip(mine, parts)]
            else:
                starts = np.cumsum([0, *(part.num_rows for part in parts[:-1])])
                at = starts[np.searchsorted(used_chunks, chunks[pick])] + rows[pick]
                pieces = [(pick, joined.take(pa.array(at)))]
            for chosen, answers in pieces:  # chosen: ascending positions in ids, so each file's are together
                answers = _copied(answers)
                cuts = np.searchsorted(chosen, bounds)
                for (f, _), a, b in zip(batch, cuts[:-1].tolist(), cuts[1:].tolist()):
                    if a == b:
                        continue
                    source = self._input(f)
                    positions = np.searchsorted(source.column(ROW_ID).to_numpy(), ids[chosen[a:b]])
                    tables.append(_follower_table(source.take(pa.array(positions)), answers.slice(a, b - a),
                                                  list(column_order), self.own))
        return tables


def _copied(answers: pa.Table) -> pa.Table:
    """Representatives' answers as their followers hold them: stats marked ``deduped`` (the
    answer was copied, not generated), no answer record (the representative's row carries it)."""
    for name in (ANSWER, STATS):
        if name in answers.column_names:
            i = answers.column_names.index(name)
            field = answers.schema.field(i)
            array = pa.nulls(answers.num_rows, field.type) if name == ANSWER else _deduped(answers.column(i))
            answers = answers.set_column(i, pa.field(name, array.type, metadata=field.metadata), array)
    return answers


def _follower_table(inputs: pa.Table, answers: pa.Table, order: list[str], own: frozenset[str]) -> pa.Table:
    """Followers' output rows, in the representatives' column ``order``: their ``own`` input
    columns (their row id included) and the rest from their answers (:func:`_copied`)."""
    fields, arrays = [], []
    for name in [*order, *(n for n in inputs.column_names if n in own and n not in order)]:
        source = inputs if name in own else answers
        fields.append(source.schema.field(name))
        arrays.append(source.column(name))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _deduped(stats: pa.ChunkedArray) -> pa.Array:
    """Stats structs with ``deduped`` true (the answer was copied, not generated)."""
    array = stats.combine_chunks()
    if not pa.types.is_struct(array.type):
        return array
    children = [array.field(i) for i in range(array.type.num_fields)]
    fields = list(array.type)
    for i, f in enumerate(fields):
        if f.name == "deduped":  # (a column of nulls where no representative said: now bool)
            children[i], fields[i] = pa.array(np.ones(len(array), dtype=bool)), pa.field("deduped", pa.bool_())
    return pa.StructArray.from_arrays(children, fields=fields, mask=array.is_null() if array.null_count else None)

