"""The chat template stage: ``messages`` -> ``prompt`` with the model's chat template."""

from __future__ import annotations

from typing import Any

from llmbatch.errors import RowValidationError
from llmbatch.rows import ADD_SPECIAL_TOKENS, Row
from llmbatch.stages.base import Stage
from llmbatch.models import load_tokenizer

ROLES = ("system", "user", "assistant", "tool", "developer", "function")
TEXT_PART_TYPES = ("text", "input_text")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the shape of OpenAI-style ``messages`` and flatten text-only part lists.

    Raises :class:`RowValidationError` naming the message and the problem.
    """
    if isinstance(messages, dict):
        raise RowValidationError("'messages' must be a list of {'role', 'content'} dicts, not one dict; wrap it in a list")
    if not isinstance(messages, (list, tuple)):
        raise RowValidationError(f"'messages' must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise RowValidationError("'messages' is empty; give at least one message")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RowValidationError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise RowValidationError(f"messages[{i}] has role {role!r}; use one of {', '.join(ROLES)}")
        if "content" not in msg:
            raise RowValidationError(f"messages[{i}] has no 'content'")
        content = msg["content"]
        if isinstance(content, (list, tuple)):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or "type" not in part:
                    raise RowValidationError(f"messages[{i}].content[{j}] must be a dict with a 'type'")
                parts.append(part)
            if all(p["type"] in TEXT_PART_TYPES for p in parts):
                content = "\n".join(str(p.get("text", "")) for p in parts)
            else:
                content = parts
        elif content is None:
            if role != "assistant":
                raise RowValidationError(f"messages[{i}] ({role}) has no content")
        elif not isinstance(content, str):
            raise RowValidationError(f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}")
        out.append({**msg, "content": content})
    return out


class ChatTemplateStage(Stage):
    """Renders ``messages`` with the chat template into ``prompt``. Rows that already have a
    ``prompt`` and no ``messages`` pass through (their prompt is used as is)."""

    name = "chat_template"
    required_any = (("messages", "prompt"),)

    def __init__(self, model_source: str, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False,
                 continue_on_error: bool = False):
        super().__init__(continue_on_error)
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
