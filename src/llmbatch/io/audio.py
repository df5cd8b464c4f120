"""Reading audio named by row data, decoded once, with bounded memory, into what vLLM's own
chat path makes of an audio part: a ``(waveform, sampling_rate)`` pair.

Audio comes as encoded bytes (WAV, FLAC, OGG, MP3: what the decoder reads), a data URL, an
http(s) URL, a ``file://`` URL or a local path (read by :mod:`llmbatch.io.media` under the same
:class:`~llmbatch.io.media.MediaPolicy` as images: size cap, timeouts and retries, allowed
paths and hosts), as OpenAI's ``input_audio`` (``{"data": base64, "format": "wav"}``), or
already decoded: a numpy array with its sampling rate (``(array, rate)`` or ``{"array",
"sampling_rate"}``, as Hugging Face datasets hold audio).

Encoded audio is decoded with vLLM's own loaders and limits (``vllm.multimodal.media.audio``:
torchcodec where it imports, else soundfile, else PyAV; ``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``,
``VLLM_MAX_AUDIO_DECODE_DURATION_S``), so the waveform is the one ``LLM.chat`` would get, and
resampling to the model's rate stays with the engine, as in vLLM.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from llmbatch.errors import MissingDependencyError, RowValidationError
from llmbatch.io.media import MediaPolicy, media_bytes, media_key

#: What installs an audio decoder for vLLM's loaders.
AUDIO_EXTRA = "pip install 'llmbatch[audio]' (or: pip install soundfile)"
#: libsndfile's codes for "this is no format it knows" (vLLM then tries PyAV, as here).
_UNKNOWN_FORMAT_CODES = {0, 1, 3, 4}


def _numpy():
    import numpy as np

    return np


def _rate(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise RowValidationError(f"{where}: the sampling rate must be a positive number of Hz, got {value!r}")
    return value


def decoded_audio(array: Any, rate: Any, policy: MediaPolicy) -> tuple[Any, float]:
    """A waveform given decoded, checked: float samples, 1-D (or channels x samples), a rate."""
    np = _numpy()
    rate = _rate(rate, "the audio")
    if not isinstance(array, np.ndarray) or array.dtype == object:  # a list, or Arrow's nested values
        try:
            array = np.asarray(array.tolist() if isinstance(array, np.ndarray) else array, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise RowValidationError(f"the audio array is not a list of numbers: {exc}") from exc
    if array.dtype.kind != "f":
        raise RowValidationError(f"the audio array holds {array.dtype} samples; give float samples in [-1, 1] "
                                 "(e.g. int16 PCM / 32768)")
    if array.ndim not in (1, 2) or array.size == 0:
        raise RowValidationError(f"the audio array must be 1-D (samples) or 2-D (channels x samples) and not "
                                 f"empty; got shape {array.shape}")
    if array.nbytes > policy.max_bytes:
        raise policy.too_big(array.nbytes, f"the audio array ({array.shape}, {array.dtype})")
    return array, rate


def _loaders():
    try:
        from vllm import envs
        from vllm.multimodal.media import audio as vllm_audio
    except ImportError as exc:  # pragma: no cover - the multimodal stage runs beside vLLM
        raise MissingDependencyError("audio in messages", "vllm") from exc
    return envs, vllm_audio


def decode_audio(data: bytes, policy: MediaPolicy) -> tuple[Any, float]:
    """``(waveform, native rate)`` of encoded audio, as vLLM's ``AudioMediaIO`` decodes it."""
    envs, vllm_audio = _loaders()
    vllm_cap = int(envs.VLLM_MAX_AUDIO_CLIP_FILESIZE_MB * (1 << 20))
    if len(data) > vllm_cap:
        raise RowValidationError(f"the audio is {len(data)} bytes, over vLLM's cap of {vllm_cap} bytes per clip "
                                 "(raise VLLM_MAX_AUDIO_CLIP_FILESIZE_MB in the environment)")
    limits = {"sr": None, "max_duration_s": envs.VLLM_MAX_AUDIO_DECODE_DURATION_S,
              "max_decode_bytes": min(policy.max_bytes, envs.VLLM_MAX_AUDIO_DECODE_BYTES)}
    # vLLM's "auto" order (torchcodec, soundfile, PyAV), without its warning on every clip
    order = (["torchcodec"] if vllm_audio.AudioDecoder is not None else []) + ["soundfile", "pyav"]
    missing: ImportError | None = None
    for backend in order:
        try:
            return vllm_audio.load_audio(io.BytesIO(data), backend=backend, **limits)
        except ImportError as exc:
            missing = missing or exc
        except ValueError as exc:
            if "VLLM_MAX_AUDIO_DECODE_BYTES" in str(exc) and policy.max_bytes < envs.VLLM_MAX_AUDIO_DECODE_BYTES:
                raise RowValidationError(f"the decoded audio would be over the cap of {policy.max_bytes} bytes per "
                                         "media item (prepare_multimodal_stage.max_item_bytes)") from exc
            raise RowValidationError(f"the audio is not decodable audio ({exc})") from exc
        except Exception as exc:  # decoders raise their own types (LibsndfileError...): re-raised as the row's
            if backend == "soundfile" and getattr(exc, "code", None) in _UNKNOWN_FORMAT_CODES:
                continue  # a format libsndfile does not know: PyAV may
            raise RowValidationError(f"the audio is not decodable audio ({type(exc).__name__}: {exc})") from exc
    if missing is not None and not _has_decoder():
        raise MissingDependencyError("audio in messages", "soundfile", AUDIO_EXTRA) from missing
    raise RowValidationError("the audio is not decodable audio (no decoder here reads its format; "
                             "WAV, FLAC, OGG and MP3 need soundfile, other formats PyAV: pip install av)")


