"""A Qwen2.5-VL-3B-shaped model folder without weights, for vLLM's ``load_format="dummy"``.

    python bench/make_vlm_shape.py OUTDIR

Writes config.json (Qwen2.5-VL-3B-Instruct's shapes: 36 layers of 2048, a 32-block vision tower
of 1280 with window attention, vocab 151936), the image and video processor configs
(Qwen2-VL's: 14 px patches, 2x2 merge), a tokenizer (SmolLM2's, offline, plus Qwen's vision
tokens, whose ids the config names) and Qwen2.5-VL's chat template. Nothing is fetched from a
hub. The answers of dummy weights mean nothing; the work per image and per token is the real
model's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def main(out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from llmbatch.models import prepare

    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(prepare("smollm2-135m-instruct"))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=128000,
                rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=32768, max_window_layers=70,
                rope_theta=1000000.0, rope_scaling={"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]},
                bos_token_id=tok.bos_token_id, eos_token_id=eos, tie_word_embeddings=True, torch_dtype="bfloat16")
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", **text,
        "text_config": {**text, "model_type": "qwen2_5_vl_text"},
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                          "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                          "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2,
                          "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                          "model_type": "qwen2_5_vl"},
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": eos}))
    image = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
             "do_convert_rgb": True, "image_mean": MEAN, "image_std": STD, "min_pixels": 3136, "max_pixels": 12845056,
             "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "processor_class": "Qwen2_5_VLProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps({**image, "image_processor_type": "Qwen2VLImageProcessor"}, indent=1))
    (out / "video_preprocessor_config.json").write_text(json.dumps(
        {**image, "video_processor_type": "Qwen2VLVideoProcessor", "min_pixels": 128 * 28 * 28,
         "max_pixels": 768 * 28 * 28, "fps": 2.0}, indent=1))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    loaded = AutoConfig.from_pretrained(out)
    assert loaded.vision_config.out_hidden_size == 2048 and len(tok) <= 151936
    print(out, "image token", ids["<|image_pad|>"], "layers", text["num_hidden_layers"])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
