"""The media policy against a real loopback media server: rows from API clients (``media_access:
public``, what ``llmbatch serve`` runs) cannot name local files, loopback (by IP, by name, by
IPv6), link-local or private hosts, nor reach them through a redirect; the server sees no
request. The operator's own rows (``local``) still reach all of it (the control that shows
the refusals are the policy's). Only regular files are read, with a bound."""

from __future__ import annotations

import http.server
import io
import os
import socket
import threading

import pytest

from llmbatch.errors import RowValidationError
from llmbatch.io import media_fetch
from llmbatch.io.media import MediaPolicy, load_image, media_bytes


def png_bytes() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(buf, format="PNG")
    return buf.getvalue()


class MediaServer:
    """A media server on ``host``: ``/a.png`` is an image; ``/to?u=URL`` redirects to URL.
    ``seen`` lists (path, Host header) of every request it got."""

    def __init__(self, host: str, family: int = socket.AF_INET):
        seen = self.seen = []
        body = png_bytes()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                seen.append((self.path, self.headers.get("Host")))
                if self.path.startswith("/to?u="):
                    self.send_response(302)
                    self.send_header("Location", self.path.split("=", 1)[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            address_family = family

        self.server = Server((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers():
    target = MediaServer("127.0.0.1")
    redirector = MediaServer("127.0.0.2")  # all of 127/8 is loopback on Linux
    try:
        v6 = MediaServer("::1", socket.AF_INET6)
    except OSError:  # no IPv6 loopback here
        v6 = None
    yield target, redirector, v6
    for s in (target, redirector, v6):
        if s is not None:
            s.close()


@pytest.fixture
def redirector_is_public(monkeypatch):
    """'media.example.test' resolves to the redirector (127.0.0.2), which counts as public: an
    allowed-looking host on the internet whose answer redirects to loopback."""
    real_resolve, real_public = media_fetch.resolve, media_fetch.is_public
    monkeypatch.setattr(media_fetch, "resolve",
                        lambda host, port: ["127.0.0.2"] if host == "media.example.test" else real_resolve(host, port))
    monkeypatch.setattr(media_fetch, "is_public", lambda a: a == "127.0.0.2" or real_public(a))


def refused_lines(tmp_path, target, v6):
    secret = tmp_path / "secret.png"
    secret.write_bytes(png_bytes())
    lines = [str(secret), f"file://{secret}", f"http://127.0.0.1:{target.port}/a.png",
             f"http://localhost:{target.port}/a.png", f"http://127.1:{target.port}/a.png",
             f"http://[::ffff:127.0.0.1]:{target.port}/a.png",
             f"http://media.example.test:{{redir}}/to?u=http://127.0.0.1:{target.port}/a.png",
             f"http://media.example.test:{{redir}}/to?u=http://localhost:{target.port}/a.png"]
    if v6 is not None:
        lines.append(f"http://[::1]:{v6.port}/a.png")
    return lines


def test_rows_from_clients_reach_no_local_file_and_no_loopback_host(tmp_path, servers, redirector_is_public):
    target, redirector, v6 = servers
    public = MediaPolicy.for_access("public", timeout_s=5, retries=0)
    lines = [line.replace("{redir}", str(redirector.port)) for line in refused_lines(tmp_path, target, v6)]
    for line in lines:
        with pytest.raises(RowValidationError) as info:
            load_image(line, public)
        assert "loopback" in str(info.value) or "local media files are not allowed" in str(info.value), line
    assert target.seen == [] and (v6 is None or v6.seen == [])
    assert [p for p, _ in redirector.seen] == [line.split(f":{redirector.port}", 1)[1] for line in lines
                                               if "media.example.test" in line]
    # the control: the operator's own rows reach every one of them
    local = MediaPolicy.for_access("local", timeout_s=5, retries=0)
    for line in lines:
        if "media.example.test" in line:
            line = line.replace("media.example.test", "127.0.0.2")
        assert load_image(line, local).size == (4, 4), line
    assert len(target.seen) == 6 and (v6 is None or len(v6.seen) == 1)


def test_link_local_private_and_reserved_addresses_are_refused_without_a_connection():
    public = MediaPolicy.for_access("public", timeout_s=1, retries=0)
    for url in ("http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/a.png", "http://192.168.1.1/a.png",
                "http://172.16.0.1/a.png", "http://100.64.0.1/a.png", "http://0.0.0.0/a.png",
                "http://[fe80::1]/a.png", "http://[fd00::1]/a.png", "http://240.0.0.1/a.png", "http://224.0.0.1/a.png"):
        with pytest.raises(RowValidationError, match="loopback, private, link-local or reserved"):
            media_bytes(url, public)
    for scheme in ("ftp://example.com/a.png", "gopher://example.com/", "file:///etc/passwd", "/etc/passwd"):
        with pytest.raises(RowValidationError):
            media_bytes(scheme, public)
    assert media_fetch.is_public("8.8.8.8") and media_fetch.is_public("2606:4700:4700::1111")
    assert not media_fetch.is_public("::ffff:10.0.0.1") and not media_fetch.is_public("::1")


def test_the_connection_goes_to_the_address_that_was_checked(servers, redirector_is_public):
    """The checked address is the one connected to: 'media.example.test' has no DNS record, so
    the request only arrives if the fetch used the resolution that was checked (no second
    lookup a rebinding DNS server could answer differently); Host keeps the URL's name."""
    _, redirector, _ = servers
    public = MediaPolicy.for_access("public", timeout_s=5, retries=0)
    assert load_image(f"http://media.example.test:{redirector.port}/a.png", public).size == (4, 4)
    assert redirector.seen == [("/a.png", f"media.example.test:{redirector.port}")]


def test_a_redirect_is_checked_against_allowed_media_domains(servers):
    target, _, _ = servers
    policy = MediaPolicy(allowed_media_domains=["localhost"], timeout_s=5, retries=0)
    assert load_image(f"http://localhost:{target.port}/a.png", policy).size == (4, 4)
    with pytest.raises(RowValidationError, match="'127.0.0.1' is not in allowed_media_domains"):
        load_image(f"http://localhost:{target.port}/to?u=http://127.0.0.1:{target.port}/a.png", policy)
    assert [p for p, _ in target.seen] == ["/a.png", f"/to?u=http://127.0.0.1:{target.port}/a.png"]


def test_a_refused_file_reads_the_same_whether_it_exists_or_not(tmp_path):
    (tmp_path / "there.png").write_bytes(png_bytes())
    public = MediaPolicy.for_access("public")
    texts = []
    for name in ("there.png", "not-there.png"):
        for form in (str(tmp_path / name), f"file://{tmp_path / name}"):
            with pytest.raises(RowValidationError) as info:
                media_bytes(form, public)
            texts.append(str(info.value))
    assert len(set(texts)) == 1 and "not-there" not in texts[0], texts
    root = tmp_path / "allowed"
    root.mkdir()
    (root / "a.png").write_bytes(png_bytes())
    rooted = MediaPolicy.for_access("public", allowed_local_media_path=str(root))
    assert load_image(str(root / "a.png"), rooted).size == (4, 4)
    with pytest.raises(RowValidationError, match="outside allowed_local_media_path"):
        media_bytes(str(tmp_path / "there.png"), rooted)


def test_only_regular_files_are_read_and_never_past_the_cap(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    policy = MediaPolicy(max_bytes=1 << 20)  # the operator's own rows: local files allowed
    for path in ("/dev/zero", "/dev/urandom", str(fifo), "/proc/self/environ", str(tmp_path)):
        with pytest.raises(RowValidationError, match="not a regular file|cannot read media file"):
            media_bytes(path, policy)
        with pytest.raises(RowValidationError):
            media_bytes(f"file://{path}", policy)


def test_parts_the_engine_fetches_itself_must_be_data_urls_for_client_rows(servers):
    """vLLM reads video_url parts itself, past every check here: rows from clients may give
    them only as data: URLs (the operator's own rows keep URLs, held to allowed_media_domains)."""
    from llmbatch.stages.multimodal import prepare_messages

    target, _, _ = servers

    def video(url):
        return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What happens?"}]}]

    public = MediaPolicy.for_access("public")
    for url in (f"http://127.0.0.1:{target.port}/v.mp4", "https://example.com/v.mp4", "file:///etc/passwd"):
        with pytest.raises(RowValidationError, match="must be data: URLs"):
            prepare_messages(video(url), public)
    prepare_messages(video("data:video/mp4;base64,AAAA"), public)
    prepare_messages(video("https://example.com/v.mp4"), MediaPolicy.for_access("local"))
    with pytest.raises(RowValidationError, match="not in allowed_media_domains"):
        prepare_messages(video("https://evil.example.net/v.mp4"), MediaPolicy(allowed_media_domains=["example.com"]))
    assert target.seen == []


def test_https_goes_to_the_checked_address_with_the_urls_name_for_the_certificate(tmp_path, monkeypatch,
                                                                                  redirector_is_public):
    """Over TLS the pinned connection still verifies the certificate against the URL's host
    (SNI and hostname check), not against the address it connects to."""
    import ssl
    import subprocess

    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=media.example.test", "-addext", "subjectAltName=DNS:media.example.test",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True)
    server = MediaServer("127.0.0.2")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server.server.socket = tls.wrap_socket(server.server.socket, server_side=True)
    trusted = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    monkeypatch.setattr(media_fetch.ssl, "create_default_context", lambda: trusted)
    try:
        public = MediaPolicy.for_access("public", timeout_s=5, retries=0)
        assert load_image(f"https://media.example.test:{server.port}/a.png", public).size == (4, 4)
        assert server.seen == [("/a.png", f"media.example.test:{server.port}")]
    finally:
        server.close()
