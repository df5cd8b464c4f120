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
(:mod:`llmbatch.io.media`), as ``image_pil`` parts, so nothing is decoded twice.
"""

from __future__ import annotations

from typing import Any

from llmbatch.engines.vllm_setup import _import_vllm, one_line
from llmbatch.errors import ConfigError, RowValidationError
from llmbatch.models import resolve_model

class VllmChat:
    """Parses and renders conversations as ``vllm.LLM.chat`` does, for one model. Heavy state
    (the model config, the tokenizer) loads on first use, in the worker."""

    def __init__(self, model_source: str, engine_kwargs: dict[str, Any] | None = None,
                 model_config_kwargs: dict[str, Any] | None = None, content_format: str | None = None,
                 chat_template: str | None = None, system_as_text: bool = False):
        self.model_source = model_source
        # the engine's own arguments, media options included: vLLM reads the audio and video
        # parts it is handed (images arrive decoded) under the same allowed path and hosts
        self.engine_kwargs = dict(engine_kwargs or {})
        self.model_config_kwargs = dict(model_config_kwargs or {})
        self.given_format = content_format or "auto"
        self.chat_template = chat_template
        #: Ray's ``apply_sys_msg_formatting``: system messages stay plain strings (text parts
        #: joined), outside vLLM's content formatting, for templates that want string system
        #: prompts
        self.system_as_text = system_as_text
        self.model_config = None
        self.tokenizer = None
        self.content_format = None

    def __getstate__(self):
        return {**self.__dict__, "model_config": None, "tokenizer": None, "content_format": None}

    def setup(self) -> None:
        if self.model_config is not None:
            return
        vllm = _import_vllm()
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
        if self.system_as_text:
            system = [{**m, "content": _text_of(m.get("content"))} for m in messages if m.get("role") == "system"]
            messages = [m for m in messages if m.get("role") != "system"]
        try:
            conversation, mm_data, mm_uuids = parse_chat_messages(
                messages, self.model_config, content_format=self.content_format,
                mm_processor_kwargs=mm_processor_kwargs)
        except ValueError as exc:  # vLLM's validation errors (too many images, bad parts)
            raise RowValidationError(one_line(exc)) from exc
        return system + list(conversation), mm_data, mm_uuids

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
