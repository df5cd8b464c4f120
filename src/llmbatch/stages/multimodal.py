"""The multimodal stage: media in ``messages`` -> the conversation and ``multimodal_data`` that
vLLM's own chat path (``LLM.chat``) would make of them.

Content parts, in OpenAI's form and Ray's, several per message and per row:

- ``{"type": "text", "text": ...}`` (or ``input_text``), or plain string content;
- ``{"type": "image", "image": X}`` (Ray's form), ``{"type": "image_url", "image_url":
  {"url": X}}`` (OpenAI's), ``{"type": "input_image", "image_url": X}``, ``{"type":
  "image_pil", "image_pil": X}``, where X is a PIL image, bytes, a data URL, an http(s) URL, a
  ``file://`` URL or a local path (or a ``{"bytes"|"path"|"url": ...}`` dict);
- ``{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}`` (OpenAI's),
  ``{"type": "audio_url", "audio_url": {"url": X}}``, ``{"type": "audio", "audio": X}`` (Ray's
  form), where X is bytes, a data URL, an http(s) URL, a ``file://`` URL, a local path, or a
  decoded clip: ``(array, sampling_rate)`` or ``{"array": ..., "sampling_rate": ...}``;
- ``video_url`` parts go to vLLM as they are (after the URL policy check), and vLLM reads them.

Every image and every clip is decoded here once (:mod:`llmbatch.io.media`,
:mod:`llmbatch.io.audio`: a size cap per item, URL timeouts and retries, the allowed paths and
hosts) and handed on decoded: an image as an ``image_pil`` part, a clip as an ``audio`` part
holding ``(waveform, rate)``, which :class:`~llmbatch.engines.vllm_chat.VllmChat` gives vLLM's
parser in place of the one vLLM would have read. A part with an
unknown type or key is an error row that names it; nothing is dropped silently. Each row gets
a digest of its media, so that rows with the same text and different images are different
requests (dedup) and rows with the same images run together (prefix order).
"""

from __future__ import annotations

import hashlib
from typing import Any

from llmbatch.engines.vllm_chat import VllmChat
from llmbatch.errors import RowValidationError
from llmbatch.io.audio import audio_key, load_audio
from llmbatch.io.media import MediaPolicy, image_key, load_image
from llmbatch.rows import MEDIA_DIGEST, MM_PARSED, ROLES, Row, normalize_messages
from llmbatch.stages.base import Stage

__all__ = ["MediaPolicy", "PrepareMultimodalStage", "load_audio", "load_image", "prepare_messages"]

#: Part type -> (the key holding its payload, other keys it may have).
PART_KEYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "text": ("text", ()),
    "input_text": ("text", ()),
    "image": ("image", ()),
    "image_url": ("image_url", ("detail",)),
    "input_image": ("image_url", ("detail", "file_id")),
    "image_pil": ("image_pil", ()),
    "audio": ("audio", ()),
    "audio_url": ("audio_url", ()),
    "input_audio": ("input_audio", ()),
    "video_url": ("video_url", ()),
    # passed to vLLM's parser as they are: assistant turns, and precomputed embeddings
    "output_text": ("text", ()),
    "refusal": ("refusal", ()),
    "thinking": ("thinking", ()),
    "image_embeds": ("image_embeds", ()),
    "audio_embeds": ("audio_embeds", ()),
    "video_embeds": ("video_embeds", ()),
}
IMAGE_PART_TYPES = ("image", "image_url", "input_image", "image_pil")
AUDIO_PART_TYPES = ("audio", "audio_url", "input_audio")
#: Message keys OpenAI's chat format has (others are typos, and errors).
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content",
                          "refusal", "function_call"})


def _url_of(value: Any) -> Any:
    return value.get("url") if isinstance(value, dict) and "url" in value else value


def _check_part(part: Any, where: str) -> tuple[str, Any]:
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        raise RowValidationError(f"{where} must be a dict with a 'type', got {type(part).__name__}")
    kind = part.get("type")
    if kind not in PART_KEYS:
        known = ", ".join(PART_KEYS)
        guess = next((k for k in PART_KEYS if k in part), None)
        hint = f" (it has a {guess!r} key: type {guess!r}?)" if guess else ""
        raise RowValidationError(f"{where} has unknown content part type {kind!r}{hint}; known types: {known}")
    payload, extra = PART_KEYS[kind]
    for key in part:
        if key not in ("type", "uuid", payload, *extra):
            raise RowValidationError(f"{where} (type {kind!r}) has unknown key {key!r}; a {kind!r} part takes "
                                     f"{payload!r}" + (f" (and {', '.join(map(repr, extra))})" if extra else ""))
    if part.get(payload) is None:
        raise RowValidationError(f"{where} (type {kind!r}) has no {payload!r}")
    return kind, part[payload]


