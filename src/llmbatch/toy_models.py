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
  tokenizer plus the image tokens, a processor that splits images up to 128 px into tiles;
- ``tiny-audio``: a Qwen2-Audio-style audio-language model with seeded random weights: a 2-layer
  Whisper-style audio tower (64 mel bins, clips up to 30 s at 16 kHz, 25 audio tokens per second),
  a 2-layer Qwen2 (head_dim 64) on SmolLM2's tokenizer plus the audio tokens, Qwen2-Audio's
  processor and chat template.
"""

from __future__ import annotations

import contextlib
import importlib.util
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


#: Qwen2-Audio's chat template (as its processor ships it): an audio part becomes
#: "Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>".
AUDIO_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or content['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}Audio {{ audio_count.value }}: "
    "<|audio_bos|><|AUDIO|><|audio_eos|>\n{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_audio(out: Path, seed: int) -> None:
    torch, transformers = _imports()
    from safetensors.torch import save_file
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    tok = transformers.AutoTokenizer.from_pretrained(prepare("smollm2-135m-instruct"))
    tok.add_special_tokens({"additional_special_tokens": ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]})
    tok.chat_template = AUDIO_TEMPLATE
    end = tok.convert_tokens_to_ids("<|im_end|>")
    text = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8192, bos_token_id=tok.bos_token_id, eos_token_id=end,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    # Whisper's 30 s window (3,000 mel frames, which vLLM's Qwen2-Audio expects), halved by the tower
    audio = transformers.Qwen2AudioEncoderConfig(num_mel_bins=64, encoder_layers=2, encoder_attention_heads=2,
                                                 encoder_ffn_dim=128, d_model=64, max_source_positions=1500)
    config = transformers.Qwen2AudioConfig(audio_config=audio.to_dict(), text_config=text.to_dict(),
                                           audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"))
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Qwen2AudioForConditionalGeneration(config)
    with torch.no_grad():  # large enough that the audio moves greedy answers
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1, 0.1)
            else:
                param.normal_(0, 0.5 if "projector" in name else 0.05)
    # vLLM reads Qwen2-Audio checkpoints in the original layout (transformers 5 saves another)
    renames = {"model.audio_tower.": "audio_tower.", "model.multi_modal_projector.": "multi_modal_projector.",
               "model.language_model.": "language_model.model.", "lm_head.": "language_model.lm_head."}
    weights = {}
    for name, tensor in model.state_dict().items():
        prefix = next(p for p in renames if name.startswith(p))
        weights[renames[prefix] + name[len(prefix):]] = tensor.contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    features = WhisperFeatureExtractor(feature_size=64, sampling_rate=16000, chunk_length=30)
    Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok, chat_template=AUDIO_TEMPLATE).save_pretrained(out)
    tok.save_pretrained(out)


def lora_available() -> bool:
    """Whether the LoRA adapters can be built here (they need peft, which the dev extra brings)."""
    return importlib.util.find_spec("peft") is not None


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' load reports (the seeded heads are new weights, by design) stay unsaid."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def make_test_models(root: str | os.PathLike | None = None) -> dict[str, Path]:
    """Build every test model under ``root`` (default: the cache's ``test-models``, where
    ``-m NAME`` finds them) once; returns name -> folder. LoRA adapters share one folder
    (``loras``), the ``dynamic_lora_loading_path`` a processor takes; without peft
    (:func:`lora_available`) they are skipped."""
    root = Path(root) if root is not None else cache_dir() / "test-models"
    with _quiet_transformers():
        return _make_all(root)


def _make_all(root: Path) -> dict[str, Path]:
    out = {
        "minilm-classifier": _write_atomically(root / "minilm-classifier",
                                               lambda d: _bert_classifier(d, 3, 0, CLASSIFIER_LABELS)),
        "minilm-cross-encoder": _write_atomically(root / "minilm-cross-encoder",
                                                  lambda d: _bert_classifier(d, 1, 1, ["score"])),
        "smollm2-reward": _write_atomically(root / "smollm2-reward", lambda d: _llama_reward(d, 2)),
    }
    out["tiny-vlm"] = _write_atomically(root / "tiny-vlm", lambda d: _tiny_vlm(d, 3))
    out["tiny-audio"] = _write_atomically(root / "tiny-audio", lambda d: _tiny_audio(d, 4))
    if not lora_available():
        return out
    for name, (rank, seed) in LORA_ADAPTERS.items():
        out[name] = _write_atomically(root / "loras" / name, lambda d, r=rank, s=seed: _lora(d, r, s))
    out["loras"] = root / "loras"
    return out
