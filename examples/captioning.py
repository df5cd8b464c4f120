"""The seeds' captioning flow over binary images, as written for ``ray.data.llm``, with only the
import, the model and the accelerator changed (marked ``# changed``): image bytes, a filter
that drops corrupt images, a resize in the preprocess.

    python examples/captioning.py [ROWS] [MODEL] [--no-filter]

Without the filter (``--no-filter``) the corrupt images fail in the preprocess and become error
rows (``should_continue_on_error=True``) while the others are captioned. With it, the bytes that
are no image are dropped; a truncated JPEG passes ``Image.verify()`` and still becomes an error
row. MODEL defaults to the
seeded tiny VLM, whose captions mean nothing; on a GPU pass a real VLM.
"""

import io
import sys

from PIL import Image


def is_valid_image(row: dict) -> bool:
    try:
        Image.open(io.BytesIO(row["image_bytes"])).verify()
        return True
    except Exception:
        return False


def preprocess(row: dict) -> dict:
    image = Image.open(io.BytesIO(row["image_bytes"])).convert("RGB")
    image = image.resize((224, 224))
    return dict(
        messages=[{"role": "user", "content": [
            {"type": "image", "image": image},
            {"type": "text", "text": "Describe this image in one sentence."},
        ]}],
        sampling_params=dict(temperature=0.0, max_tokens=8),
    )


def postprocess(row: dict) -> dict:
    return dict(name=row["name"], caption=row["generated_text"])


if __name__ == "__main__":  # vLLM starts processes: keep start-up code under this guard
    import ray

    from llmbatch import build_llm_processor, vLLMEngineProcessorConfig  # changed: was ray.data.llm
    from llmbatch.sample_images import sample_images
    from llmbatch.toy_models import make_test_models

    args = [a for a in sys.argv[1:] if a and not a.startswith("--")]
    rows = next((int(a) for a in args if a.isdigit()), 24)
    model = next((a for a in args if not a.isdigit()), None) or str(make_test_models()["tiny-vlm"])  # changed
    ds = ray.data.from_items([{"name": it["name"], "image_bytes": it["image"]}
                              for it in sample_images(rows, seed=9, corrupt=max(1, rows // 8))])
    if "--no-filter" not in sys.argv:
        ds = ds.filter(is_valid_image)

    config = vLLMEngineProcessorConfig(
        model_source=model,
        engine_kwargs=dict(max_model_len=4096, limit_mm_per_prompt={"image": 1}),
        batch_size=32,
        concurrency=1,
        accelerator_type=None,  # changed: was "H100"
        should_continue_on_error=True,
        prepare_multimodal_stage={"enabled": True},
    )
    processor = build_llm_processor(config, preprocess=preprocess, postprocess=postprocess)
    out = processor(ds).take_all()
    errors = [r for r in out if r.get("__inference_error__")]
    for row in out[:3]:
        print(row)
    print(f"{len(out) - len(errors)} captions, {len(errors)} errors")
    for row in errors:
        print("error:", row["__inference_error__"][:160])
