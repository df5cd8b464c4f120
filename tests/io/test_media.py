"""Media named by row data: read only where the user allows it, capped, fetched with
timeouts and retries, decoded once."""

from __future__ import annotations

import base64
import io
import socket
import time

import pytest

from llmbatch.errors import RowValidationError
from llmbatch.io.media import MediaPolicy, load_image, media_bytes


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_accepted_form_decodes_to_the_same_rgb_image(tmp_path):
    from PIL import Image

    data = png_bytes()
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    forms = [data, bytearray(data), url, str(path), f"file://{path}", {"bytes": data}, {"path": str(path)},
             Image.open(io.BytesIO(data)).convert("RGBA")]
    for form in forms:
        image = load_image(form)
        assert (image.mode, image.size, image.getpixel((0, 0))) == ("RGB", (4, 4), (255, 0, 0)), form


def test_an_item_over_the_cap_is_refused_before_decoding(tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 2048)
    policy = MediaPolicy(max_bytes=1024)
    for value in (str(big), b"x" * 2048, "data:image/png;base64," + base64.b64encode(b"x" * 2048).decode()):
        with pytest.raises(RowValidationError, match="over the cap of 1024 bytes"):
            media_bytes(value, policy)
    from PIL import Image

    with pytest.raises(RowValidationError, match="over the cap"):
        load_image(Image.new("RGB", (100, 100)), policy)  # 30,000 RGB bytes


def test_an_unreachable_url_fails_after_its_retries_with_the_reason():
    policy = MediaPolicy(timeout_s=1, retries=2)
    start = time.monotonic()
    with pytest.raises(RowValidationError, match=r"could not fetch media URL .* after 3 tries.*Connection refused"):
        load_image(f"http://127.0.0.1:{free_port()}/a.png", policy)
    assert time.monotonic() - start < 5


def test_undecodable_bytes_and_unknown_schemes_are_row_errors():
    with pytest.raises(RowValidationError, match="not a decodable image"):
        load_image(b"not an image at all")
    with pytest.raises(RowValidationError, match="unsupported image URL scheme"):
        load_image("ftp://example.com/a.png")
    with pytest.raises(RowValidationError, match="cannot read media file"):
        load_image("/nonexistent/a.png")


def test_images_and_clips_share_one_media_key():
    """``media_key`` identifies images and audio alike (its values are stable: a job's answer
    records hold request digests that include them)."""
    import numpy as np
    from PIL import Image

    from llmbatch.io.audio import audio_key
    from llmbatch.io.media import image_key

    img = Image.new("RGB", (4, 3), (1, 2, 3))
    clip = (np.arange(10, dtype=np.float32), 16000)
    assert image_key(b"abc", img) == audio_key(b"abc", clip) == bytes.fromhex("6c90e3902a69d1614408fd279ad6460d")
    assert image_key({"url": "u", "bytes": None}, img) == audio_key({"url": "u"}, clip)
    assert image_key(None, img) == image_key({"x": 1}, Image.new("RGB", (4, 3), (1, 2, 3)))
    assert image_key(None, img) != image_key(None, Image.new("RGB", (4, 3), (1, 2, 4)))
    assert audio_key({"array": clip[0], "path": "p"}, clip) == audio_key(None, clip) != audio_key("p", clip)
