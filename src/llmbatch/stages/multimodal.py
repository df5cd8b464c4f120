"""The multimodal stage: images in ``messages`` -> ``multimodal_data`` for the engine.

Image parts may be a PIL image, raw bytes, a ``data:`` URL, an http(s) URL or a local path.
Each becomes a decoded RGB image; a part that is not an image fails the row with a clear
error instead of failing the engine batch.
"""

from __future__ import annotations

import base64
import io
import os
from typing import Any

from llmbatch.errors import MissingDependencyError, RowValidationError
from llmbatch.rows import Row
from llmbatch.stages.base import Stage

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


class MediaPolicy:
    """Which media a row may name (vLLM's option names, set in ``engine_kwargs``):
    ``allowed_local_media_path`` (local files only under this folder) and
    ``allowed_media_domains`` (URLs only from these hosts). Unset: no restriction."""

    def __init__(self, allowed_local_media_path: str | None = None, allowed_media_domains: list[str] | None = None):
        self.root = os.path.realpath(allowed_local_media_path) if allowed_local_media_path else None
        self.domains = [d.lower() for d in allowed_media_domains or []]

    def check_url(self, url: str) -> None:
        if not self.domains:
            return
        from urllib.parse import urlsplit

        host = (urlsplit(url).hostname or "").lower()
        if not any(host == d or host.endswith("." + d) for d in self.domains):
            raise RowValidationError(f"media URL host {host!r} is not in allowed_media_domains {self.domains}")

    def check_path(self, path: str) -> str:
        real = os.path.realpath(path)
        if self.root is not None and os.path.commonpath([self.root, real]) != self.root:
            raise RowValidationError(f"media path {path!r} is outside allowed_local_media_path {self.root!r}")
        return real


def load_image(value: Any, policy: MediaPolicy | None = None):
    """Decode an image given as PIL image, bytes, data URL, http(s) URL or path (URLs and
    paths as ``policy`` allows)."""
    policy = policy or MediaPolicy()
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - pillow comes with vllm
        raise MissingDependencyError("images in messages", "pillow") from exc
    if isinstance(value, dict):
        value = value.get("url", value.get("bytes"))
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    data: bytes
    if isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif isinstance(value, str) and value.startswith("data:"):
        try:
            data = base64.b64decode(value.split(",", 1)[1])
        except (IndexError, ValueError) as exc:
            raise RowValidationError(f"image data URL is not valid base64: {exc}") from exc
    elif isinstance(value, str) and value.startswith(("http://", "https://")):
        import urllib.request

        policy.check_url(value)
        with urllib.request.urlopen(value, timeout=30) as resp:  # noqa: S310 - user-given URL, policy checked
            data = resp.read()
    elif isinstance(value, str):
        path = policy.check_path(value.removeprefix("file://"))
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise RowValidationError(f"cannot read image {value!r}: {exc}") from exc
    else:
        raise RowValidationError(f"an image must be a PIL image, bytes, a data URL, a URL or a path; got {type(value).__name__}")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as exc:  # noqa: BLE001 - PIL raises several types for undecodable data
        raise RowValidationError(f"the image part is not a decodable image ({type(exc).__name__}: {exc})") from exc
    return image.convert("RGB")


class PrepareMultimodalStage(Stage):
    """Collects the image parts of ``messages`` into ``multimodal_data``."""

    name = "prepare_multimodal"

    def __init__(self, policy: MediaPolicy | None = None):
        super().__init__()
        self.policy = policy or MediaPolicy()

    def process_row(self, row: Row) -> None:
        images = []
        messages = row.get("messages")
        if not isinstance(messages, list):
            return  # prompt rows, or malformed messages (the chat template stage reports those)
        for msg in messages:
            content = msg.get("content") if isinstance(msg, dict) else None
            if not isinstance(content, list):
                continue
            for part in content:
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    raw = part.get("image", part.get("image_url", part.get("input_image")))
                    images.append(load_image(raw, self.policy))
                    part.clear()
                    part["type"] = "image"
        if images:
            row["multimodal_data"] = {"image": images if len(images) > 1 else images[0]}
