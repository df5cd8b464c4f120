"""JSON input records, decoded so that no record can stop the read: JSON Lines one line at a
time (a line that does not decode, too deep a nesting included, is that line's error), and a
JSON array (``[{...}, ...]`` or ``{"data": [...]}``) from ijson's parse events, with a nesting
bound per item (ijson's ``items()`` builds a path string per level: quadratic in the depth).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

from llmbatch.errors import ConfigError

#: How deep a record of a JSON array input may nest (deeper: that item's error).
MAX_JSON_DEPTH = 512
Record = tuple[dict[str, Any], str]  # a row and its read error ("" when it was read fine)


def jsonl_records(fh) -> Iterator[Record]:
    for lineno, raw in enumerate(fh, start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield {}, f"read: UnicodeDecodeError: line {lineno} is not UTF-8 ({exc.reason} at byte {exc.start})"
            continue
        try:
            value = json_line(text)
        except ValueError as exc:
            yield {}, f"read: JSONDecodeError: line {lineno} is not valid JSON ({exc})"
            continue
        if isinstance(value, dict):
            yield value, ""
        else:
            yield {}, f"read: JSONLineError: line {lineno} is a JSON {type(value).__name__}, not an object"


def json_line(text: str | bytes) -> Any:
    """One JSON document (a line); anything the decoder cannot take, too deep a nesting
    included (``RecursionError``), is a ValueError that says so."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"nested more than Python's recursion limit allows ({sys.getrecursionlimit()})") from None


def _item(first: str, events: Iterator[tuple[str, Any]]) -> Any:
    """The value an item's events build (``first`` opened it); None when it nests deeper than
    :data:`MAX_JSON_DEPTH` (its events are consumed all the same)."""
    root: Any = {} if first == "start_map" else []
    stack, key, depth = [root], None, 1
    for event, value in events:
        if event == "map_key":
            key = value
        elif event == "start_map" or event == "start_array":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                stack = []
                continue
            if stack:
                new: Any = {} if event == "start_map" else []
                top = stack[-1]
                if type(top) is dict:
                    top[key] = new
                else:
                    top.append(new)
                stack.append(new)
        elif event == "end_map" or event == "end_array":
            depth -= 1
            if depth == 0:
                return root if stack else None
            if stack and depth < MAX_JSON_DEPTH:
                stack.pop()
        elif stack:
            top = stack[-1]
            if type(top) is dict:
                top[key] = value
            else:
                top.append(value)
    raise ValueError("the input ends inside an item")


def _json_events_to_records(events: Iterator[tuple[str, Any]]) -> Iterator[Record]:
    """Records from ijson's parse events of ``[{...}, ...]`` or ``{"data": [...]}``: an item
    nested deeper than :data:`MAX_JSON_DEPTH` or not an object is that item's error."""
    depth, items_at, key, index = 0, None, None, 0
    for event, value in events:
        if items_at is not None and depth == items_at and event != "end_array":  # an item
            if event == "start_map" or event == "start_array":
                item = _item(event, events)
                if item is None:
                    yield {}, f"read: JSONRecordError: item {index} is nested more than {MAX_JSON_DEPTH} deep"
                elif type(item) is dict:
                    yield item, ""
                else:
                    yield {}, f"read: JSONRecordError: item {index} is a list, not an object"
            else:
                yield {}, f"read: JSONRecordError: item {index} is a {type(value).__name__}, not an object"
            index += 1
            continue
        if event == "start_map" or event == "start_array":
            depth += 1
            if event == "start_array" and (depth == 1 or (depth == 2 and key == "data")) and items_at is None:
                items_at = depth
        elif event == "end_map" or event == "end_array":
            depth -= 1
            if items_at is not None and depth < items_at:
                return
        elif event == "map_key" and depth == 1:
            key = value


def json_records(fh) -> Iterator[Record]:
    index = 0
    try:
        import ijson
    except ImportError:
        ijson = None
    try:
        if ijson is not None:
            for index, record in enumerate(_json_events_to_records(ijson.basic_parse(fh, use_float=True))):
                yield record
            return
        data = json_line(fh.read())
    except (ValueError, RecursionError) + ((ijson.JSONError,) if ijson is not None else ()) as exc:
        raise ConfigError(f"the input is not valid JSON (after {index:,} items): {exc}") from None
    items = data.get("data", data) if isinstance(data, dict) else data
    for i, value in enumerate(items if isinstance(items, list) else []):
        if isinstance(value, dict):
            yield value, ""
        else:
            yield {}, f"read: JSONRecordError: item {i} is a {type(value).__name__}, not an object"
