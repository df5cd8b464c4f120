"""The demo's prompt, its accuracy and its sample of rows (no engine: tests/e2e runs the demo's job)."""

from pathlib import Path

import yaml

from llmbatch.demo import (
    FEW_SHOT,
    MAX_TOKENS,
    SYSTEM_PROMPT,
    USER_PROMPT,
    accuracy,
    sample_rows,
)
from llmbatch.jobs.spec import load_job
from llmbatch.sample_data import INDUSTRIES, TRADES, known_industry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "industry.yaml"


def test_job_file_is_the_demo_job():
    job = yaml.safe_load(EXAMPLE.read_text())
    assert job["prompt"] == {"system": SYSTEM_PROMPT, "user": USER_PROMPT, "choices": INDUSTRIES}
    assert job["sampling_params"] == {"temperature": 0, "max_tokens": MAX_TOKENS}
    load_job(EXAMPLE)  # a valid job file


def test_few_shot_examples_cover_the_labels_and_are_not_the_answer_key():
    assert sorted(label for _, label in FEW_SHOT) == sorted(INDUSTRIES)
    for company, _ in FEW_SHOT:
        assert known_industry(company) is None and not set(company.split()) & set(TRADES), company
        assert company in SYSTEM_PROMPT
    assert all(len(label) + 2 <= MAX_TOKENS for label in INDUSTRIES)


def test_the_jobs_request_is_the_few_shot_prompt_with_the_choices():
    from llmbatch.jobs.prompts import job_preprocess

    request = job_preprocess(load_job(EXAMPLE))({"Company": "Atlas Insurance"})
    assert request["messages"] == [{"role": "system", "content": SYSTEM_PROMPT},
                                   {"role": "user", "content": "Atlas Insurance"}]
    assert request["sampling_params"]["structured_outputs"] == {"choice": INDUSTRIES}


def test_accuracy_scores_only_revealing_names():
    rows = [{"Company": "Atlas Insurance", "industry": "financial services"},
            {"Company": "Pioneer Marine", "industry": "agriculture"},
            {"Company": "Smith LLC", "industry": "retail"},
            {"Company": "Griffin Consulting LLC", "industry": "consulting"}]
    assert accuracy(rows) == (2, 3)
    assert accuracy([]) == (0, 0)


def test_sample_rows_are_seeded_random_rows_in_index_order():
    rows = [{"Index": i, "Company": f"c{i}"} for i in range(1, 1001)]
    a = sample_rows(rows, 8, seed=0)
    assert a == sample_rows(rows, 8, seed=0) != sample_rows(rows, 8, seed=1)
    assert [r["Index"] for r in a] == sorted(r["Index"] for r in a) and a != rows[:8]
    assert len(sample_rows(rows[:3], 8, seed=0)) == 3
