"""The SGLang engine on a CPU without SGLang: request mapping, output rows, the clear errors,
and restart of a dead engine (a fake ``sglang.Engine`` whose "scheduler" is a real process)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from llmbatch import SGLangEngineProcessorConfig, build_processor
from llmbatch.engines import sglang as sg
from llmbatch.engines.settings import SGLangSettings
from llmbatch.engines.sglang import SGLangEngine, check_sglang_build
from llmbatch.engines.sglang_params import (
    DEFAULT_MAX_TOKENS,
    choice_regex,
    output_columns,
    sampling_params,
)
from llmbatch.errors import MissingDependencyError, ResourceError, RowValidationError
from llmbatch.rows import ERROR_COLUMN
from llmbatch.stages.engine import EngineStage

# -- sampling params -----------------------------------------------------------------------------


def test_vllm_names_map_to_sglang_names():
    params, check = sampling_params({"max_tokens": 5, "min_tokens": 2, "seed": 7, "temperature": 0, "top_k": 0,
                                     "include_stop_str_in_output": True, "stop": ["\n"], "logit_bias": {3: -1}})
    assert params == {"max_new_tokens": 5, "min_new_tokens": 2, "sampling_seed": 7, "temperature": 0, "top_k": -1,
                      "no_stop_trim": True, "stop": ["\n"], "logit_bias": {"3": -1.0}}
    assert check is None


def test_default_max_tokens_is_vllms_and_sglang_names_pass():
    assert sampling_params(None)[0] == {"max_new_tokens": DEFAULT_MAX_TOKENS}
    assert sampling_params({"max_new_tokens": 9, "temperature": 0.5})[0] == {"max_new_tokens": 9, "temperature": 0.5}
    # llmbatch's own vLLM-only keys are dropped
    assert sampling_params({"detokenize": False, "truncate_prompt_tokens": 3})[0] == {"max_new_tokens": 16}


@pytest.mark.parametrize("raw, message", [
    ({"max_tokns": 3}, "'max_tokns'.*did you mean 'max_tokens'"),
    ({"logprobs": 2}, "'logprobs'.*not returned"),
    ({"bad_words": ["x"]}, "'bad_words'"),
    ({"n": 2}, "'n' must be 1"),
    ({"max_tokens": 3, "max_new_tokens": 4}, "same setting"),
    ({"max_tokens": "3"}, "'max_tokens' must be an integer"),
    ({"max_new_tokens": 2.5}, "'max_new_tokens' must be an integer"),
    ({"temperature": "hot"}, "'temperature' must be a number"),
    ({"max_tokens": 0}, "at least 1"),
    ("greedy", "must be a dict"),
])
def test_bad_params_fail_the_row_naming_the_param(raw, message):
    with pytest.raises(RowValidationError, match=message):
        sampling_params(raw)


def test_max_tokens_must_fit_the_context():
    with pytest.raises(RowValidationError, match="context is 64"):
        sampling_params({"max_tokens": 64}, context_len=64)


# -- structured outputs --------------------------------------------------------------------------


def test_choice_becomes_a_regex_of_exactly_the_choices():
    choices = ["Law Firm", "Retail", "C++ (shop)", "a.b|c", "x*y?"]
    params, check = sampling_params({"structured_outputs": {"choice": choices}, "temperature": 0})
    assert set(params) == {"regex", "temperature", "max_new_tokens"}
    assert check == {"choice": choices}
    pattern = re.compile(params["regex"])
    for c in choices:
        assert pattern.fullmatch(c)
    for wrong in ["Law", "Retail ", "a.b", "C++ shop", "xy", "aXb|c"]:
        assert not pattern.fullmatch(wrong), wrong
    assert choice_regex(["Yes", "No"]) == "(Yes|No)"


def test_json_schema_regex_and_grammar_map_to_sglang():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params, check = sampling_params({"structured_outputs": {"json": schema}})
    assert json.loads(params["json_schema"]) == schema and check == {"json": schema}
    params, _ = sampling_params({"structured_outputs": {"json": json.dumps(schema)}})
    assert json.loads(params["json_schema"]) == schema
    assert sampling_params({"structured_outputs": {"regex": "[0-9]+"}})[0]["regex"] == "[0-9]+"
    assert sampling_params({"structured_outputs": {"grammar": 'root ::= "a"'}})[0]["ebnf"] == 'root ::= "a"'
    assert json.loads(sampling_params({"structured_outputs": {"json_object": True}})[0]["json_schema"]) == {"type": "object"}
    # the legacy spelling
    assert sampling_params({"guided_decoding": {"choice": ["A", "B"]}})[0]["regex"] == "(A|B)"
    # SGLang's own names, as Ray's SGLang stage passes them; checked the same way
    params, check = sampling_params({"json_schema": json.dumps(schema)})
    assert json.loads(params["json_schema"]) == schema and check == {"json": schema}
    assert sampling_params({"regex": "a+"})[1] == {"regex": "a+"}


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "nope"}}, "not a valid JSON schema"),
    ({"regex": "("}, "not a valid regular expression"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a"], "regex": "a"}, "exactly one"),
    ({"whitespace_pattern": " "}, "'whitespace_pattern' is not supported"),
    ({"grammar": ""}, "exactly one|EBNF"),
    ("a|b", "must be a dict"),
])
def test_bad_structured_outputs_fail_the_row(spec, message):
    with pytest.raises(RowValidationError, match=message):
        sampling_params({"structured_outputs": spec})


def test_structured_outputs_need_the_engines_tokenizer():
    with pytest.raises(RowValidationError, match="skip_tokenizer_init"):
        sampling_params({"structured_outputs": {"choice": ["a"]}}, tokenizer_in_engine=False)
    with pytest.raises(RowValidationError, match="both structured_outputs and SGLang's 'regex'"):
        sampling_params({"structured_outputs": {"choice": ["a"]}, "regex": "a"})


# -- output rows ---------------------------------------------------------------------------------


def fake_output(n=3, reason="stop", text="Retail"):
    return {"text": text, "output_ids": list(range(100, 100 + n)),
            "meta_info": {"id": "r1", "finish_reason": {"type": reason, "matched": 2}, "prompt_tokens": 7,
                          "completion_tokens": n, "cached_tokens": 4}}


def test_output_dict_becomes_the_row_contract():
    assert output_columns(fake_output(), [1] * 7) == {
        "generated_text": "Retail", "generated_tokens": [100, 101, 102], "num_input_tokens": 7,
        "num_generated_tokens": 3, "finish_reason": "stop", "num_cached_tokens": 4}
    # token-out mode (skip_tokenizer_init): no text; the detokenize stage fills it
    out = fake_output(reason="length")
    del out["text"]
    cols = output_columns(out, None)
    assert cols["generated_text"] == "" and cols["finish_reason"] == "length"


def test_aborted_request_is_the_rows_error():
    out = fake_output()
    out["meta_info"]["finish_reason"] = {"type": "abort", "message": "input too long"}
    with pytest.raises(RuntimeError, match="SGLang aborted the request: input too long"):
        output_columns(out, [1])


# -- clear errors at build time ------------------------------------------------------------------


def test_without_sglang_build_fails_with_the_pip_command(monkeypatch):
    monkeypatch.setattr(sg.importlib.util, "find_spec", lambda name: None)
    config = SGLangEngineProcessorConfig(model_source="org/model-x", engine_kwargs={"context_length": 256})
    with pytest.raises(MissingDependencyError, match=re.escape('pip install "llmbatch[sglang]"')):
        build_processor(config)


def test_without_a_gpu_build_fails_before_any_work(monkeypatch):
    monkeypatch.setattr(sg.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(sg, "has_gpu", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(is_initialized=lambda: False))
    with pytest.raises(ResourceError, match="needs a CUDA GPU"):
        check_sglang_build()
    # a run that goes to a cluster is checked against the cluster's GPUs when it runs
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    check_sglang_build()


def test_processor_builds_with_the_shared_stages(monkeypatch):
    monkeypatch.setattr(sg, "check_sglang_build", lambda: None)
    monkeypatch.setattr("llmbatch.builders.check_sglang_build", lambda: None)
    config = SGLangEngineProcessorConfig(model_source="org/model-x", engine_kwargs={"context_length": 256, "tp_size": 2},
                                         batch_size=16)
    processor = build_processor(config, preprocess=lambda r: r, postprocess=lambda r: r)
    assert processor.list_stage_names() == ["preprocess", "chat_template", "tokenize", "engine", "detokenize",
                                            "postprocess"]
    assert processor.layout.needs_gpu and processor.layout.devices_per_replica == 2
    assert isinstance(processor.get_stage_by_name("engine").engine, SGLangEngine)
    with pytest.raises(Exception, match="multimodal"):
        build_processor(SGLangEngineProcessorConfig(model_source="org/model-x", prepare_multimodal_stage=True))
    with pytest.raises(Exception, match="model_source"):
        SGLangEngineProcessorConfig(model_source="org/model-x", engine_kwargs={"model_path": "/y"})


def test_unknown_engine_kwargs_fail_naming_the_closest():
    with pytest.raises(Exception, match="'mem_fraction' is not an sglang.Engine argument.*mem_fraction_static"):
        sg.check_engine_kwargs({"mem_fraction": 0.8}, ["mem_fraction_static", "model_path"])
    assert sg.engine_arguments("/m", {"mem_fraction_static": 0.5, "model": "z"}) == {
        "model_path": "/m", "mem_fraction_static": 0.5, "log_level": "error", "skip_tokenizer_init": False}


# -- the engine around a fake sglang.Engine --------------------------------------------------------


class FakeSGLang:
    """Stands in for ``sglang.Engine``: a real child process as its scheduler; requests hang
    once that process is gone (as SGLang's do)."""

    started = 0

    def __init__(self, delay=0.05):
        FakeSGLang.started += 1
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        # a helper that exits on its own (as a resource tracker or compile worker may): not the engine
        self.helper = subprocess.Popen([sys.executable, "-c", "pass"])
        self.delay = delay
        self.tokenizer_manager = SimpleNamespace(context_len=512, asyncio_tasks=set(), abort_request=lambda rid: None)
        self.server_args = SimpleNamespace(max_running_requests=8)
        self.seen = []

    def shutdown(self):
        pass

    def get_all_child_pids(self):
        return [self.proc.pid]

    async def async_generate(self, sampling_params, rid, input_ids=None, prompt=None):
        self.seen.append(sampling_params)
        await asyncio.sleep(self.delay)
        if self.proc.poll() is not None:
            await asyncio.Event().wait()  # a dead scheduler never answers
        n = sampling_params["max_new_tokens"]
        return {"text": "ok" * n, "output_ids": list(range(n)),
                "meta_info": {"finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(input_ids),
                              "completion_tokens": n, "cached_tokens": 0}}


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.delenv("LLMBATCH_START_LOG", raising=False)  # a fake start: not one the suite counts
    monkeypatch.setattr(sg, "watch_children", lambda: True)
    monkeypatch.setattr(sg, "POLL_S", 0.05)
    engines = []

    def launch(self):
        engines.append(FakeSGLang())
        return engines[-1]

    monkeypatch.setattr(SGLangEngine, "_launch", launch)
    return engines


def rows(n, max_tokens=2):
    return [{"tokenized_prompt": [1, 2, i], "prompt": f"p{i}",
             "sampling_params": {"max_tokens": max_tokens, "temperature": 0}} for i in range(n)]


def test_rows_run_and_the_engine_closes_its_processes(fake_engine):
    engine = SGLangEngine(SGLangSettings("/models/x", {}))

    async def go():
        stage = EngineStage(engine)
        await stage.start()
        out = [r for chunk in [c async for c in stage(rows(5) + [{"tokenized_prompt": [1], "sampling_params":
                                                                  {"max_tokens": 3, "logprobs": 1}}])] for r in chunk]
        pids = list(engine.pids)
        await stage.close()
        return out, pids

    out, pids = asyncio.run(go())
    good = [r for r in out if not r[ERROR_COLUMN]]
    bad = [r for r in out if r[ERROR_COLUMN]]
    assert len(good) == 5 and len(bad) == 1 and "logprobs" in bad[0][ERROR_COLUMN]
    assert {r["generated_text"] for r in good} == {"okok"} and all(r["num_input_tokens"] == 3 for r in good)
    assert fake_engine[0].seen[0] == {"max_new_tokens": 2, "temperature": 0}
    assert engine.capacity == 8 and engine.context_len == 512
    assert fake_engine[0].helper.poll() is not None and len(fake_engine) == 1  # its exit was no restart
    assert fake_engine[0].proc.wait(timeout=5) is not None  # killed and reaped
    assert not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                   for pid in pids)


