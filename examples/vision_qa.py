"""The seeds' COCO-style question flow, as written for ``ray.data.llm``, with only the import,
the model and the accelerator changed (marked ``# changed``): PIL images in ``messages``,
``has_image=True`` (Ray's old spelling; llmbatch still takes it, with a deprecation warning).

    python examples/vision_qa.py [ROWS] [MODEL]

MODEL defaults to the seeded tiny VLM (``llmbatch models make-test-models``), whose answers
mean nothing; on a GPU pass a real VLM (e.g. Qwen/Qwen2.5-VL-3B-Instruct).
"""

import io
import sys

if __name__ == "__main__":  # vLLM starts processes: keep start-up code under this guard
    import ray
    from PIL import Image

    from llmbatch import build_llm_processor, vLLMEngineProcessorConfig  # changed: was ray.data.llm
    from llmbatch.sample_images import sample_images
    from llmbatch.toy_models import make_test_models

    args = [a for a in sys.argv[1:] if a and not a.startswith("--")]
    rows = next((int(a) for a in args if a.isdigit()), 16)
    model = next((a for a in args if not a.isdigit()), None) or str(make_test_models()["tiny-vlm"])  # changed
    questions = ["What is in this picture?", "What colors are there?", "Is there any text in the image?"]
    # COCO rows as Hugging Face datasets hold them: an image struct and a question
    ds = ray.data.from_items([{"image": {"bytes": item["image"], "path": item["name"]}, "question": questions[i % 3]}
                              for i, item in enumerate(sample_images(rows, seed=5))])

    vision_processor_config = vLLMEngineProcessorConfig(
        model_source=model,
        engine_kwargs=dict(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            max_model_len=4096,
            enable_chunked_prefill=True,
            max_num_batched_tokens=2048,
        ),
        runtime_env=dict(env_vars=dict(VLLM_USE_V1="1")),
        batch_size=16,
        accelerator_type=None,  # changed: was "L4"
        concurrency=1,
        has_image=True,
    )

    def vision_preprocess(row: dict) -> dict:
        return dict(
            messages=[
                {"role": "system", "content": "You are a helpful assistant that answers questions about images."},
                {"role": "user", "content": [
                    {"type": "text", "text": row["question"]},
                    {"type": "image", "image": Image.open(io.BytesIO(row["image"]["bytes"]))},
                ]},
            ],
            sampling_params=dict(temperature=0.3, max_tokens=8, detokenize=False),
        )

    def vision_postprocess(row: dict) -> dict:
        return dict(question=row["question"], resp=row["generated_text"])

    vision_processor = build_llm_processor(vision_processor_config, preprocess=vision_preprocess,
                                           postprocess=vision_postprocess)
    out = vision_processor(ds).take_all()
    for row in out[:3]:
        print(row)
    print(f"{len(out)} answers")
