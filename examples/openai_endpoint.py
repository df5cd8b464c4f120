"""Ray's "batch inference with an OpenAI-compatible endpoint" example, on llmbatch.

Against OpenAI: export OPENAI_API_KEY=... and run it. Against any OpenAI-compatible server
(vLLM, a gateway), point OPENAI_URL at its chat completions endpoint:

    vllm serve <model> --served-model-name gpt-4o-mini --port 8000 &
    OPENAI_URL=http://127.0.0.1:8000/v1/chat/completions python examples/openai_endpoint.py

Compared with the code in Ray's docs, only the import and the URL differ.
"""

import os

if __name__ == "__main__":
    import ray

    from llmbatch import HttpRequestProcessorConfig, build_llm_processor

    OPENAI_KEY = os.environ.get("OPENAI_API_KEY", "your-api-key-here")
    URL = os.environ.get("OPENAI_URL", "https://api.openai.com/v1/chat/completions")
    ds = ray.data.from_items(["Hand me a haiku."])

    config = HttpRequestProcessorConfig(
        url=URL,
        headers={"Authorization": f"Bearer {OPENAI_KEY}"},
        qps=1,
    )
    processor = build_llm_processor(
        config,
        preprocess=lambda row: dict(
            payload=dict(
                model="gpt-4o-mini",
                messages=[
                    {"role": "system", "content": "You are a bot that responds with haikus."},
                    {"role": "user", "content": row["item"]},
                ],
                temperature=0.0,
                max_tokens=150,
            ),
        ),
        postprocess=lambda row: dict(response=row["http_response"]["choices"][0]["message"]["content"]),
    )
    ds = processor(ds)
    print(ds.take_all())