def test_a_killed_engine_process_is_restarted_and_no_row_is_lost(fake_engine):
    engine = SGLangEngine(SGLangSettings("/models/x", {}))

    async def go():
        stage = EngineStage(engine)
        await stage.start()
        fake_engine[0].delay = 0.5
        work = rows(12)

        async def kill_soon():
            await asyncio.sleep(0.2)
            fake_engine[0].proc.kill()

        killer = asyncio.ensure_future(kill_soon())
        out = [r for chunk in [c async for c in stage(work)] for r in chunk]
        await killer
        await stage.close()
        return out, stage

    started = time.monotonic()
    out, stage = asyncio.run(go())
    assert time.monotonic() - started < 20
    assert len(out) == 12 and not [r for r in out if r[ERROR_COLUMN]]
    assert sorted(r["prompt"] for r in out) == sorted(f"p{i}" for i in range(12))
    assert len(fake_engine) == 2 and stage._generation == 1
    assert fake_engine[1].proc.wait(timeout=5) is not None


@pytest.mark.parametrize("answer, expected", [([{"effective_max_running_requests_per_dp": 3000}], 3000),
                                               ([{"effective_max_running_requests_per_dp": 1500}] * 2, 3000),
                                               (None, sg.DEFAULT_CAPACITY)])
