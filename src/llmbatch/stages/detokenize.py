"""The detokenize stage: ``generated_tokens`` -> ``generated_text`` where the engine left the
text out (requests made with ``detokenize=False``)."""

from __future__ import annotations

from llmbatch.models import load_tokenizer
from llmbatch.rows import Row
from llmbatch.stages.base import Stage


class DetokenizeStage(Stage):
    name = "detokenize"

    def __init__(self, model_source: str, trust_remote_code: bool = False):
        super().__init__()
        self.model_source = model_source
        self.trust_remote_code = trust_remote_code
        self.tokenizer = None

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.model_source, self.trust_remote_code)

    def process_batch(self, rows: list[Row]) -> None:
        todo = [r for r in rows if r.get("generated_tokens") and not r.get("generated_text")]
        if not todo:
            return
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.model_source, self.trust_remote_code)
        try:
            texts = self.tokenizer.batch_decode([r["generated_tokens"] for r in todo], skip_special_tokens=True)
        except Exception:  # noqa: BLE001 - find the row that fails
            texts = None
        for i, row in enumerate(todo):
            try:
                row["generated_text"] = texts[i] if texts is not None else self.tokenizer.decode(
                    row["generated_tokens"], skip_special_tokens=True)
            except Exception as exc:  # noqa: BLE001
                self.fail(row, exc)
