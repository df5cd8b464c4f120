"""The HTTP API: OpenAI's ``/v1/files`` and ``/v1/batches`` (and ``/v1/models``), so the
official ``openai`` SDK is the client. Errors have OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``). Every route but ``/health`` needs a
bearer key unless the server runs with ``--no-auth`` (``server.gate``); each key's tenant sees
only its own files and batches (another tenant's are answered as if they did not exist), and
stores at most ``tenant_bytes`` in files and ``tenant_batches`` unfinished batches (429)."""

from __future__ import annotations

import re
import time
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from pydantic import BaseModel

from llmbatch.openai.vocab import ENDPOINTS
from llmbatch.server.db import Database
from llmbatch.server.files import UploadError, file_object, new_id
from llmbatch.server.gate import TENANT, Gate
from llmbatch.server.runner import ACTIVE, BatchRunner
from llmbatch.server.settings import ServerSettings
from llmbatch.server.storage import FileStore
from llmbatch.server.uploads import receive_upload

WINDOW = re.compile(r"^(\d{1,6})([hd])$")
SECONDS = {"h": 3600, "d": 86400}
DAY = 86400
EXPIRY_RANGE = (3600, 30 * DAY)   # expires_after / output_expires_after seconds, as OpenAI's


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind


def _error(status: int, message: str, code: str | None, param: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class CreateBatch(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: Optional[dict[str, str]] = None
    output_expires_after: Optional[dict[str, Any]] = None


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    errors = row["errors"]
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "model": row["model"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": row["created_at"], "in_progress_at": row["in_progress_at"], "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"], "completed_at": row["completed_at"], "failed_at": row["failed_at"],
        "expired_at": row["expired_at"], "cancelling_at": row["cancelling_at"], "cancelled_at": row["cancelled_at"],
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": row["metadata"], "usage": row["usage"],
    }


def _page(rows: list[dict[str, Any]], more: bool, shape) -> dict[str, Any]:
    data = [shape(r) for r in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > 16:
        raise ApiError(400, "metadata has at most 16 keys", "invalid_value", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise ApiError(400, "metadata keys have at most 64 characters and values are strings of at most 512",
                           "invalid_value", "metadata")


def window_seconds(value: str, longest: int) -> int:
    """The seconds of a ``completion_window``: OpenAI's ``24h``, or longer up to ``longest``."""
    match = WINDOW.match(value)
    seconds = int(match.group(1)) * SECONDS[match.group(2)] if match else 0
    if not DAY <= seconds <= longest:
        raise ApiError(400, f"completion_window is 24h (as OpenAI's), or a longer window of hours or days up to "
                            f"{longest // 3600}h (the server's limit), such as 48h or 7d; not {value[:40]!r}",
                       "invalid_value", "completion_window")
    return seconds


def expiry_seconds(anchor: Any, seconds: Any, param: str) -> int:
    """``expires_after`` / ``output_expires_after``: anchor ``created_at``, 1 hour to 30 days."""
    try:
        value = int(seconds)
    except (TypeError, ValueError):
        value = 0
    if anchor != "created_at" or not EXPIRY_RANGE[0] <= value <= EXPIRY_RANGE[1]:
        raise ApiError(400, f"{param} is {{'anchor': 'created_at', 'seconds': N}} with N from {EXPIRY_RANGE[0]} (1 "
                            f"hour) to {EXPIRY_RANGE[1]} (30 days)", "invalid_value", param)
    return value


def tenant_of(request: Request) -> str:
    """The caller's tenant (``server.gate`` put it in the request's scope)."""
    return request.scope[TENANT]


def create_app(settings: ServerSettings, db: Database, store: FileStore, runner: BatchRunner,
               endpoints: list[str], model_names: list[str]) -> FastAPI:
    """The app; the runner starts and stops with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="llmbatch Batch API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(Gate, settings=settings)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.code, exc.param, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"{param or 'request'}: {first.get('msg', 'invalid request')}", "invalid_request", param)

    def quota(message: str) -> ApiError:
        return ApiError(429, message, "quota_exceeded", kind="insufficient_quota")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "llmbatch"}
                                           for name in model_names]}

    # -- files -------------------------------------------------------------------------------

    def get_file(file_id: str, tenant: str) -> dict[str, Any]:
        row = db.get(db.files, file_id, tenant=tenant)
        if row is None:
            raise ApiError(404, f"No such File object: {file_id}", "file_not_found", "id")
        return row

    @app.post("/v1/files")
    async def upload(request: Request, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        limit = settings.max_file_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + (1 << 16):
            raise ApiError(413, f"the file is larger than {limit:,} bytes (--max-file-bytes)", "file_too_large", "file")
        stored, _ = await run_in_threadpool(db.tenant_usage, tenant, ACTIVE)
        room = settings.tenant_bytes - stored
        too_large = UploadError(413, "file_too_large", f"the file is larger than {limit:,} bytes (the server's "
                                                       "--max-file-bytes)")
        if room < limit:
            too_large = UploadError(429, "quota_exceeded", f"this key's project stores {stored:,} bytes of files and "
                                    f"may store {settings.tenant_bytes:,} (--tenant-bytes): delete files to make room")
            if room <= 0:
                raise quota(str(too_large))
        file_id = new_id("file-")
        try:
            got = await receive_upload(request, lambda: store.writer(file_id), min(limit, room), too_large,
                                       settings.max_lines)
        except UploadError as exc:
            raise ApiError(exc.status, str(exc), exc.code, "file",
                           "insufficient_quota" if exc.status == 429 else "invalid_request_error") from None
        try:
            purpose = got.fields.get("purpose")
            if purpose != "batch":
                raise ApiError(400, f"purpose {purpose!r} is not served here; this server takes purpose=batch",
                               "invalid_value", "purpose")
            now = int(time.time())
            ttl = None
            if "expires_after[anchor]" in got.fields or "expires_after[seconds]" in got.fields:
                ttl = expiry_seconds(got.fields.get("expires_after[anchor]"), got.fields.get("expires_after[seconds]"),
                                     "expires_after")
            got.writer.commit()
        except BaseException:
            got.writer.abort()
            raise
        row = {"id": file_id, "bytes": got.writer.bytes, "created_at": now, "expires_at": now + ttl if ttl else None,
               "filename": got.filename, "purpose": purpose, "status": "processed", "lines": got.lines,
               "tenant": tenant}
        await run_in_threadpool(db.insert, db.files, row)
        return file_object(row)

    @app.get("/v1/files")
    def list_files(after: Optional[str] = None, limit: int = 10000, order: str = "desc",
                   purpose: Optional[str] = None, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        if not 1 <= limit <= 10000 or order not in ("asc", "desc"):
            raise ApiError(400, "limit is 1 to 10000 and order asc or desc", "invalid_value", "limit")
        where = db.files.c.purpose == purpose if purpose else None
        rows, more = db.page(db.files, after, limit, newest_first=order == "desc", where=where, tenant=tenant)
        return _page(rows, more, file_object)

    @app.get("/v1/files/{file_id}")
    def retrieve_file(file_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return file_object(get_file(file_id, tenant))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, tenant: str = Depends(tenant_of)) -> StreamingResponse:
        get_file(file_id, tenant)
        try:
            fh = store.open(file_id)
        except FileNotFoundError:  # deleted (or expired) meanwhile
            raise ApiError(404, f"No such File object: {file_id}", "file_not_found", "id") from None

        def chunks():
            with fh:
                while chunk := fh.read(1 << 20):
                    yield chunk

        return StreamingResponse(chunks(), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        get_file(file_id, tenant)
        user = db.file_in_use(file_id, ACTIVE)
        if user:
            raise ApiError(409, f"file {file_id} is the input of batch {user}, which has not finished; cancel it or "
                                "wait", "file_in_use", "file_id")
        db.delete_file(file_id)
        store.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches -----------------------------------------------------------------------------

    def get_batch(batch_id: str, tenant: str) -> dict[str, Any]:
        row = db.get(db.batches, batch_id, tenant=tenant)
        if row is None:
            raise ApiError(404, f"No such Batch object: {batch_id}", "batch_not_found", "id")
        return row

    @app.post("/v1/batches")
    def create_batch(body: CreateBatch, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        if body.endpoint not in endpoints:
            served = ", ".join(endpoints)
            code = "unsupported_endpoint" if body.endpoint in ENDPOINTS else "invalid_value"
            raise ApiError(400, f"endpoint {body.endpoint!r} is not served here (the model serves {served})", code,
                           "endpoint")
        window = window_seconds(body.completion_window, settings.max_window_s)
        _check_metadata(body.metadata)
        output_ttl = None
        if body.output_expires_after is not None:
            output_ttl = expiry_seconds(body.output_expires_after.get("anchor"),
                                        body.output_expires_after.get("seconds"), "output_expires_after")
        source = db.get(db.files, body.input_file_id, tenant=tenant)
        if source is None:
            raise ApiError(400, f"No such File object: {body.input_file_id}", "file_not_found", "input_file_id")
        if source["purpose"] != "batch":
            raise ApiError(400, f"file {body.input_file_id} has purpose {source['purpose']!r}, not 'batch'",
                           "invalid_value", "input_file_id")
        _, queued = db.tenant_usage(tenant, ACTIVE)
        if queued >= settings.tenant_batches:
            raise quota(f"this key's project has {queued} unfinished batches, the most it may have "
                        f"(--tenant-batches {settings.tenant_batches}): wait for one to finish or cancel one")
        now = int(time.time())
        row = {"id": new_id("batch_"), "endpoint": body.endpoint, "input_file_id": body.input_file_id,
               "completion_window": body.completion_window, "status": "validating", "created_at": now,
               "expires_at": now + window, "metadata": body.metadata, "total": 0, "completed": 0, "failed": 0,
               "attempts": 0, "tenant": tenant, "output_expires_s": output_ttl}
        db.insert(db.batches, row)
        runner.wake.set()
        return batch_object(get_batch(row["id"], tenant))

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return batch_object(get_batch(batch_id, tenant))

    @app.get("/v1/batches")
    def list_batches(after: Optional[str] = None, limit: int = 20, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit is 1 to 100", "invalid_value", "limit")
        rows, more = db.page(db.batches, after, limit, tenant=tenant)
        return _page(rows, more, batch_object)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        row = get_batch(batch_id, tenant)
        if row["status"] in ("cancelling", "cancelled"):
            return batch_object(row)
        if not db.transition(batch_id, ("validating", "in_progress"), status="cancelling",
                             cancelling_at=int(time.time())):
            raise ApiError(409, f"batch {batch_id} is {get_batch(batch_id, tenant)['status']}: only a validating or "
                                "in-progress batch can be cancelled", "invalid_state", "batch_id")
        runner.wake.set()
        return batch_object(get_batch(batch_id, tenant))

    return app
