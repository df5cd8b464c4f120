"""Media named by row data is read only where the user allows it."""

from __future__ import annotations

import io

import pytest

from llmbatch.errors import RowValidationError
from llmbatch.stages.multimodal import MediaPolicy, load_image


def png_bytes():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(buf, format="PNG")
    return buf.getvalue()


def test_local_paths_only_under_the_allowed_root(tmp_path):
    allowed = tmp_path / "images"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    assert load_image(str(allowed / "a.png"), policy).size == (4, 4)
    for bad in (str(tmp_path / "secret.png"), str(allowed / ".." / "secret.png")):
        with pytest.raises(RowValidationError, match="outside allowed_local_media_path"):
            load_image(bad, policy)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(RowValidationError, match="outside allowed_local_media_path"):
        load_image(str(allowed / "link.png"), policy)
    assert load_image(str(tmp_path / "secret.png")).size == (4, 4)  # unset: no restriction


def test_urls_only_from_allowed_domains():
    policy = MediaPolicy(allowed_media_domains=["images.example.com"])
    with pytest.raises(RowValidationError, match="not in allowed_media_domains"):
        load_image("http://169.254.169.254/latest/meta-data", policy)
    with pytest.raises(RowValidationError, match="not in allowed_media_domains"):
        load_image("https://images.example.com.evil.net/a.png", policy)
