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


def test_plan_for_a_hosted_endpoint_estimates_tokens_and_time_from_its_limits(tmp_path):
    (tmp_path / "c.csv").write_text("Index,Company\n" + "".join(f"{i},{'Acme' if i < 3 else f'Co {i}'}\n"
                                                               for i in range(1, 101)))
    (tmp_path / "job.yaml").write_text(textwrap.dedent("""
        input: {path: c.csv, id_column: Index}
        model: {processor: http, source: gpt-4o-mini, url: "https://api.example.com/v1", qps: 10,
                tokens_per_minute: 6000}
        prompt: {user: "Which industry is {Company} in?"}
        sampling_params: {temperature: 0, max_tokens: 8}
        output: {path: out.parquet}
    """))
    plan = plan_job(load_job(tmp_path / "job.yaml"))
    assert plan["rows"] == 100 and plan["duplicate_requests"] == 1 and plan["prompt_tokens_estimated"]
    assert plan["max_model_len"] is None and plan["shared_prefix_token_share"] is None
    per_row = plan["prompt_tokens"]["median"] + 8      # ~4 characters a token, plus max_tokens
    assert 10 <= plan["prompt_tokens"]["median"] <= 20
    assert plan["estimate"]["method"].startswith("rate limits")
    # the tokens bind (6000/min = 100/s), not the 10 requests/s
    assert abs(plan["estimate"]["seconds"] - 100 * per_row / 100 * 1.05) < 3


def test_plan_counts_as_duplicates_only_the_requests_the_engine_stage_answers_once(tmp_path, smollm2):
    """The plan asks the engine for each row's request key, as the engine stage dedups: greedy
    rows that repeat are answered once, sampled ones each run (their answers differ)."""
    (tmp_path / "c.csv").write_text("Index,Company\n" + "".join(f"{i},{'Acme' if i % 2 else 'Globex'}\n"
                                                               for i in range(1, 11)))
    (tmp_path / "job.yaml").write_text(textwrap.dedent("""
        input: {path: c.csv, id_column: Index}
        model: {source: smollm2-135m-instruct, engine_kwargs: {max_model_len: 256}}
        prompt: {user: "Which industry is {Company} in?"}
        sampling_params: {temperature: 0, max_tokens: 8}
        output: {path: out.parquet}
    """))
    greedy = plan_job(load_job(tmp_path / "job.yaml"))
    assert greedy["rows"] == 10 and greedy["unique_requests"] == 2 and greedy["duplicate_requests"] == 8
    sampled = plan_job(load_job(tmp_path / "job.yaml", overrides=["sampling_params.temperature=0.8"]))
    assert sampled["unique_requests"] == 10 and sampled["duplicate_requests"] == 0
    seeded = plan_job(load_job(tmp_path / "job.yaml", overrides=["sampling_params.temperature=0.8",
                                                                 "sampling_params.seed=7"]))
    assert seeded["unique_requests"] == 2
