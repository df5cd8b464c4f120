"""The chat template stage: ``messages`` -> ``prompt`` with the model's chat template.

Rows the multimodal stage prepared (their ``messages`` are vLLM's parsed conversation) are
rendered with vLLM's own template call (:class:`~llmbatch.engines.vllm_chat.VllmChat`), so
that the prompt is the one ``vllm.LLM.chat`` would build; other rows with the tokenizer's
``apply_chat_template``. A row whose content holds media while the multimodal stage is off
fails with the fix in its message.
"""

from __future__ import annotations

from typing import Any

from llmbatch.engines.vllm_chat import VllmChat
from llmbatch.errors import RowValidationError
from llmbatch.models import load_tokenizer
from llmbatch.rows import ADD_SPECIAL_TOKENS, MM_PARSED, Row, normalize_messages
from llmbatch.stages.base import Stage


class ChatTemplateStage(Stage):
    """Renders ``messages`` with the chat template into ``prompt``. Rows that already have a
    ``prompt`` and no ``messages`` pass through (their prompt is used as is)."""

    name = "chat_template"
    # a scoring pair (text_1/text_2, query/document) passes through: it has no chat
    required_any = (("messages", "prompt", "text_1", "query"),)

    def __init__(self, model_source: str, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False,
                 vllm_chat: VllmChat | None = None):
        super().__init__()
        self.model_source = model_source
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.trust_remote_code = trust_remote_code
        #: vLLM's chat path, when the multimodal stage runs (the same object it parses with)
        self.vllm_chat = vllm_chat
        self.tokenizer = None

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.model_source, self.trust_remote_code)

    def process_row(self, row: Row) -> None:
        if row.get("messages") is None:
            row.setdefault(ADD_SPECIAL_TOKENS, True)
            return
        kwargs = {**self.chat_template_kwargs, **(row.get("chat_template_kwargs") or {})}
        if row.get(MM_PARSED) and self.vllm_chat is not None:
            conversation = row["messages"]
            continue_final = conversation[-1]["role"] == "assistant"
            row["prompt"] = self.vllm_chat.render(conversation, self.chat_template,
                                                  add_generation_prompt=not continue_final,
                                                  continue_final_message=continue_final, **kwargs)
            row[ADD_SPECIAL_TOKENS] = False
            return
        messages = normalize_messages(row["messages"])
        media = [p.get("type") for m in messages if isinstance(m["content"], list) for p in m["content"]]
        if media:
            raise RowValidationError(
                f"the messages hold {media[0]!r} parts, which need the multimodal stage: set "
                "prepare_multimodal_stage={'enabled': True} (or has_image=True in older code)")
        continue_final = messages[-1]["role"] == "assistant"
        prompt = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            chat_template=self.chat_template,
            **kwargs,
        )
        row["prompt"] = prompt
        row[ADD_SPECIAL_TOKENS] = False
