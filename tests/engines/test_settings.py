"""Engine settings: the config's own names from the config to the engine, one typed view of
engine_kwargs, and one context length for the tokenize stage and the engine."""

from __future__ import annotations

import dataclasses

from llmbatch import HttpRequestProcessorConfig, build_processor, vLLMEngineProcessorConfig
from llmbatch.engines.settings import EngineKwargs, HttpSettings, VLLMSettings, max_model_len


def test_the_engine_gets_the_configs_own_names_and_meanings():
    config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct", concurrency=(1, 3),
                                       engine_kwargs={"max_model_len": 512}, log_engine_metrics=True,
                                       keep_warm_s=0)
    engine = build_processor(config).get_stage_by_name("engine").engine
    assert engine.settings == VLLMSettings(model_source="smollm2-135m-instruct", engine_kwargs={"max_model_len": 512},
                                           concurrency=(1, 3), detokenize_stage=True, log_engine_metrics=True)
    assert engine.settings.max_replicas() == 3
    http = HttpRequestProcessorConfig(url="http://x/v1", base_retry_wait_time_in_s=0.5, dedup_requests=False)
    settings = build_processor(http).get_stage_by_name("engine").engine.settings
    config_fields = set(type(http).model_fields)
    assert {f.name for f in dataclasses.fields(HttpSettings)} <= config_fields  # no renamed setting
    assert settings.base_retry_wait_time_in_s == 0.5 and settings.dedup_requests is False


def test_engine_kwargs_read_by_llmbatch_are_typed():
    kw = EngineKwargs({"max_model_len": "256", "trust_remote_code": 1, "tensor_parallel_size": 2,
                       "pipeline_parallel_size": 2})
    assert kw.max_model_len == 256 and kw.trust_remote_code is True
    assert kw.devices() == 4 and not kw.single_process()
    assert EngineKwargs({"context_length": 300, "tp_size": 2}).max_model_len == 300  # SGLang's names
    assert EngineKwargs({"tp_size": 2, "dp_size": 2}).devices() == 4
    assert EngineKwargs().max_model_len is None and EngineKwargs().single_process()


def test_the_tokenize_stage_and_the_engine_get_one_context_length(minilm, smollm2):
    """all-MiniLM-L6-v2 says 512 positions in its config.json and 256 in its sentence-transformers
    config, which vLLM uses: the tokenize stage checked prompts against 512 and let a 300-token
    text through to an engine that refused it. Now both read one number (256), also when the
    tokenizer comes from another model."""
    import vllm

    config = vLLMEngineProcessorConfig(model_source=minilm, task_type="embed",
                                       tokenize_stage={"model_source": smollm2}, keep_warm_s=0)
    tokenize = build_processor(config).get_stage_by_name("tokenize")
    tokenize.ensure_setup()
    engine = build_processor(config).get_stage_by_name("engine").engine
    assert tokenize.max_model_len == max_model_len(engine.settings.model_source, engine.settings.engine_kwargs) == 256
    vllms_own = vllm.EngineArgs(model=minilm, runner="pooling").create_model_config().max_model_len
    assert vllms_own == 256
    explicit = vLLMEngineProcessorConfig(model_source=minilm, task_type="embed", engine_kwargs={"max_model_len": 128})
    tokenize = build_processor(explicit).get_stage_by_name("tokenize")
    tokenize.ensure_setup()
    assert tokenize.max_model_len == 128
