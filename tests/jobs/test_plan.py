"""`llmbatch plan`: counts that can be checked by hand, without running the engine."""

from __future__ import annotations

import textwrap

from llmbatch.jobs.plan import plan_job
from llmbatch.jobs.spec import load_job


def test_plan_counts(tmp_path, smollm2):
    rows = ["Index,Company"]
    companies = ["Acme", "Globex", "Acme", "Initech", "Acme", "Globex"] + [f"Company {i}" for i in range(14)]
    rows += [f"{i + 1},{c}" for i, c in enumerate(companies)]
    rows.append(f"{len(companies) + 1}," + "very long name " * 200)
    (tmp_path / "c.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "job.yaml").write_text(textwrap.dedent("""
        input: {path: c.csv, id_column: Index}
        model: {source: smollm2-135m-instruct, engine_kwargs: {max_model_len: 256}}
        prompt:
          system: You classify companies by industry. Answer with one word. Be precise and short.
          user: "Which industry is {Company} in?"
        sampling_params: {temperature: 0, max_tokens: 8}
        output: {path: out.parquet}
    """))
    plan = plan_job(load_job(tmp_path / "job.yaml"), throughput=2.0)
    assert plan["rows"] == 21
    assert plan["duplicate_requests"] == 3          # Acme twice more, Globex once more
    assert plan["unique_requests"] == 18
    assert plan["rows_over_max_model_len"] == 1     # the very long company name
    toks = plan["prompt_tokens"]
    assert toks["min"] < toks["median"] < toks["max"] and toks["max"] > 256
    assert plan["shared_prefix_token_share"] > 0.2  # system prompt + template shared (the long row is not)
    assert plan["estimate"] == {"method": "given throughput", "rows_per_s": 2.0, "seconds": 9.0}
    assert plan["peak_memory_mib"] > 0
