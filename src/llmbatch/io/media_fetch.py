"""Fetching one media URL under a :class:`~llmbatch.io.media.MediaPolicy`.

- http(s) only; each redirect is followed here, one hop at a time, and every hop is checked
  again (scheme, ``allowed_media_domains``, addresses), never by the HTTP library.
- With ``private_networks=False`` (rows that are not the operator's, as in ``llmbatch serve``)
  the host is resolved once, every address it resolves to must be public (no loopback,
  private, link-local such as 169.254.169.254, shared, multicast or reserved addresses, IPv4
  or IPv6, IPv4-mapped included), and the connection goes to the address that was checked, so
  a second DNS answer cannot move it (DNS rebinding). Proxies from the environment are not
  used then (a proxy would resolve the name itself).
- The body is read up to ``max_bytes`` (one more byte says it is over), with a timeout per try
  and a few tries for connection errors, timeouts and 5xx answers; refusals are not retried.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urljoin, urlsplit

from llmbatch.errors import RowValidationError
from llmbatch.redact import redact_text

REDIRECTS = (301, 302, 303, 307, 308)


class _Retry(Exception):
    """A failure worth another try (connection error, timeout, 5xx)."""


def short_url(url: str, n: int = 80) -> str:
    url = redact_text(url)
    return url if len(url) <= n else url[:n] + "..."


def is_public(address: str) -> bool:
    """Whether an IP address is a public unicast one (what a row from a client may reach)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped or ip.sixtofour
        if mapped is not None:
            ip = mapped
        elif ip.teredo:
            ip = ip.teredo[1]
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local
                                 or ip.is_private or ip.is_unspecified)


def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to (a literal address: itself)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def check_hop(url: str, policy: Any) -> tuple[Any, list[str] | None]:
    """Check one URL (the first or a redirect's target); returns its parts and, where addresses
    are checked, the addresses to connect to. Raises RowValidationError when it is refused."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise RowValidationError(f"media URL {short_url(url)!r}: only http(s) URLs are fetched")
    policy.check_url(url)
    host = parts.hostname or ""
    if not host:
        raise RowValidationError(f"media URL {short_url(url)!r} names no host")
    if policy.private_networks:
        return parts, None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError) as exc:
        raise _Retry(f"cannot resolve {host!r}: {exc}") from exc
    if not addresses or not all(is_public(a) for a in addresses):
        raise RowValidationError(f"media URL {short_url(url)!r} resolves to a loopback, private, link-local or "
                                 "reserved address, which rows from API clients may not reach")
    return parts, addresses


def _connect_any(addresses: list[str], port: int, timeout: float, source: Any) -> socket.socket:
    """A connection to the first of ``addresses`` (all checked) that answers."""
    last: OSError | None = None
    for address in addresses:
        try:
            return socket.create_connection((address, port), timeout, source)
        except OSError as exc:
            last = exc
    raise last or OSError("no address to connect to")


def _pinned_get(parts: Any, addresses: list[str], policy: Any) -> http.client.HTTPResponse:
    """GET ``parts`` from one of ``addresses`` (the checked ones), with the URL's host for Host,
    SNI and the certificate check."""
    host, port = parts.hostname, parts.port
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=policy.timeout_s, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=policy.timeout_s)
    port = conn.port
    conn._create_connection = lambda _addr, timeout, source: _connect_any(addresses, port, timeout, source)
    path = parts.path or "/"
    conn.request("GET", path + (f"?{parts.query}" if parts.query else ""), headers={"User-Agent": "llmbatch"})
    return conn.getresponse()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _get(url: str, parts: Any, addresses: list[str] | None, policy: Any) -> tuple[int, Any, Any]:
    """(status, headers, response) of one GET, redirects not followed."""
    if addresses is not None:
        resp = _pinned_get(parts, addresses, policy)
        return resp.status, resp.headers, resp
    try:
        resp = _OPENER.open(urllib.request.Request(url, headers={"User-Agent": "llmbatch"}), timeout=policy.timeout_s)
    except urllib.error.HTTPError as exc:  # 3xx (not followed) and 4xx/5xx
        return exc.code, exc.headers, exc
    return resp.status, resp.headers, resp


def _read(resp: Any, url: str, policy: Any) -> bytes:
    length = resp.headers.get("Content-Length")
    if length and length.isdigit() and int(length) > policy.max_bytes:
        raise policy.too_big(int(length), f"media URL {short_url(url)!r}")
    data = resp.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:
        raise policy.too_big(len(data), f"media URL {short_url(url)!r} (at least)")
    return data


def _fetch_once(url: str, policy: Any) -> bytes:
    for _ in range(policy.max_redirects + 1):
        parts, addresses = check_hop(url, policy)
        try:
            status, headers, resp = _get(url, parts, addresses, policy)
        except RowValidationError:
            raise
        except (urllib.error.URLError, http.client.HTTPException, TimeoutError, OSError, ValueError) as exc:
            raise _Retry(f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}") from exc
        try:
            if status in REDIRECTS and headers.get("Location"):
                url = urljoin(url, headers["Location"])
                continue
            if status >= 500:
                raise _Retry(f"HTTP {status}")
            if status >= 400:
                raise RowValidationError(f"could not fetch media URL {short_url(url)!r}: HTTP {status}")
            if status != 200:
                raise RowValidationError(f"could not fetch media URL {short_url(url)!r}: HTTP {status} (want 200)")
            try:
                return _read(resp, url, policy)
            except (http.client.HTTPException, TimeoutError, OSError) as exc:
                raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        finally:
            resp.close()
    raise RowValidationError(f"media URL {short_url(url)!r}: more than {policy.max_redirects} redirects")


def fetch_url(url: str, policy: Any) -> bytes:
    """The body of ``url`` (at most ``policy.max_bytes``) under the policy, with a timeout per
    try and retries; every refusal or failure is a RowValidationError."""
    last = ""
    for attempt in range(policy.retries + 1):
        if attempt:
            time.sleep(min(2.0, 0.25 * 2 ** (attempt - 1)))
        try:
            return _fetch_once(url, policy)
        except _Retry as exc:
            last = str(exc)
    raise RowValidationError(f"could not fetch media URL {short_url(url)!r} after {policy.retries + 1} tries "
                             f"(timeout {policy.timeout_s:g}s each): {redact_text(last)}")
