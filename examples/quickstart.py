"""The README's Python example, runnable: python examples/quickstart.py [customers.csv]."""

import sys

if __name__ == "__main__":  # vLLM starts processes: keep start-up code under this guard
    import ray

    from llmbatch import build_processor, vLLMEngineProcessorConfig
    from llmbatch.sample_data import write_customers_csv

    path = sys.argv[1] if len(sys.argv) > 1 else str(write_customers_csv("/tmp/llmbatch-quickstart.csv", 40))
    config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct",
                                       engine_kwargs=dict(max_model_len=512), batch_size=64, concurrency=1)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[{"role": "user", "content": f"Industry of {row['Company']}?"}],
            sampling_params=dict(temperature=0, max_tokens=8,
                                 structured_outputs=dict(choice=["Law Firm", "Retail", "Other"]))),
        postprocess=lambda row: dict(company=row["Company"], industry=row["generated_text"]))
    ds = processor(ray.data.read_csv(path))
    rows = ds.take_all()
    for row in rows[:5]:
        print(row)
    print(f"{len(rows)} rows")
