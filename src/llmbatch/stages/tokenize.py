"""The tokenize stage: ``prompt`` -> ``tokenized_prompt``, and the length check.

Tokenizing here (a CPU stage, batched) keeps the engine replica's front-end free for
scheduling; the engine then receives token ids. A prompt that cannot fit in ``max_model_len``
with at least one generated token becomes an error row here, before it can fail an engine
batch.
"""

from __future__ import annotations

from llmbatch.errors import PromptTooLongError, RowValidationError
from llmbatch.rows import ADD_SPECIAL_TOKENS, Row
from llmbatch.stages.base import Stage
from llmbatch.models import load_tokenizer


class TokenizeStage(Stage):
    """Tokenizes ``prompt``. Templated prompts get no extra special tokens (the template has
    them); raw prompts get the tokenizer's (as vLLM does for a text prompt)."""

    name = "tokenize"
    required_keys = ("prompt",)

    def __init__(self, model_source: str, max_model_len: int | None = None, trust_remote_code: bool = False,
                 continue_on_error: bool = False):
        super().__init__(continue_on_error)
        self.model_source = model_source
        self.max_model_len = max_model_len
        self.trust_remote_code = trust_remote_code
        self.tokenizer = None

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.model_source, self.trust_remote_code)

    def check_prompt(self, row: Row) -> None:
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            raise RowValidationError(f"'prompt' must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise RowValidationError("'prompt' is empty; give some text or messages")

    def check_length(self, row: Row, ids: list[int]) -> None:
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens and max_model_len is {self.max_model_len}, leaving no room "
                f"to generate; shorten the prompt or raise engine_kwargs.max_model_len"
            )

    def process_batch(self, rows: list[Row]) -> None:
        good: dict[bool, list[Row]] = {True: [], False: []}
        for row in rows:
            try:
                self.check_prompt(row)
            except RowValidationError as exc:
                self.fail(row, exc)
                continue
            good[bool(row.get(ADD_SPECIAL_TOKENS, True))].append(row)
        for special, group in good.items():
            if not group:
                continue
            try:
                encoded = self.tokenizer([r["prompt"] for r in group], add_special_tokens=special)["input_ids"]
            except Exception:  # noqa: BLE001 - fall back to one row at a time to find the bad one
                encoded = None
            for i, row in enumerate(group):
                try:
                    ids = encoded[i] if encoded is not None else self.tokenizer(
                        row["prompt"], add_special_tokens=special)["input_ids"]
                    self.check_length(row, ids)
                    row["tokenized_prompt"] = list(ids)
                except Exception as exc:  # noqa: BLE001
                    self.fail(row, exc)
