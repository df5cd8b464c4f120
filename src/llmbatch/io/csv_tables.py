"""A clean CSV read as Arrow tables by pyarrow's reader, every cell as text, exactly as the
record reader (``readers.read_csv``) would read it, at C speed.

The record reader handles any CSV, one Python record at a time: a bad record (a wrong field
count, bytes that are not UTF-8, a huge cell) becomes a row with its read error and the read
goes on. That costs tens of microseconds a row, most of a big job's ingest (2,000,000 rows:
about a minute). Most files are clean, so a job reads them here first: pyarrow's multi-threaded
reader with every column typed as text, the cell checks and the column types of
:class:`~llmbatch.io.readers.TextTypes` done on whole columns. Whatever this reader would not read
as the record reader does raises :class:`NotClean` (a bad record, a blank line, a byte-order mark,
a repeated column name, a cell over the limit, non-ASCII text that type inference would have to
judge), and the caller reads the file with the record reader instead, from the start.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from llmbatch.io.readers import MAX_CELL_BYTES, TEXT_TYPES, TextTypes, open_input

#: Bytes pyarrow's reader parses at a time (a batch of rows per block).
BLOCK_BYTES = 16 << 20
#: The header is read from this many bytes at most (more: not this reader's file).
HEADER_BYTES = 1 << 20

_INT = r"^[+-]?[0-9]+$"
_FLOAT = r"(?i)^(?:[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?|[+-]?(?:inf|nan))$"
_DATE = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"


class NotClean(Exception):
    """This file is for the record reader (the message says why)."""


def _header(path: str) -> list[str]:
    with open_input(path) as fh:
        head = fh.read(HEADER_BYTES)
    if head.startswith(b"\xef\xbb\xbf"):
        raise NotClean("the file starts with a byte-order mark")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # (not just a character cut at the end of the sample)
            raise NotClean("the header is not UTF-8") from None
        text = head[:exc.start].decode("utf-8")
    lines = text.splitlines(keepends=True)
    if len(lines) < 2:
        raise NotClean("no whole record within the first bytes")
    header = next(csv.reader(io.StringIO("".join(lines[:-1]), newline="")), None)
    if not header or len(header) < 2 or len(set(header)) != len(header) or any('"' in h or "\n" in h for h in header):
        raise NotClean("a header of one column, or with repeated or quoted names")
    if any(len(h) > MAX_CELL_BYTES or not h.isprintable() for h in header):
        raise NotClean("an unusual header")
    return header


def csv_tables(path: str, columns: list[str] | None = None, limit: int | None = None) -> Iterator[pa.Table]:
    """The rows of a clean CSV file (``columns`` of them, the first ``limit``), as tables of
    text columns. Raises :class:`NotClean` where the record reader must read it."""
    import pyarrow.csv as pacsv

    header = _header(path)
    if columns and any(c not in header for c in columns):
        raise NotClean("input.columns names a column the header does not have")
    read = pacsv.ReadOptions(block_size=BLOCK_BYTES, use_threads=True)
    parse = pacsv.ParseOptions(newlines_in_values=True, ignore_empty_lines=False)
    convert = pacsv.ConvertOptions(column_types={h: pa.string() for h in header}, strings_can_be_null=False,
                                   quoted_strings_can_be_null=False, include_columns=columns or None)
    seen = 0
    with open_input(path) as fh:
        try:
            reader = pacsv.open_csv(fh, read_options=read, parse_options=parse, convert_options=convert)
            if reader.schema.names != (columns or header):
                raise NotClean("pyarrow read other column names than the header's")
            for batch in reader:
                table = pa.Table.from_batches([batch])
                if limit is not None:
                    table = table.slice(0, max(0, limit - seen))
                if table.num_rows:
                    _check_cells(table)
                    seen += table.num_rows
                    yield table
                if limit is not None and seen >= limit:
                    return
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, UnicodeError) as exc:
            raise NotClean(f"pyarrow could not read it as the record reader does ({exc})") from None


def _check_cells(table: pa.Table) -> None:
    empty = None  # pyarrow reads a blank line as a record of empty cells; the record reader flags it
    for name in table.column_names:
        blank = pc.equal(table.column(name), "")
        empty = blank if empty is None else pc.and_(empty, blank)
    if empty is not None and pc.any(empty).as_py():
        raise NotClean("a blank line, or a record of empty cells only")
    for name in table.column_names:
        column = table.column(name)
        if len(column) and pc.max(pc.utf8_length(column)).as_py() > MAX_CELL_BYTES:
            raise NotClean(f"a cell of {name!r} is over {MAX_CELL_BYTES:,} characters")


class ColumnTypes(TextTypes):
    """:class:`~llmbatch.io.readers.TextTypes` over whole text columns: the same answer."""

    def add_table(self, table: pa.Table) -> None:
        for name in table.column_names:
            possible = self._possible.setdefault(name, set(TEXT_TYPES[:-1]))
            if not possible:
                continue
            column = table.column(name)
            cells = column.filter(pc.not_equal(column, ""))
            if not len(cells):
                continue
            if not pc.all(pc.string_is_ascii(cells)).as_py():  # Python's \d and strip() know more
                for value in cells.to_pylist():
                    self.add({name: value})
                continue
            text = pc.utf8_trim_whitespace(cells)
            if "int64" in possible and not (pc.all(pc.match_substring_regex(text, _INT)).as_py() and _fits_int64(text)):
                possible.discard("int64")
            if "float64" in possible and not pc.all(pc.match_substring_regex(text, _FLOAT)).as_py():
                possible.discard("float64")
            if "bool" in possible and not pc.all(pc.is_in(pc.utf8_lower(text), pa.array(["true", "false"]))).as_py():
                possible.discard("bool")
            if "date32" in possible and not pc.all(pc.match_substring_regex(text, _DATE)).as_py():
                possible.discard("date32")


def _fits_int64(text: pa.ChunkedArray) -> bool:
    """Whether every whole number in ``text`` fits int64 (a leading + or zeros allowed)."""
    digits = pc.replace_substring_regex(text, r"^[+-]?0*", "")
    long = pc.greater_equal(pc.utf8_length(digits), 19)
    if not pc.any(long).as_py():
        return True
    return all(-(1 << 63) <= int(t) < (1 << 63) for t in text.filter(long).to_pylist())
