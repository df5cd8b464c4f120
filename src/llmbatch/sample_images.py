"""Seeded sample images: PIL-drawn shapes and text, a few corrupt files among them.

The same ``seed`` gives the same bytes on every machine (PIL's default font, no randomness
outside ``random.Random(seed)``). Used by the tests, the vision examples and the multimodal
benchmark; corrupt items (a truncated PNG, bytes that are no image) exercise the error rows.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import Any

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black", "cyan", "magenta"]
SHAPES = ["circle", "square", "triangle", "cross"]


def draw_image(rng: random.Random, size: tuple[int, int] | None = None):
    """One PIL image: a background, two to four shapes, a word; and its description."""
    from PIL import Image, ImageDraw

    w, h = size or (rng.randint(48, 320), rng.randint(48, 320))
    background = rng.choice(COLORS)
    image = Image.new("RGB", (w, h), background)
    draw = ImageDraw.Draw(image)
    drawn = []
    for _ in range(rng.randint(2, 4)):
        shape, color = rng.choice(SHAPES), rng.choice(COLORS)
        x0, y0 = rng.randint(0, w - 8), rng.randint(0, h - 8)
        x1, y1 = rng.randint(x0 + 4, w), rng.randint(y0 + 4, h)
        if shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=color)
        elif shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=color)
        elif shape == "triangle":
            draw.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=color)
        else:
            draw.line((x0, y0, x1, y1), fill=color, width=3)
            draw.line((x0, y1, x1, y0), fill=color, width=3)
        drawn.append(f"a {color} {shape}")
    word = rng.choice(["cat", "sun", "tree", "boat", "llm", "ray"])
    draw.text((2, 2), word, fill=rng.choice(COLORS))
    return image, f"{', '.join(drawn)} on {background}, with the word '{word}'"


def encode(image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def sample_images(n: int, seed: int = 0, corrupt: int = 0, size: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """``n`` items ``{"name", "image" (bytes), "description", "corrupt"}``; ``corrupt`` of them
    (at seeded places) are not decodable: a truncated PNG, then bytes that are no image."""
    rng = random.Random(seed)
    bad = set(rng.sample(range(n), min(corrupt, n)))
    out = []
    for i in range(n):
        image, description = draw_image(rng, size)
        fmt = "JPEG" if i % 3 == 2 else "PNG"
        data = encode(image, fmt)
        if i in bad:
            data = data[: len(data) // 3] if len(out) % 2 == 0 else b"GIF89a but not really an image" * 4
            fmt, description = "PNG", "(corrupt)"
        out.append({"name": f"img_{i:05d}.{fmt.lower().replace('jpeg', 'jpg')}", "image": data,
                    "description": description, "corrupt": i in bad})
    return out


def write_image_folder(folder: str | os.PathLike, n: int, seed: int = 0, corrupt: int = 0) -> list[Path]:
    """The sample images as files in ``folder`` (created); returns their paths."""
    return write_items(folder, sample_images(n, seed, corrupt), "image")


def write_items(folder: str | os.PathLike, items: list[dict], key: str) -> list[Path]:
    """Each item's ``key`` bytes as the file ``folder/item["name"]`` (folder created); the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for item in items:
        path = folder / item["name"]
        path.write_bytes(item[key])
        paths.append(path)
    return paths


def write_image_parquet(path: str | os.PathLike, n: int, seed: int = 0, corrupt: int = 0) -> Path:
    """The sample images as a Parquet file: ``id``, ``image`` (binary), ``description``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    items = sample_images(n, seed, corrupt)
    table = pa.table({"id": list(range(n)), "image": pa.array([it["image"] for it in items], type=pa.binary()),
                      "description": [it["description"] for it in items]})
    pq.write_table(table, path)
    return Path(path)
