"""The HTTP API: OpenAI's ``/v1/files`` and ``/v1/batches`` (and ``/v1/models``), so the
official ``openai`` SDK is the client. Errors have OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``); every ``/v1`` route needs a bearer key
unless the server runs with ``--no-auth``."""

from __future__ import annotations

import hmac
import re
import time
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from llmbatch.io.openai_requests import ENDPOINTS
from llmbatch.server.db import Database
from llmbatch.server.files import UploadError, file_object, new_id, store_upload
from llmbatch.server.runner import ACTIVE, BatchRunner
from llmbatch.server.settings import ServerSettings
from llmbatch.server.storage import FileStore

WINDOW = re.compile(r"^(\d+)([mhd])$")
SECONDS = {"m": 60, "h": 3600, "d": 86400}


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
    keys = [k.encode() for k in settings.api_keys]

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.code, exc.param, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"{param or 'request'}: {first.get('msg', 'invalid request')}", "invalid_request", param)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        """Every /v1 route needs a known bearer key; checked before a body is read."""
        if settings.no_auth or not request.url.path.startswith("/v1"):
            return await call_next(request)
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not given or not any(hmac.compare_digest(given, k) for k in keys):
            message = ("Incorrect API key provided: pass a key the server knows as 'Authorization: Bearer KEY'."
                       if header else "You didn't provide an API key ('Authorization: Bearer KEY').")
            return _error(401, message, "invalid_api_key")
        return await call_next(request)

    auth: list[Any] = []

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=auth)
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "llmbatch"}
                                           for name in model_names]}

    # -- files -------------------------------------------------------------------------------

    def get_file(file_id: str) -> dict[str, Any]:
        row = db.get(db.files, file_id)
        if row is None:
            raise ApiError(404, f"No such File object: {file_id}", "file_not_found", "id")
        return row

    @app.post("/v1/files", dependencies=auth)
    def upload(request: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
        if purpose != "batch":
            raise ApiError(400, f"purpose {purpose!r} is not served here; this server takes purpose=batch",
                           "invalid_value", "purpose")
        declared = int(request.headers.get("content-length") or 0)
        if declared > settings.max_file_bytes + (1 << 16):
            raise ApiError(413, f"the file is larger than {settings.max_file_bytes:,} bytes (--max-file-bytes)",
                           "file_too_large", "file")
        try:
            row = store_upload(db, store, file.file, file.filename or "upload.jsonl", purpose,
                               settings.max_file_bytes, settings.max_lines)
        except UploadError as exc:
            raise ApiError(exc.status, str(exc), exc.code, "file") from None
        return file_object(row)

    @app.get("/v1/files", dependencies=auth)
    def list_files(after: Optional[str] = None, limit: int = 10000, order: str = "desc",
                   purpose: Optional[str] = None) -> dict[str, Any]:
        if not 1 <= limit <= 10000 or order not in ("asc", "desc"):
            raise ApiError(400, "limit is 1 to 10000 and order asc or desc", "invalid_value", "limit")
        where = db.files.c.purpose == purpose if purpose else None
        rows, more = db.page(db.files, after, limit, newest_first=order == "desc", where=where)
        return _page(rows, more, file_object)

    @app.get("/v1/files/{file_id}", dependencies=auth)
    def retrieve_file(file_id: str) -> dict[str, Any]:
        return file_object(get_file(file_id))

    @app.get("/v1/files/{file_id}/content", dependencies=auth)
    def file_content(file_id: str) -> StreamingResponse:
        get_file(file_id)
        fh = store.open(file_id)

        def chunks():
            with fh:
                while chunk := fh.read(1 << 20):
                    yield chunk

        return StreamingResponse(chunks(), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}", dependencies=auth)
    def delete_file(file_id: str) -> dict[str, Any]:
        get_file(file_id)
        user = db.file_in_use(file_id, ACTIVE)
        if user:
            raise ApiError(409, f"file {file_id} is the input of batch {user}, which has not finished; cancel it or "
                                "wait", "file_in_use", "file_id")
        db.delete_file(file_id)
        store.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches -----------------------------------------------------------------------------

    def get_batch(batch_id: str) -> dict[str, Any]:
        row = db.get(db.batches, batch_id)
        if row is None:
            raise ApiError(404, f"No such Batch object: {batch_id}", "batch_not_found", "id")
        return row

    @app.post("/v1/batches", dependencies=auth)
    def create_batch(body: CreateBatch) -> dict[str, Any]:
        if body.endpoint not in endpoints:
            served = ", ".join(endpoints)
            code = "unsupported_endpoint" if body.endpoint in ENDPOINTS else "invalid_value"
            raise ApiError(400, f"endpoint {body.endpoint!r} is not served here (the model serves {served})", code,
                           "endpoint")
        window = WINDOW.match(body.completion_window)
        if window is None or int(window.group(1)) < 1:
            raise ApiError(400, "completion_window is a duration such as 24h (or 90m, 7d)", "invalid_value",
                           "completion_window")
        _check_metadata(body.metadata)
        source = db.get(db.files, body.input_file_id)
        if source is None:
            raise ApiError(400, f"No such File object: {body.input_file_id}", "file_not_found", "input_file_id")
        if source["purpose"] != "batch":
            raise ApiError(400, f"file {body.input_file_id} has purpose {source['purpose']!r}, not 'batch'",
                           "invalid_value", "input_file_id")
        now = int(time.time())
        row = {"id": new_id("batch_"), "endpoint": body.endpoint, "input_file_id": body.input_file_id,
               "completion_window": body.completion_window, "status": "validating", "created_at": now,
               "expires_at": now + int(window.group(1)) * SECONDS[window.group(2)], "metadata": body.metadata,
               "total": 0, "completed": 0, "failed": 0, "attempts": 0}
        db.insert(db.batches, row)
        runner.wake.set()
        return batch_object(get_batch(row["id"]))

    @app.get("/v1/batches/{batch_id}", dependencies=auth)
    def retrieve_batch(batch_id: str) -> dict[str, Any]:
        return batch_object(get_batch(batch_id))

    @app.get("/v1/batches", dependencies=auth)
    def list_batches(after: Optional[str] = None, limit: int = 20) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit is 1 to 100", "invalid_value", "limit")
        rows, more = db.page(db.batches, after, limit)
        return _page(rows, more, batch_object)

    @app.post("/v1/batches/{batch_id}/cancel", dependencies=auth)
    def cancel_batch(batch_id: str) -> dict[str, Any]:
        row = get_batch(batch_id)
        if row["status"] in ("cancelling", "cancelled"):
            return batch_object(row)
        if not db.transition(batch_id, ("validating", "in_progress"), status="cancelling",
                             cancelling_at=int(time.time())):
            raise ApiError(409, f"batch {batch_id} is {get_batch(batch_id)['status']}: only a validating or "
                                "in-progress batch can be cancelled", "invalid_state", "batch_id")
        runner.wake.set()
        return batch_object(get_batch(batch_id))

    return app
