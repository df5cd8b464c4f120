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
  weights (``init_lora_weights=False``) of rank 8, 16, 8 and 32;
- ``tiny-vlm``: an Idefics3 (SmolVLM-style) vision-language model with seeded random weights: a
  2-layer vision tower (64 px tiles of 16 px patches, 4 tokens per tile after the pixel
  shuffle), a 2-layer Llama (head_dim 64, which vLLM's CPU attention needs) on SmolLM2's
  tokenizer plus the image tokens, a processor that splits images up to 128 px into tiles.
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


#: The tiny VLM's chat template (SmolVLM's layout; string content works too).
VLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}"
    "{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def _tiny_vlm(out: Path, seed: int) -> None:
    torch, transformers = _imports()
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    tok = transformers.AutoTokenizer.from_pretrained(prepare("smollm2-135m-instruct"))
    extra = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
    extra += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tok.add_special_tokens({"additional_special_tokens": extra})
    tok.chat_template = VLM_TEMPLATE
    end = tok.convert_tokens_to_ids("<end_of_utterance>")
    text = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=8192, bos_token_id=tok.bos_token_id,
        eos_token_id=end, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    vision = transformers.Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=64, patch_size=16)
    config = transformers.Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=2,
                                         image_token_id=tok.convert_tokens_to_ids("<image>"),
                                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id)
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config)
    with torch.no_grad():  # large enough that images move greedy answers
        for param in model.parameters():
            param.normal_(0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64},
                                       do_image_splitting=True)
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                      chat_template=VLM_TEMPLATE).save_pretrained(out)
    tok.save_pretrained(out)


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
    out["tiny-vlm"] = _write_atomically(root / "tiny-vlm", lambda d: _tiny_vlm(d, 3))
    for name, (rank, seed) in LORA_ADAPTERS.items():
        out[name] = _write_atomically(root / "loras" / name, lambda d, r=rank, s=seed: _lora(d, r, s))
    out["loras"] = root / "loras"
    return out
