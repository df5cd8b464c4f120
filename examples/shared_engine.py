"""Two processors share one engine deployed with Ray Serve: a draft, then a critique of it.

    python examples/shared_engine.py [rows]

The model loads once, in the Serve deployment; each processor's workers send it requests. The
first processor uses Ray's row contract (method + request_kwargs; the answer's fields are
merged into the row); the second asks as rows do for the local engine (messages,
sampling_params) and gets generated_text.
"""

import sys

import ray
from ray import serve

from llmbatch import (
    LLMConfig,
    ServeDeploymentProcessorConfig,
    build_llm_deployment,
    build_processor,
)

TOPICS = ["the sea", "bread", "trains", "winter", "bees", "libraries", "rain", "bicycles"]


def ask(topic: str) -> str:
    return f"Write one sentence about {topic}."


def processors(config: ServeDeploymentProcessorConfig):
    """The draft step and the critique step, both sent to the deployment ``config`` names."""
    draft = build_processor(
        config,
        preprocess=lambda row: dict(method="chat", request_kwargs=dict(
            model="smol", messages=[{"role": "user", "content": ask(row["topic"])}], max_tokens=24, temperature=0)),
        postprocess=lambda row: dict(topic=row["topic"], draft=row["choices"][0]["message"]["content"]))
    critique = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[{"role": "user", "content": ask(row["topic"])},
                      {"role": "assistant", "content": row["draft"]},
                      {"role": "user", "content": "What could be better in that sentence? One sentence."}],
            sampling_params=dict(temperature=0, max_tokens=24)),
        postprocess=lambda row: dict(topic=row["topic"], draft=row["draft"], critique=row["generated_text"]))
    return draft, critique


def main(rows: int) -> None:
    serve.start(proxy_location="Disabled")  # no HTTP proxy: processors call the deployment directly
    llm = LLMConfig(model_loading_config=dict(model_id="smol", model_source="smollm2-135m-instruct"),
                    engine_kwargs=dict(max_model_len=512))
    serve.run(build_llm_deployment(llm, name="llm"), name="llm_app")
    draft, critique = processors(ServeDeploymentProcessorConfig(deployment_name="llm", app_name="llm_app", batch_size=8))
    ds = ray.data.from_items([{"topic": f"{TOPICS[i % len(TOPICS)]} ({i})"} for i in range(rows)])
    out = critique(draft(ds)).take_all()
    for row in out[:3]:
        print(row)
    print(f"{len(out)} rows")
    serve.shutdown()


if __name__ == "__main__":  # vLLM starts processes: keep start-up code under this guard
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