def test_admission_follows_the_running_requests_the_scheduler_sized(fake_engine, monkeypatch, answer, expected):
    """SGLang sizes max_running_requests in its scheduler (the main process's server_args says
    None): llmbatch asks the started engine, and admits 1.1x that; an engine that does not
    answer in time leaves the default, with a warning."""
    monkeypatch.setattr(sg, "CAPACITY_QUERY_S", 0.3)

    async def internal_state():
        if answer is None:
            await asyncio.Event().wait()  # never answers
        return answer

    def launch(self):
        engine = FakeSGLang()
        engine.server_args.max_running_requests = None
        engine.tokenizer_manager.get_internal_state = internal_state
        fake_engine.append(engine)
        return engine

    monkeypatch.setattr(SGLangEngine, "_launch", launch)

    async def go():
        stage = EngineStage(SGLangEngine(SGLangSettings("/models/x", {})))
        await stage.start()
        limit = stage._semaphore._value
        await stage.close()
        return stage.engine.capacity, limit

    capacity, limit = asyncio.run(go())
    assert capacity == expected and limit == math.ceil(expected * 1.1)


def test_choice_regex_is_exact_in_xgrammar_sglangs_grammar_backend():
    xgr = pytest.importorskip("xgrammar")
    from llmbatch.sample_data import INDUSTRIES

    for choices in (INDUSTRIES, ["C++ (x)", "a.b|c", "x*y?", "50% off", "a/b", 'say "hi"', "back\\slash", "[b]{x}", "^$"]):
        grammar = xgr.Grammar.from_regex(choice_regex(choices))
        for c in choices:
            assert xgr.testing._is_grammar_accept_string(grammar, c), c
            assert not xgr.testing._is_grammar_accept_string(grammar, c + "x"), c


