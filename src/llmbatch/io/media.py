"""Reading media named by row data: images given as objects, bytes, data URLs, http(s) URLs
or local paths, decoded once, with bounded memory; folders of image files as job inputs.

- Every item is capped (``max_bytes``): a URL is read at most that far, a file larger than it
  is refused before it is read, a decoded image may hold at most that many pixel bytes.
- URLs get a timeout per try and a few tries with backoff (connection errors, timeouts and
  5xx answers are retried; 4xx are not); :mod:`llmbatch.io.media_fetch` fetches them, each
  redirect hop checked again.
- Only regular files are read (a device, FIFO or ``/proc`` file is refused), up to the cap.
- :class:`MediaPolicy` says which paths and hosts a row may name (vLLM's option names:
  ``allowed_local_media_path``, ``allowed_media_domains``), and whether rows may name local
  files and private addresses at all: yes for the operator's own rows (``media_access:
  local``, CLI jobs and the Python API), no for rows from API clients (``media_access:
  public``, what ``llmbatch serve`` runs).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from llmbatch.errors import MissingDependencyError, RowValidationError
from llmbatch.io.media_fetch import fetch_url, short_url

#: Default cap on one media item (encoded bytes, or decoded pixel bytes): 64 MiB.
DEFAULT_MAX_BYTES = 64 << 20


#: ``media_access`` settings: whose rows these are decides what they may name.
MEDIA_ACCESS = ("local", "public")


@dataclass
class MediaPolicy:
    """Where media may come from and how much of it one item may be.

    ``allowed_local_media_path``: local files only under this folder (symlinks resolved);
    ``allowed_media_domains``: URLs (and every redirect's target) only from these hosts and
    their subdomains; ``local_files``: whether rows may name local paths and ``file://`` URLs
    at all (false: only under ``allowed_local_media_path``, if set); ``private_networks``:
    whether URLs may reach loopback, private, link-local and reserved addresses (false: checked
    after resolution, on every redirect hop, and the checked address is the one connected to);
    ``max_bytes``: the cap per item; ``timeout_s`` / ``retries``: per URL try, tries after the
    first; ``max_redirects``: hops followed per URL. Only regular files are read, up to the cap.

    :meth:`for_access` builds the two settings jobs use: ``"local"`` (the operator's own rows:
    CLI jobs and the Python API) and ``"public"`` (rows from API clients: ``llmbatch serve``)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = 20.0
    retries: int = 2
    local_files: bool = True
    private_networks: bool = True
    max_redirects: int = 5
    root: str | None = field(init=False, default=None)

    def __post_init__(self):
        if self.allowed_local_media_path:
            self.root = os.path.realpath(self.allowed_local_media_path)
        self.domains = [d.lower() for d in self.allowed_media_domains or []]

    @classmethod
    def for_access(cls, access: str = "local", **kwargs: Any) -> "MediaPolicy":
        """``"local"``: local files and every host allowed (tightened by the other options);
        ``"public"``: no local files unless ``allowed_local_media_path`` names a root, and only
        public addresses."""
        if access not in MEDIA_ACCESS:
            raise ValueError(f"media_access must be one of {MEDIA_ACCESS}, not {access!r}")
        public = access == "public"
        return cls(local_files=not public, private_networks=not public, **kwargs)

    def check_url(self, url: str) -> None:
        if not self.domains:
            return
        host = (urlsplit(url).hostname or "").lower()
        if not any(host == d or host.endswith("." + d) for d in self.domains):
            raise RowValidationError(f"media URL host {host!r} is not in allowed_media_domains {self.domains}")

    def check_path(self, path: str) -> str:
        """The real path of an allowed local file; the refusal never says whether it exists."""
        if not self.local_files and self.root is None:
            raise RowValidationError("local media files are not allowed here (only http(s) and data: URLs); the "
                                     "operator may allow a folder with engine_kwargs.allowed_local_media_path")
        real = os.path.realpath(path)
        if self.root is not None and os.path.commonpath([self.root, real]) != self.root:
            raise RowValidationError(f"media path {_short(path)!r} is outside allowed_local_media_path {self.root!r}")
        return real

    def check_engine_url(self, url: Any) -> None:
        """A media URL the engine reads itself (``video_url``, embeddings): it cannot be held to
        the address checks, so with ``private_networks=False`` only ``data:`` URLs pass."""
        if not isinstance(url, str) or url.startswith("data:"):
            return
        if not self.private_networks or not self.local_files:
            raise RowValidationError(f"media URL {_short(url)!r}: here parts the engine reads itself (video, "
                                     "embeddings) must be data: URLs")
        if url.startswith(("http://", "https://")):
            self.check_url(url)

    def too_big(self, size: int, what: str) -> RowValidationError:
        return RowValidationError(f"{what} is {size} bytes, over the cap of {self.max_bytes} bytes per media item "
                                  "(prepare_multimodal_stage.max_item_bytes)")


def _short(value: str, n: int = 80) -> str:
    return short_url(value, n)


def read_path(path: str, policy: MediaPolicy) -> bytes:
    """A regular file's bytes (at most the cap): devices, FIFOs, folders and /proc files are
    refused, and the read stops past the cap whatever the size said."""
    real = policy.check_path(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise RowValidationError(f"cannot read media file {_short(path)!r}: {exc.strerror or exc}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or real.startswith(("/proc/", "/sys/")):
        os.close(fd)
        raise RowValidationError(f"media file {_short(path)!r} is not a regular file")
    with os.fdopen(fd, "rb") as fh:
        if info.st_size > policy.max_bytes:
            raise policy.too_big(info.st_size, f"media file {_short(path)!r}")
        try:
            data = fh.read(policy.max_bytes + 1)
        except OSError as exc:
            raise RowValidationError(f"cannot read media file {_short(path)!r}: {exc.strerror or exc}") from exc
    if len(data) > policy.max_bytes:
        raise policy.too_big(len(data), f"media file {_short(path)!r} (at least)")
    return data


def media_bytes(value: Any, policy: MediaPolicy, kind: str = "image") -> bytes:
    """Raw bytes of a media item given as bytes, a data URL, an http(s) URL, a ``file://`` URL
    or a local path (or a ``{"bytes": ...}`` / ``{"path": ...}`` / ``{"url": ...}`` dict, as
    Hugging Face datasets and Parquet files hold images)."""
    if isinstance(value, dict):
        for key in ("bytes", "url", "path"):
            if value.get(key) is not None:
                return media_bytes(value[key], policy, kind)
        raise RowValidationError(f"an {kind} dict needs 'bytes', 'url' or 'path'; got keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if len(data) > policy.max_bytes:
            raise policy.too_big(len(data), f"the {kind} bytes")
        return data
    if not isinstance(value, str):
        raise RowValidationError(f"an {kind} must be given as bytes, a data URL, a URL or a path; "
                                 f"got {type(value).__name__}")
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if not payload or ";base64" not in head:
            raise RowValidationError(f"the {kind} data URL must be 'data:<type>;base64,<data>'")
        if len(payload) * 3 // 4 > policy.max_bytes:
            raise policy.too_big(len(payload) * 3 // 4, f"the {kind} data URL")
        try:
            return base64.b64decode(payload, validate=False)
        except ValueError as exc:
            raise RowValidationError(f"the {kind} data URL is not valid base64: {exc}") from exc
    if value.startswith(("http://", "https://")):
        return fetch_url(value, policy)
    if "://" in value and not value.startswith("file://"):
        raise RowValidationError(f"unsupported {kind} URL scheme in {_short(value)!r}; use http(s), file or data URLs")
    return read_path(value.removeprefix("file://"), policy)


def _pil():
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - pillow comes with vllm
        raise MissingDependencyError("images in messages", "pillow") from exc
    return Image


def load_image(value: Any, policy: MediaPolicy | None = None):
    """An RGB PIL image from a PIL image, bytes, a data URL, an http(s) URL or a path."""
    policy = policy or MediaPolicy()
    Image = _pil()
    if isinstance(value, Image.Image):
        image = value
    else:
        data = media_bytes(value, policy, "image")
        try:
            image = Image.open(io.BytesIO(data))
            pixels = image.width * image.height * max(3, len(image.getbands()))
            if pixels > policy.max_bytes:
                raise policy.too_big(pixels, f"the decoded image ({image.width}x{image.height})")
            image.load()
        except RowValidationError:
            raise
        except Exception as exc:  # noqa: BLE001 - PIL raises several types for undecodable data
            raise RowValidationError(f"the image is not a decodable image ({type(exc).__name__}: {exc})") from exc
    pixels = image.width * image.height * 3
    if pixels > policy.max_bytes:
        raise policy.too_big(pixels, f"the image ({image.width}x{image.height}, RGB)")
    return image if image.mode == "RGB" else image.convert("RGB")


#: File suffixes a folder of images is read for.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")


def is_image_folder(path: str) -> bool:
    return os.path.isdir(path) and any(n.lower().endswith(IMAGE_SUFFIXES) for n in os.listdir(path))


def read_image_folder(path: str, batch_rows: int = 8192):
    """A folder of image files (recursively, sorted by name) as rows ``{"path", "name"}``: the
    images are read by the multimodal stage, from the path, not copied into the job."""
    root = os.path.realpath(path)
    names = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        names.extend(os.path.relpath(os.path.join(folder, f), root) for f in files if f.lower().endswith(IMAGE_SUFFIXES))
    names.sort()
    for start in range(0, len(names), batch_rows):
        yield [{"path": os.path.join(root, n), "name": n} for n in names[start:start + batch_rows]]


def media_key(source: Any, keys: tuple[str, ...], decoded: Callable[[], tuple[str, bytes]]) -> bytes:
    """What identifies a media item within a run (images and audio alike): its encoded bytes, or
    the URL or path that named it (cheaper than what it decodes to), or else ``decoded()``: a
    header (kind, shape) and the decoded payload, for an item given decoded. A dict ``source``
    is looked up by ``keys``, the first present."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(source, dict):
        source = next((source[k] for k in keys if source.get(k) is not None), None)
    if isinstance(source, (bytes, bytearray, memoryview)):
        h.update(b"b" + bytes(source))
    elif isinstance(source, str):
        h.update(b"s" + source.encode("utf-8", "surrogatepass"))
    else:
        header, payload = decoded()
        h.update(header.encode())
        h.update(payload)
    return h.digest()


def image_key(source: Any, image) -> bytes:
    """What identifies an image within a run (:func:`media_key`): its encoded bytes, its URL or
    path, or the pixels of an image given decoded."""
    return media_key(source, ("bytes", "url", "path"), lambda: (f"p{image.mode}{image.size}", image.tobytes()))
