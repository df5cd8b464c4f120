"""Test models built offline and seeded, from the offline models' own weights.

No registry package ships a classifier, a cross-encoder or a LoRA adapter, so llmbatch builds
them (``llmbatch models make-test-models``): the weights of MiniLM and SmolLM2 with a seeded
random head or adapter. Their answers mean nothing; what they are for is exercising each task
end to end, against transformers and plain vLLM on the same weights.

- ``minilm-classifier``: BertForSequenceClassification, 3 labels (``negative``, ``neutral``,
  ``positive``), MiniLM's encoder with a seeded head;
- ``minilm-cross-encoder``: the same with 1 label: a cross-encoder for ``task_type="score"``;
- ``smollm2-reward``: LlamaForSequenceClassification, 1 label, SmolLM2 with a seeded head (a
  decoder reward model);
- ``smollm2-lora-a`` / ``-b`` / ``-c`` / ``-wide``: peft LoRA adapters for SmolLM2 with seeded
  weights (``init_lora_weights=False``) of rank 8, 16, 8 and 32.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from llmbatch.errors import MissingDependencyError
from llmbatch.models import cache_dir, prepare

CLASSIFIER_LABELS = ["negative", "neutral", "positive"]
LORA_ADAPTERS = {"smollm2-lora-a": (8, 11), "smollm2-lora-b": (16, 12), "smollm2-lora-c": (8, 13),
                 "smollm2-lora-wide": (32, 14)}  # name -> (rank, seed)


def _imports():
    try:
        import torch
        import transformers
    except ImportError as exc:  # pragma: no cover - both come with the engine
        raise MissingDependencyError("building test models", "torch transformers") from exc
    return torch, transformers


def _write_atomically(target: Path, build) -> Path:
    if (target / "config.json").exists() or (target / "adapter_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        build(work)
        if target.exists():
            shutil.rmtree(target)
        os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _copy_tokenizer(source: Path, out: Path) -> None:
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "chat_template")):
            shutil.copy(source / name, out / name)


def _bert_classifier(out: Path, num_labels: int, seed: int, labels: list[str]) -> None:
    torch, transformers = _imports()
    base = Path(prepare("all-minilm-l6-v2"))
    config = transformers.AutoConfig.from_pretrained(base)
    config.architectures = ["BertForSequenceClassification"]
    config.num_labels = num_labels
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification.from_pretrained(base, config=config)
    with torch.no_grad():
        model.classifier.weight.normal_(0, 0.5)
        model.classifier.bias.normal_(0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    _copy_tokenizer(base, out)


def _llama_reward(out: Path, seed: int) -> None:
    torch, transformers = _imports()
    base = Path(prepare("smollm2-135m-instruct"))
    config = transformers.AutoConfig.from_pretrained(base)
    config.architectures = ["LlamaForSequenceClassification"]
    config.num_labels = 1
    config.id2label = {0: "reward"}
    config.label2id = {"reward": 0}
    config.pad_token_id = config.eos_token_id
    torch.manual_seed(seed)
    model = transformers.LlamaForSequenceClassification.from_pretrained(base, config=config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    _copy_tokenizer(base, out)


def _lora(out: Path, rank: int, seed: int) -> None:
    torch, transformers = _imports()
    try:
        import peft
    except ImportError as exc:
        raise MissingDependencyError("building LoRA test adapters", "peft") from exc
    base = Path(prepare("smollm2-135m-instruct"))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                             init_lora_weights=False, lora_dropout=0.0)
    lora = peft.get_peft_model(model, config)
    with torch.no_grad():  # big enough to move greedy answers, seeded
        for name, param in lora.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.02)
    lora.save_pretrained(out)
    # vLLM reads the base model's name from here; point it at the local folder
    meta = json.loads((out / "adapter_config.json").read_text())
    meta["base_model_name_or_path"] = str(base)
    (out / "adapter_config.json").write_text(json.dumps(meta, indent=2))


def make_test_models(root: str | os.PathLike | None = None) -> dict[str, Path]:
    """Build every test model under ``root`` (default: the cache's ``test-models``) once;
    returns name -> folder. LoRA adapters share one folder (``loras``), the
    ``dynamic_lora_loading_path`` a processor takes."""
    root = Path(root) if root is not None else cache_dir() / "test-models"
    out = {
        "minilm-classifier": _write_atomically(root / "minilm-classifier",
                                               lambda d: _bert_classifier(d, 3, 0, CLASSIFIER_LABELS)),
        "minilm-cross-encoder": _write_atomically(root / "minilm-cross-encoder",
                                                  lambda d: _bert_classifier(d, 1, 1, ["score"])),
        "smollm2-reward": _write_atomically(root / "smollm2-reward", lambda d: _llama_reward(d, 2)),
    }
    for name, (rank, seed) in LORA_ADAPTERS.items():
        out[name] = _write_atomically(root / "loras" / name, lambda d, r=rank, s=seed: _lora(d, r, s))
    out["loras"] = root / "loras"
    return out
