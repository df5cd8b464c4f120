"""Seeded sample audio clips: tones, chords and chirps, a few corrupt files among them.

The same ``seed`` gives the same samples and bytes on every machine (numpy's seeded generator,
WAV written with the standard library's ``wave``: no audio package needed to make them). Used
by the audio tests and examples; corrupt items (a truncated WAV, bytes that are no audio)
exercise the error rows.
"""

from __future__ import annotations

import io
import os
import wave
from pathlib import Path
from typing import Any

import numpy as np

from llmbatch.sample_images import write_items

NOTES = {"A3": 220.0, "C4": 261.63, "E4": 329.63, "G4": 392.0, "A4": 440.0, "C5": 523.25, "E5": 659.26}
KINDS = ["tone", "chord", "chirp", "beeps"]


def synth_clip(rng: np.random.Generator, rate: int = 16000,
               seconds: tuple[float, float] = (0.5, 2.0)) -> tuple[np.ndarray, str]:
    """One mono float32 clip in [-1, 1] and its description."""
    duration = float(rng.uniform(*seconds))
    t = np.arange(int(duration * rate)) / rate
    kind = KINDS[int(rng.integers(len(KINDS)))]
    names = list(NOTES)
    if kind == "tone":
        note = names[int(rng.integers(len(names)))]
        wave_ = np.sin(2 * np.pi * NOTES[note] * t)
        what = f"a {note} tone"
    elif kind == "chord":
        chosen = [names[int(i)] for i in rng.choice(len(names), size=3, replace=False)]
        wave_ = sum(np.sin(2 * np.pi * NOTES[n] * t) for n in chosen) / 3
        what = f"a chord of {', '.join(chosen)}"
    elif kind == "chirp":
        f0, f1 = sorted(float(f) for f in rng.uniform(150, 2000, size=2))
        wave_ = np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * duration)))
        what = f"a chirp from {f0:.0f} Hz to {f1:.0f} Hz"
    else:
        freq, count = float(rng.uniform(300, 1200)), int(rng.integers(2, 5))
        gate = (np.floor(t * count * 2 / duration) % 2 == 0)
        wave_ = np.sin(2 * np.pi * freq * t) * gate
        what = f"{count} beeps at {freq:.0f} Hz"
    noise = rng.normal(0, 0.01, size=t.shape)
    clip = (0.6 * wave_ + noise).clip(-1, 1).astype(np.float32)
    return clip, f"{what}, {duration:.2f} s"


def encode_wav(clip: np.ndarray, rate: int = 16000) -> bytes:
    """16-bit PCM mono WAV bytes of a float clip in [-1, 1]."""
    pcm = (np.clip(clip, -1, 1) * 32767).round().astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buf.getvalue()


def pcm16(clip: np.ndarray) -> np.ndarray:
    """The clip as a WAV holds it: rounded to 16 bits, back as float32 (what a decoder reads)."""
    return ((np.clip(clip, -1, 1) * 32767).round().astype(np.int16) / 32768).astype(np.float32)


def sample_audio(n: int, seed: int = 0, corrupt: int = 0, rate: int = 16000) -> list[dict[str, Any]]:
    """``n`` items ``{"name", "audio" (WAV bytes), "array" (float32, as decoded), "sampling_rate",
    "description", "corrupt"}``; ``corrupt`` of them (at seeded places) are not decodable: a
    truncated WAV header, then bytes that are no audio."""
    rng = np.random.default_rng(seed)
    bad = {int(i) for i in rng.choice(n, size=min(corrupt, n), replace=False)} if corrupt else set()
    out = []
    for i in range(n):
        clip, description = synth_clip(rng, rate)
        data = encode_wav(clip, rate)
        if i in bad:
            data = data[:30] if len(out) % 2 == 0 else b"RIFF but not really a sound " * 4
            description = "(corrupt)"
        out.append({"name": f"clip_{i:05d}.wav", "audio": data, "array": pcm16(clip), "sampling_rate": rate,
                    "description": description, "corrupt": i in bad})
    return out


def write_audio_folder(folder: str | os.PathLike, n: int, seed: int = 0, corrupt: int = 0) -> list[Path]:
    """The sample clips as WAV files in ``folder`` (created); returns their paths."""
    return write_items(folder, sample_audio(n, seed, corrupt), "audio")