def prepare_messages(messages: Any, policy: MediaPolicy) -> tuple[list[dict[str, Any]], str | None]:
    """``messages`` checked, with every image decoded into an ``image_pil`` part (vLLM's form
    for a decoded image) and every clip into an ``audio`` part holding ``(waveform, rate)``, and
    a digest of the row's media (None without media)."""
    normalize_messages(messages)  # the shape checks every row's messages get (roles, content)
    digest = hashlib.blake2b(digest_size=16)
    media = 0
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RowValidationError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(msg).__name__}")
        if msg.get("role") not in ROLES:
            raise RowValidationError(f"messages[{i}] has role {msg.get('role')!r}; use one of {', '.join(ROLES)}")
        unknown = sorted(k for k in msg if k not in MESSAGE_KEYS)
        if unknown:
            raise RowValidationError(f"messages[{i}] has unknown key {unknown[0]!r}; media go in 'content' as parts")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            out.append(dict(msg))
            continue
        if not isinstance(content, (list, tuple)):
            raise RowValidationError(f"messages[{i}].content must be a string or a list of parts, "
                                     f"got {type(content).__name__}")
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind, value = _check_part(part, where)
            if kind in IMAGE_PART_TYPES:
                try:
                    image = load_image(_url_of(value), policy)
                except RowValidationError as exc:
                    raise RowValidationError(f"{where}: {exc}") from None
                uuid = part.get("uuid")
                digest.update(str(uuid).encode() if uuid is not None else image_key(_url_of(value), image))
                media += 1
                parts.append({"type": "image_pil", "image_pil": image, **({"uuid": uuid} if uuid is not None else {})})
            elif kind in AUDIO_PART_TYPES:
                source = value if kind == "input_audio" else _url_of(value)
                try:
                    audio = load_audio(source, policy, openai_input=kind == "input_audio")
                except RowValidationError as exc:
                    raise RowValidationError(f"{where}: {exc}") from None
                uuid = part.get("uuid")
                digest.update(str(uuid).encode() if uuid is not None else audio_key(source, audio))
                media += 1
                parts.append({"type": "audio", "audio": audio, **({"uuid": uuid} if uuid is not None else {})})
            elif kind in ("video_url", "image_embeds", "audio_embeds", "video_embeds"):
                policy.check_engine_url(_url_of(value))
                digest.update(repr(part).encode())
                media += 1
                parts.append(dict(part))
            else:
                parts.append(part if isinstance(part, dict) else {"type": "text", "text": part})
        out.append({**msg, "content": parts})
    return out, (digest.hexdigest() if media else None)


class PrepareMultimodalStage(Stage):
    """Decodes the media of ``messages`` and parses them with vLLM's chat parser: ``messages``
    becomes the parsed conversation (the model's placeholders in place), ``multimodal_data``
    and ``multimodal_uuids`` what the engine needs beside the prompt."""

    name = "prepare_multimodal"

    def __init__(self, chat: VllmChat, policy: MediaPolicy | None = None):
        super().__init__()
        self.chat = chat
        self.policy = policy or MediaPolicy()

    def setup(self) -> None:
        self.chat.setup()

    def begin(self) -> None:
        self.chat.preload()

    async def start(self) -> None:
        """vLLM's model config and tokenizer load with the replica, before its first row (a
        model vLLM cannot make a config for fails the replica at once, with the reason)."""
        self.ensure_setup()

    def process_row(self, row: Row) -> None:
        if row.get("messages") is None:
            return  # a prompt row: nothing to parse
        messages, digest = prepare_messages(row["messages"], self.policy)
        conversation, mm_data, mm_uuids = self.chat.parse(messages, row.get("mm_processor_kwargs"))
        row["messages"] = conversation
        row[MM_PARSED] = True
        if mm_data:
            row["multimodal_data"] = mm_data
            row["multimodal_uuids"] = mm_uuids
            row[MEDIA_DIGEST] = digest
