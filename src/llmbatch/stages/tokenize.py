"""The tokenize stage: ``prompt`` -> ``tokenized_prompt``, and the length checks.

Tokenizing here (a CPU stage, batched) keeps the engine replica's front-end free for
scheduling; the engine then receives token ids. A prompt that cannot fit in ``max_model_len``
(with its ``max_tokens``, when it generates) becomes an error row here, before it can reach
the engine; a row that asks for ``truncate_prompt_tokens`` (in its sampling or pooling params)
is cut instead (``-1``: as much as needed). A scoring pair (``text_1``/``text_2`` or
``query``/``document``) becomes one input with token type ids for a cross-encoder, one input
per text for a bi-encoder.
"""

from __future__ import annotations

from typing import Any

from llmbatch.engines.settings import EngineKwargs, max_model_len
from llmbatch.engines.vllm_params import pair_tokens
from llmbatch.errors import PromptTooLongError, RowValidationError
from llmbatch.models import is_sequence_classifier, load_tokenizer, resolve_model
from llmbatch.rows import ADD_SPECIAL_TOKENS, DEFAULT_MAX_TOKENS, OPENAI, Row, text_pair
from llmbatch.stages.base import Stage
from llmbatch.stages.pieces import PieceEncoder


class TokenizeStage(Stage):
    """Tokenizes ``prompt`` (or a scoring pair). Templated prompts get no extra special tokens
    (the template has them); raw prompts get the tokenizer's (as vLLM does for a text prompt)."""

    name = "tokenize"
    required_any = (("prompt", "text_1", "query"),)

    def __init__(self, model_source: str, engine_kwargs: EngineKwargs | None = None, trust_remote_code: bool = False,
                 task: str = "generate", engine_model: str | None = None):
        super().__init__()
        self.model_source = model_source
        #: the engine's model and settings: its context length is this stage's limit (one number
        #: for both: engines.settings.max_model_len), whichever model's tokenizer this stage uses
        self.engine_model = engine_model or model_source
        self.engine_kwargs = EngineKwargs(engine_kwargs or {})
        self.max_model_len: int | None = None
        self.trust_remote_code = trust_remote_code
        self.task = task
        self.generate = task == "generate"
        self.cross_encoder = False
        self.tokenizer = None
        self.pieces: PieceEncoder | None = None

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.model_source, self.trust_remote_code)
        # templated prompts share most of their text: each distinct piece is encoded once
        self.pieces = PieceEncoder(self.tokenizer)
        path = resolve_model(self.model_source)
        self.max_model_len = max_model_len(self.engine_model, self.engine_kwargs)
        self.cross_encoder = self.task == "score" and is_sequence_classifier(path)

    def check_prompt(self, row: Row) -> None:
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise RowValidationError(f"'prompt' must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise RowValidationError("'prompt' is empty; give some text or messages")

    def _params(self, row: Row) -> tuple[str, dict[str, Any]]:
        key = "sampling_params" if self.generate else "pooling_params"
        params = row.get(key)
        return key, params if isinstance(params, dict) else {}

    def fit(self, row: Row, ids: list[int]) -> list[int]:
        """``ids`` checked (and, when the row asks, truncated) against max_model_len."""
        limit = self.max_model_len
        if limit is None:
            return ids
        key, params = self._params(row)
        wanted = 0
        if self.generate:
            wanted = params.get("max_tokens")
            if wanted is None:  # an OpenAI chat request without max_tokens generates up to the context
                wanted = 1 if (row.get(OPENAI) or {}).get("max_tokens_auto") else DEFAULT_MAX_TOKENS
            elif not isinstance(wanted, int) or isinstance(wanted, bool):
                wanted = 0  # a wrong type is reported by request validation
        room = limit - wanted if self.generate else limit  # a pooled input may fill the context
        truncate = params.get("truncate_prompt_tokens")
        if truncate is not None:
            row[key] = {k: v for k, v in params.items() if k != "truncate_prompt_tokens"}
            if not isinstance(truncate, int) or isinstance(truncate, bool) or (truncate < 1 and truncate != -1):
                raise RowValidationError("truncate_prompt_tokens must be a positive int, or -1 for 'as many as fit'")
            keep = room - (1 if self.generate and wanted == 0 else 0)
            if truncate != -1:
                keep = min(keep, truncate)
            if keep < 1:
                raise PromptTooLongError(f"max_tokens={wanted} leaves no room for a prompt in max_model_len={limit}")
            # a generated answer continues the end of the prompt; a pooled text keeps its start
            ids = ids[-keep:] if self.generate else ids[:keep]
        if self.generate and len(ids) >= limit:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens and max_model_len is {limit}, leaving no room to generate; "
                f"shorten the prompt, raise engine_kwargs.max_model_len, or set sampling_params.truncate_prompt_tokens")
        if self.generate and len(ids) + wanted > limit:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens and max_tokens is {wanted}: {len(ids) + wanted} > max_model_len "
                f"{limit}; lower max_tokens, raise engine_kwargs.max_model_len, or set truncate_prompt_tokens")
        if not self.generate and len(ids) > limit:
            raise PromptTooLongError(
                f"the text has {len(ids)} tokens and the model takes at most {limit} (max_model_len); shorten it, "
                f"or set pooling_params.truncate_prompt_tokens to cut it")
        return ids

    def _pair(self, row: Row, pair: tuple[str, str]) -> None:
        pair_tokens(row, pair, self.tokenizer, self.cross_encoder)
        row["tokenized_prompt"] = self.fit(row, row["tokenized_prompt"])
        if "token_type_ids" in row:
            row["token_type_ids"] = row["token_type_ids"][:len(row["tokenized_prompt"])]
        if row.get("tokenized_prompt_2") is not None:
            row["tokenized_prompt_2"] = self.fit(row, row["tokenized_prompt_2"])

    def process_batch(self, rows: list[Row]) -> None:
        good: dict[bool, list[Row]] = {True: [], False: []}
        for row in rows:
            try:
                pair = text_pair(row) if self.task == "score" else None
                if pair is not None:
                    self._pair(row, pair)
                    continue
                self.check_prompt(row)
            except Exception as exc:  # noqa: BLE001 - this row's error
                self.fail(row, exc)
                continue
            good[bool(row.get(ADD_SPECIAL_TOKENS, True))].append(row)
        for special, group in good.items():
            if not group:
                continue
            try:
                prompts = [r["prompt"] for r in group]
                if not special and self.pieces is not None:
                    encoded = self.pieces.encode(prompts)
                else:
                    encoded = self.tokenizer(prompts, add_special_tokens=special)["input_ids"]
            except Exception:  # noqa: BLE001 - fall back to one row at a time to find the bad one
                encoded = None
            for i, row in enumerate(group):
                try:
                    ids = encoded[i] if encoded is not None else self.tokenizer(
                        row["prompt"], add_special_tokens=special)["input_ids"]
                    row["tokenized_prompt"] = list(self.fit(row, list(ids)))
                except Exception as exc:  # noqa: BLE001
                    self.fail(row, exc)