def _has_decoder() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("soundfile", "av", "torchcodec"))


def _b64(text: Any, where: str) -> bytes:
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    if not isinstance(text, str):
        raise RowValidationError(f"{where} must be base64 text (or bytes), got {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RowValidationError(f"{where} is not valid base64: {exc}") from exc


def input_audio_bytes(value: Any, policy: MediaPolicy) -> bytes:
    """The encoded bytes of OpenAI's ``input_audio`` payload ``{"data": base64, "format": ...}``."""
    if not isinstance(value, dict) or "data" not in value:
        raise RowValidationError("an 'input_audio' part takes {'data': <base64 audio>, 'format': 'wav'|'mp3'|...}; "
                                 f"got {type(value).__name__ if not isinstance(value, dict) else sorted(value)}")
    unknown = sorted(k for k in value if k not in ("data", "format"))
    if unknown:
        raise RowValidationError(f"input_audio has unknown key {unknown[0]!r}; it takes 'data' and 'format'")
    data = value["data"]
    if isinstance(data, str) and len(data) * 3 // 4 > policy.max_bytes:
        raise policy.too_big(len(data) * 3 // 4, "the input_audio data")
    data = _b64(data, "input_audio.data")
    if len(data) > policy.max_bytes:
        raise policy.too_big(len(data), "the input_audio data")
    return data


def load_audio(value: Any, policy: MediaPolicy | None = None, *, openai_input: bool = False) -> tuple[Any, float]:
    """``(waveform, rate)`` from any accepted form (see the module's doc)."""
    policy = policy or MediaPolicy()
    np = _numpy()
    if openai_input:
        return decode_audio(input_audio_bytes(value, policy), policy)
    if isinstance(value, dict) and "array" in value:
        return decoded_audio(value["array"], value.get("sampling_rate"), policy)
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], (np.ndarray, list, tuple)):
        return decoded_audio(value[0], value[1], policy)
    if isinstance(value, np.ndarray):
        raise RowValidationError("an audio array needs its sampling rate: give (array, rate) or "
                                 "{'array': array, 'sampling_rate': rate}")
    return decode_audio(media_bytes(value, policy, "audio"), policy)


def audio_key(source: Any, audio: tuple[Any, float]) -> bytes:
    """What identifies a clip within a run (:func:`~llmbatch.io.media.media_key`): its encoded
    bytes, or the URL or path that named it, or its samples and rate when it was given decoded
    (a dict with an ``array``: its samples, whatever path it names)."""
    array, rate = audio
    keys = () if isinstance(source, dict) and "array" in source else ("data", "bytes", "url", "path")
    return media_key(source, keys, lambda: (f"a{array.dtype}{array.shape}{rate}",
                                            _numpy().ascontiguousarray(array).tobytes()))
