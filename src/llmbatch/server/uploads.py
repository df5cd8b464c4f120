"""``POST /v1/files`` as a stream: the multipart body is parsed as it arrives and the file part
goes straight into the file store, stopped the moment it passes the limit. Nothing is spooled:
at most one chunk of the body is in memory, at most the limit is on disk, and a refused upload
leaves nothing behind (the server answers without reading the rest of the body)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from llmbatch.server.files import LineCounter, UploadError
from llmbatch.server.storage import Writer

FIELD_BYTES = 1024          # a form field (purpose, expires_after[...]) is small
OVERHEAD = 64 * 1024        # multipart boundaries, part headers and fields around the file


@dataclass
class Received:
    """What an upload brought: its form fields and the file, written but not yet committed."""

    writer: Writer | None = None
    filename: str = "upload.jsonl"
    fields: dict[str, str] = field(default_factory=dict)
    lines: int = 0


class _Parts:
    """The parser's callbacks: part headers, fields kept in memory (capped), file data queued
    for the store."""

    def __init__(self, open_writer: Callable[[], Writer], limit: int, too_large: UploadError, max_lines: int):
        self.open_writer = open_writer
        self.limit = limit
        self.too_large = too_large
        self.counter = LineCounter(max_lines)
        self.received = Received()
        self.pending: list[bytes] = []
        self.size = 0
        self.header_name = b""
        self.header_value = b""
        self.headers: dict[bytes, bytes] = {}
        self.name: str | None = None
        self.value = bytearray()
        self.in_file = False

    def callbacks(self) -> dict[str, Any]:
        return {"on_part_begin": self.part_begin, "on_header_field": self.header_field,
                "on_header_value": self.header_value_, "on_header_end": self.header_end,
                "on_headers_finished": self.headers_finished, "on_part_data": self.part_data,
                "on_part_end": self.part_end}

    def part_begin(self) -> None:
        self.headers, self.name, self.value, self.in_file = {}, None, bytearray(), False

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def header_value_(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def header_end(self) -> None:
        self.headers[self.header_name.lower()] = self.header_value
        self.header_name, self.header_value = b"", b""

    def headers_finished(self) -> None:
        _, options = parse_options_header(self.headers.get(b"content-disposition", b""))
        self.name = options.get(b"name", b"").decode("utf-8", "replace")
        if self.name == "file":
            if self.received.writer is not None:
                raise UploadError(400, "invalid_request", "one file per upload")
            filename = options.get(b"filename", b"").decode("utf-8", "replace")
            self.received.filename = (filename.replace("\\", "/").rsplit("/", 1)[-1] or "upload.jsonl")[:255]
            self.received.writer = self.open_writer()
            self.in_file = True

    def part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if not self.in_file:
            if len(self.value) + len(chunk) > FIELD_BYTES:
                raise UploadError(400, "invalid_request", f"form field {self.name!r} is longer than {FIELD_BYTES} bytes")
            self.value += chunk
            return
        self.size += len(chunk)
        if self.size > self.limit:
            raise self.too_large
        self.counter.feed(chunk)
        self.pending.append(chunk)

    def part_end(self) -> None:
        if not self.in_file and self.name:
            self.received.fields[self.name] = self.value.decode("utf-8", "replace")
        self.in_file = False

    async def flush(self) -> None:
        """Write the queued file data (off the event loop: the store may be remote)."""
        if self.pending:
            data, self.pending = b"".join(self.pending), []
            await run_in_threadpool(self.received.writer.write, data)


async def receive_upload(request: Request, open_writer: Callable[[], Writer], limit: int, too_large: UploadError,
                         max_lines: int) -> Received:
    """Read a multipart upload as it streams in: its fields, and its ``file`` part written with
    ``open_writer()`` (left uncommitted: the caller commits or aborts it). Raises
    ``too_large`` past ``limit`` file bytes, UploadError for anything malformed; the file
    written so far is then removed."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not params.get(b"boundary"):
        raise UploadError(400, "invalid_request", "an upload is multipart/form-data with a 'file' and 'purpose'")
    parts = _Parts(open_writer, limit, too_large, max_lines)
    parser = MultipartParser(params[b"boundary"], parts.callbacks())
    body = 0
    try:
        async for chunk in request.stream():
            body += len(chunk)
            if body > limit + OVERHEAD:
                raise too_large
            try:
                parser.write(chunk)
            except MultipartParseError as exc:
                raise UploadError(400, "invalid_request", f"the multipart body is malformed: {exc}") from None
            await parts.flush()
        parser.finalize()
        if parts.received.writer is None:
            raise UploadError(400, "invalid_request", "the upload has no 'file' part")
    except BaseException:
        if parts.received.writer is not None:
            parts.received.writer.abort()
        raise
    parts.received.lines = parts.counter.total(parts.size)
    return parts.received
