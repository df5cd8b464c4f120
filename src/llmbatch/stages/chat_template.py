"""The chat template stage: ``messages`` -> ``prompt`` with the model's chat template."""

from __future__ import annotations

from typing import Any

from llmbatch.models import load_tokenizer
from llmbatch.rows import ADD_SPECIAL_TOKENS, Row, normalize_messages
from llmbatch.stages.base import Stage


class ChatTemplateStage(Stage):
    """Renders ``messages`` with the chat template into ``prompt``. Rows that already have a
    ``prompt`` and no ``messages`` pass through (their prompt is used as is)."""

    name = "chat_template"
    # a scoring pair (text_1/text_2, query/document) passes through: it has no chat
    required_any = (("messages", "prompt", "text_1", "query"),)

    def __init__(self, model_source: str, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False):
        super().__init__()
        self.model_source = model_source
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.trust_remote_code = trust_remote_code
        self.tokenizer = None

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.model_source, self.trust_remote_code)

    def process_row(self, row: Row) -> None:
        if row.get("messages") is None:
            row.setdefault(ADD_SPECIAL_TOKENS, True)
            return
        messages = normalize_messages(row["messages"])
        kwargs = {**self.chat_template_kwargs, **(row.get("chat_template_kwargs") or {})}
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
