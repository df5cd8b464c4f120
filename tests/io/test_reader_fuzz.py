"""Malformed input never stops a read: every reader and the batch file validator get thousands
of seeded malformed records (deep nesting, bad UTF-8, lone surrogates, huge numbers, wrong
types, random bytes, broken quotes) and every record comes back read or as an error that
names its line (its item, for a JSON array); only a JSON array that does not parse fails,
as a ConfigError."""

from __future__ import annotations

import json
import random

import pytest

from llmbatch.errors import ConfigError
from llmbatch.io.json_records import json_line
from llmbatch.io.readers import READ_ERROR, read_rows
from llmbatch.openai.batch_file import Options, read_openai_batch, validate_batch_file

SEED = 20261127
LINES = 3000


def deep(rng: random.Random) -> bytes:
    depth = rng.choice([50, 600, 1200, 5000, 100_000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    inner = opener * depth + b"1" + closer * depth
    return (b'{"x": ' + inner + b"}") if rng.random() < 0.5 else inner


def request(rng: random.Random, i: int) -> dict:
    messages = [{"role": "user", "content": rng.choice(["hi", "", [{"type": "text", "text": "x"}], 7, None,
                                                         {"nested": [1, 2]}, [{"type": "image_url"}], ["a", 3]])}]
    body = rng.choice([{"model": "m", "messages": messages, "max_tokens": rng.choice([1, -1, "2", None, 1e308])},
                       {"messages": "not a list"}, {"model": 5}, [], "text", None,
                       {"model": "m", "messages": messages, "temperature": float("nan")},
                       {"model": "m", "prompt": rng.choice(["p", ["a", "b"], [1, 2], [[1]], {}, None])},
                       {"model": "m", "input": rng.choice(["t", [], [[]], [None], {"a": 1}])},
                       {"model": "m", "messages": messages, "response_format": rng.choice([{}, 1, {"type": "x"}])}])
    line = {"custom_id": rng.choice([f"r{i}", f"r{i}", "dup", "", None, 3]), "method": rng.choice(["POST", "GET", 1]),
            "url": rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/x", None]),
            "body": body}
    if rng.random() < 0.1:
        line[rng.choice(["extra", "custom_id", "body"])] = {"deep": [[[]]]}
    return line


def record(rng: random.Random, i: int) -> bytes:
    """One malformed (or sometimes fine) line: never blank, never holding a newline."""
    kind = rng.randrange(10)
    if kind == 0:
        out = deep(rng)
    elif kind == 1:
        out = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
    elif kind == 2:
        out = json.dumps(request(rng, i)).encode()[: rng.randrange(1, 200)]
    elif kind == 3:
        out = rng.choice([b'{"a": "\\ud800"}', b'{"a": 1e999999}', b'{"a": -}', b"NaN", b'"str"', b"[1,2]", b"null",
                          b'{"a": "\xff\xfe"}', b"\xef\xbb\xbf{}", b'{"a": 1}\r', b'{"a":1} {"b":2}', b"\x00",
                          b'{"\\u0000": 1}', b'{"a": 123456789012345678901234567890}', b'{"a": "' + b"x" * 5000 + b'"}'])
    else:
        out = json.dumps(request(rng, i), allow_nan=True).encode()
    out = out.replace(b"\n", b" ")
    return out if out.strip() else b"{}"


def write_lines(path, rng: random.Random) -> list[bytes]:
    lines = [record(rng, i) for i in range(LINES)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return lines


def expected_error(raw: bytes) -> bool:
    try:
        value = json_line(raw.decode("utf-8"))
    except ValueError:
        return True
    return not isinstance(value, dict)


def test_jsonl_reader_reads_or_flags_every_line(tmp_path):
    rng = random.Random(SEED)
    path = tmp_path / "fuzz.jsonl"
    lines = write_lines(path, rng)
    rows = [r for batch in read_rows(str(path), "jsonl", batch_rows=500) for r in batch]
    assert len(rows) == len(lines)
    for lineno, (raw, row) in enumerate(zip(lines, rows), start=1):
        error = row[READ_ERROR]
        assert bool(error) == expected_error(raw), (lineno, raw[:80], error)
        if error:
            assert f"line {lineno} " in error, (lineno, error)
    assert sum(1 for r in rows if "recursion" in r[READ_ERROR]) > 50  # the deep lines were among them


@pytest.mark.parametrize("invalid_lines", ["fail", "error"])
def test_batch_file_validator_and_reader_answer_every_line(tmp_path, invalid_lines):
    rng = random.Random(SEED + 1)
    path = tmp_path / "fuzz.jsonl"
    lines = write_lines(path, rng)
    options = Options(models=["m"], task_type=None)
    report = validate_batch_file(str(path), options)
    problem_lines = {p.line for p in report.problems}
    assert report.lines == len(lines) and len(problem_lines) == len(report.problems)
    assert all(p.code and p.message and 1 <= p.line <= len(lines) for p in report.problems)
    if invalid_lines == "error":
        rows = [r for batch in read_openai_batch(str(path), options, batch_rows=500) for r in batch]
        assert {r["line"] for r in rows} == set(range(1, len(lines) + 1))
        for row in rows:
            assert (row["line"] in problem_lines) == bool(row[READ_ERROR]) or row[READ_ERROR].startswith(
                f"read: invalid_request: line {row['line']}:"), row
            if row[READ_ERROR]:
                assert f"line {row['line']}:" in row[READ_ERROR]
    deep_lines = {i + 1 for i, raw in enumerate(lines) if raw.count(b"[") > 1100 or raw.count(b'{"a":') > 1100}
    assert deep_lines and deep_lines <= problem_lines


def test_csv_reader_flags_bad_records_by_line(tmp_path):
    rng = random.Random(SEED + 2)
    path = tmp_path / "fuzz.csv"
    cells = [b"a", b'"quoted, comma"', b'"broken', b"\xff\xfe", b"x\x00y", b'"a""b"', b"", b"\xed\xa0\x80", b"'"]
    lines = [b"id,text,n"] + [b",".join(rng.choice(cells) for _ in range(rng.choice([1, 3, 3, 3, 5])))
                              for _ in range(LINES)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    rows = [r for batch in read_rows(str(path), "csv", batch_rows=500) for r in batch]
    assert 0 < len(rows) <= LINES
    for row in rows:
        error = row[READ_ERROR]
        if error:
            lineno = int(error.split(" line ", 1)[1].split()[0])
            assert 2 <= lineno <= LINES + 1, error
    assert any("fields, the header has 3" in r[READ_ERROR] for r in rows)


def test_json_array_reader_flags_bad_items_and_refuses_a_broken_file(tmp_path):
    rng = random.Random(SEED + 3)
    items, bad = [], set()
    for i in range(LINES):
        if rng.random() < 0.5:
            try:
                raw = json.dumps(request(rng, i), allow_nan=False).encode()
            except ValueError:
                raw = rng.choice([b'{"a": "\\u0000"}', b'{"\\ud83d\\ude00": 1}', b'{"x": ' + b"[" * 50 + b"]" * 50 + b"}"])
        else:
            raw = rng.choice([b"[" * 2000 + b"]" * 2000, b"5", b'"text"', b"[1]", b"null", b"[]",
                              b'{"a": ' + b"[" * 700 + b"]" * 700 + b"}", b'{"a": ' + b'{"b":' * 600 + b"1" + b"}" * 601])
            bad.add(i)
        items.append(raw)
    for layout in ("array", "data"):
        path = tmp_path / f"{layout}.json"
        body = b"[" + b",".join(items) + b"]"
        path.write_bytes(body if layout == "array" else b'{"meta": [1, {"x": []}], "data": ' + body + b"}")
        rows = [r for batch in read_rows(str(path), "json", batch_rows=500) for r in batch]
        assert len(rows) == len(items)
        flagged = {i for i, r in enumerate(rows) if r[READ_ERROR]}
        assert flagged == bad
        assert all(f"item {i} " in rows[i][READ_ERROR] for i in flagged)
    for broken in (b"[{}, {", b"[{}, nope]", b"[" * 100_000, b"\xff", b'[{"a": "\xff"}]'):
        path = tmp_path / "broken.json"
        path.write_bytes(broken)
        with pytest.raises(ConfigError, match="not valid JSON"):
            list(read_rows(str(path), "json"))


def test_one_deeply_nested_line_is_that_lines_error_in_every_reader(tmp_path):
    """M7: a line nested past Python's recursion limit used to abort the whole read (only
    ValueError was caught), with no line number, under invalid_lines error too."""
    ok = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
          "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    nested = b'{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = tmp_path / "batch.jsonl"
    path.write_bytes(json.dumps(ok).encode() + b"\n" + nested + b"\n" + json.dumps({**ok, "custom_id": "c"}).encode() + b"\n")
    rows = [r for batch in read_rows(str(path), "jsonl") for r in batch]
    assert [bool(r[READ_ERROR]) for r in rows] == [False, True, False]
    assert "line 2 " in rows[1][READ_ERROR]
    options = Options(models=["m"], task_type="generate")
    report = validate_batch_file(str(path), options)
    assert [(p.line, p.code) for p in report.problems] == [(2, "invalid_json")]
    rows = [r for batch in read_openai_batch(str(path), options) for r in batch]
    assert [(r["line"], bool(r[READ_ERROR])) for r in rows] == [(1, False), (2, True), (3, False)]
    assert rows[1][READ_ERROR].startswith("read: invalid_json: line 2:")