def test_vllm_engine_kwargs_map_to_sglangs_so_a_config_switches_by_class():
    config = SGLangEngineProcessorConfig(model_source="org/model-x", engine_kwargs={
        "max_model_len": 512, "gpu_memory_utilization": 0.8, "tensor_parallel_size": 2, "max_num_seqs": 64,
        "enable_prefix_caching": True, "enforce_eager": False, "disable_log_stats": True, "load_format": "dummy",
        "sampling_backend": "pytorch"})
    assert config.engine_kwargs == {"context_length": 512, "mem_fraction_static": 0.8, "tp_size": 2,
                                    "max_running_requests": 64, "disable_radix_cache": False,
                                    "disable_cuda_graph": False, "load_format": "dummy", "sampling_backend": "pytorch"}
    assert config.devices_per_replica() == 2
    with pytest.raises(Exception, match="enable_chunked_prefill is a vLLM setting"):
        SGLangEngineProcessorConfig(model_source="org/model-x", engine_kwargs={"enable_chunked_prefill": True})
    with pytest.raises(Exception, match="'context_length' twice, as 'max_model_len' and as 'context_length'"):
        SGLangEngineProcessorConfig(model_source="org/model-x", engine_kwargs={"max_model_len": 512,
                                                                                "context_length": 1024})


def test_sglang_replicas_admit_twice_the_requests_its_scheduler_runs():
    """SGLang's scheduler runs up to 4096 requests where the KV cache allows and fills its
    batches from a waiting queue: a replica keeps 8192 admitted by default (32 batches of 256;
    the engine stage holds those inside the engine to 1.1x its capacity), vLLM's 2048 (8)."""
    from llmbatch import vLLMEngineProcessorConfig

    assert SGLangEngineProcessorConfig(model_source="m", batch_size=256).resolved_max_concurrent_batches() == 32
    assert vLLMEngineProcessorConfig(model_source="m", batch_size=256).resolved_max_concurrent_batches() == 8
    assert SGLangEngineProcessorConfig(model_source="m", batch_size=64).resolved_max_concurrent_batches() == 64
    assert SGLangEngineProcessorConfig(model_source="m", batch_size=256,
                                       max_concurrent_batches=3).resolved_max_concurrent_batches() == 3
