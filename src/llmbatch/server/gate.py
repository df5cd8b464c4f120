"""What every request passes before a route sees it (a plain ASGI middleware, so nothing reads
the body first): the Host and Origin of a ``--no-auth`` server (loopback names only, against
DNS rebinding and cross-site requests from a browser), the bearer key and its tenant (every
path but ``/health`` needs one, ``/openapi.json`` included), and the size of JSON bodies, read
up to ``max_json_bytes`` and refused past it. Uploads (``POST /v1/files``) stream to their
route, which writes them to the store and stops at its own limit."""

from __future__ import annotations

import hmac
from typing import Any
from urllib.parse import urlsplit

from starlette.responses import JSONResponse

from llmbatch.server.settings import LOCAL_TENANT, ServerSettings, is_loopback

TENANT = "llmbatch.tenant"          # the scope key routes read the caller's tenant from
UPLOAD_PATH = "/v1/files"
OPEN_PATHS = ("/health",)


def error(status: int, message: str, code: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


def _host_name(value: str) -> str:
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Gate:
    """The ASGI middleware (see module docstring)."""

    def __init__(self, app: Any, settings: ServerSettings):
        self.app = app
        self.settings = settings
        self.keys = [(key.encode(), tenant) for key, tenant in settings.keyring().items()]

    def tenant(self, headers: dict[bytes, bytes]) -> str | None:
        """The tenant of the request's bearer key (every key compared, in constant time each)."""
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        given = token.strip().encode("latin-1")
        found = None
        for key, tenant in self.keys:
            if hmac.compare_digest(given, key) and scheme.lower() == "bearer" and given:
                found = tenant
        return found

    def local_only(self, headers: dict[bytes, bytes]) -> JSONResponse | None:
        """A --no-auth server answers only requests addressed to a loopback name, and no page
        of another origin."""
        host = headers.get(b"host", b"").decode("latin-1")
        if not is_loopback(_host_name(host)):
            return error(403, f"this server has no API keys (--no-auth) and answers requests to localhost only, not "
                              f"to Host {host[:100]!r}", "forbidden_host")
        origin = headers.get(b"origin")
        if origin is not None and not is_loopback(urlsplit(origin.decode("latin-1")).hostname or ""):
            return error(403, "this server has no API keys (--no-auth): requests from web pages of other origins are "
                              "refused", "forbidden_origin")
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.settings.no_auth:
            refused = self.local_only(headers)
            if refused is not None:
                return await refused(scope, receive, send)
            scope[TENANT] = LOCAL_TENANT
        elif scope["path"] not in OPEN_PATHS:
            tenant = self.tenant(headers)
            if tenant is None:
                message = ("Incorrect API key provided: pass a key the server knows as 'Authorization: Bearer KEY'."
                           if headers.get(b"authorization") else
                           "You didn't provide an API key ('Authorization: Bearer KEY').")
                return await error(401, message, "invalid_api_key")(scope, receive, send)
            scope[TENANT] = tenant
        if scope["path"] == UPLOAD_PATH and scope["method"] == "POST":
            return await self.app(scope, receive, send)
        return await self._capped(scope, receive, send, headers)

    async def _capped(self, scope: dict[str, Any], receive: Any, send: Any, headers: dict[bytes, bytes]) -> None:
        """Read the (small) body whole, up to the cap, then hand it on."""
        limit = self.settings.max_json_bytes
        too_large = error(413, f"the request body is larger than {limit:,} bytes", "request_too_large")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)
