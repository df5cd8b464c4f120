import warnings

import pytest

from llmbatch import (
    ChatTemplateStageConfig,
    ConfigError,
    HttpRequestProcessorConfig,
    HttpRequestStageConfig,
    LLMConfig,
    ServeDeploymentProcessorConfig,
    TokenizerStageConfig,
    build_processor,
    vLLMEngineProcessorConfig,
)

MODEL = "smollm2-135m-instruct"


def test_defaults_match_ray():
    c = vLLMEngineProcessorConfig(model_source=MODEL)
    assert c.batch_size == 32
    assert c.concurrency == 1
    assert c.max_concurrent_batches is None and c.resolved_max_concurrent_batches() == 64  # 2048 rows / 32
    assert vLLMEngineProcessorConfig(model_source=MODEL, batch_size=512).resolved_max_concurrent_batches() == 8
    assert vLLMEngineProcessorConfig(model_source=MODEL, max_concurrent_batches=3).resolved_max_concurrent_batches() == 3
    assert c.task_type == "generate"
    assert c.should_continue_on_error is False
    assert c.chat_template_stage.enabled and c.tokenize_stage.enabled and c.detokenize_stage.enabled
    assert not c.prepare_multimodal_stage.enabled


def test_unknown_field_names_field_and_suggestion():
    with pytest.raises(ConfigError) as err:
        vLLMEngineProcessorConfig(model_source=MODEL, batch_sise=8)
    assert "batch_sise" in str(err.value) and "batch_size" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_concurrency_validation():
    with pytest.raises(ConfigError, match="concurrency"):
        vLLMEngineProcessorConfig(model_source=MODEL, concurrency=0)
    with pytest.raises(ConfigError, match="min <= max"):
        vLLMEngineProcessorConfig(model_source=MODEL, concurrency=(3, 1))
    assert vLLMEngineProcessorConfig(model_source=MODEL, concurrency=(1, 3)).concurrency_range() == (1, 3)


def test_unknown_task_type():
    with pytest.raises(ConfigError, match="task_type"):
        vLLMEngineProcessorConfig(model_source=MODEL, task_type="summarize")


def test_missing_model_path_fails_at_config_time(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        vLLMEngineProcessorConfig(model_source=str(tmp_path / "no-such-model"))
    with pytest.raises(ConfigError, match="Did you mean the offline alias"):
        vLLMEngineProcessorConfig(model_source="smollm2-135m-instruc")
    # hub ids are resolved later, where the engine runs
    assert vLLMEngineProcessorConfig(model_source="unsloth/Llama-3.1-8B-Instruct").model_source


def test_stage_configs_bool_dict_typed():
    c = vLLMEngineProcessorConfig(
        model_source=MODEL,
        chat_template_stage={"chat_template_kwargs": {"enable_thinking": False}, "num_cpus": 0.5},
        tokenize_stage=TokenizerStageConfig(batch_size=16),
        detokenize_stage=False,
    )
    assert isinstance(c.chat_template_stage, ChatTemplateStageConfig)
    assert c.chat_template_stage.chat_template_kwargs == {"enable_thinking": False}
    assert c.tokenize_stage.batch_size == 16
    assert c.detokenize_stage.enabled is False
    with pytest.raises(ConfigError, match="chat_templat"):
        vLLMEngineProcessorConfig(model_source=MODEL, chat_template_stage={"chat_templat": "x"})


@pytest.mark.parametrize(
    "legacy, check",
    [
        ({"model": MODEL}, lambda c: c.model_source == MODEL),
        ({"apply_chat_template": False}, lambda c: not c.chat_template_stage.enabled),
        ({"tokenize": False}, lambda c: not c.tokenize_stage.enabled),
        ({"detokenize": False}, lambda c: not c.detokenize_stage.enabled),
        ({"has_image": True}, lambda c: c.prepare_multimodal_stage.enabled),
        ({"chat_template": "{{ messages }}"}, lambda c: c.chat_template_stage.chat_template == "{{ messages }}"),
    ],
)
def test_legacy_spellings_warn(legacy, check):
    fields = {"model_source": MODEL, **legacy} if "model" not in legacy else legacy
    with pytest.warns(DeprecationWarning):
        c = vLLMEngineProcessorConfig(**fields)
    assert check(c)


def test_task_type_in_engine_kwargs_moves_up():
    c = vLLMEngineProcessorConfig(model_source="all-minilm-l6-v2", engine_kwargs={"task_type": "embed"})
    assert c.task_type == "embed" and "task_type" not in c.engine_kwargs


def test_placement_group_config_checked():
    with pytest.raises(ConfigError, match="bundles"):
        vLLMEngineProcessorConfig(model_source=MODEL, placement_group_config={"strategy": "PACK"})
    ok = vLLMEngineProcessorConfig(model_source=MODEL, placement_group_config={"bundles": [{"GPU": 1}]})
    assert ok.placement_group_config["bundles"] == [{"GPU": 1}]


def test_a_bundle_without_amounts_fails_with_the_yaml_spelling_to_use():
    import yaml

    # `--set 'model.placement_group_config={bundles:[{GPU:0.5}]}'`: YAML reads {GPU:0.5} as the key 'GPU:0.5'
    # with no value; unchecked, the job started Ray and the engine before it failed
    wrong = yaml.safe_load("{bundles:[{GPU:0.5}]}")
    with pytest.raises(ConfigError, match=r"bundles\[0\]: resource 'GPU:0.5' needs an amount.*\{GPU: 0.5\}"):
        vLLMEngineProcessorConfig(model_source=MODEL, placement_group_config=wrong)
    for bad, where in (({"bundles": []}, "'bundles' must be a list"), ({"bundles": [{}]}, r"bundles\[0\] must map"),
                       ({"bundles": [{"GPU": -1}]}, "needs an amount"), ({"bundles": [{"GPU": "1"}]}, "needs an amount"),
                       ({"bundle_per_worker": {"CPU": None}}, "bundle_per_worker: resource 'CPU'")):
        with pytest.raises(ConfigError, match=where):
            vLLMEngineProcessorConfig(model_source=MODEL, placement_group_config=bad)
    ok = vLLMEngineProcessorConfig(model_source=MODEL, placement_group_config=yaml.safe_load("{bundles: [{GPU: 1, CPU: 2}]}"))
    assert ok.placement_group_config["bundles"] == [{"GPU": 1, "CPU": 2}]


def test_a_fractional_gpu_bundle_needs_each_engine_to_fit_its_share():
    share = {"bundles": [{"GPU": 0.5}]}
    with pytest.raises(ConfigError, match="gpu_memory_utilization to at most 0.5"):
        vLLMEngineProcessorConfig(model_source=MODEL, placement_group_config=share)
    with pytest.raises(ConfigError, match="0.9 is more than each replica's share"):
        vLLMEngineProcessorConfig(model_source=MODEL, placement_group_config=share,
                                  engine_kwargs={"gpu_memory_utilization": 0.9})
    with pytest.raises(ConfigError, match="takes whole GPUs"):
        vLLMEngineProcessorConfig(model_source=MODEL, placement_group_config=share,
                                  engine_kwargs={"gpu_memory_utilization": 0.4, "tensor_parallel_size": 2})
    ok = vLLMEngineProcessorConfig(model_source=MODEL, placement_group_config=share,
                                   engine_kwargs={"kv_cache_memory_bytes": 1 << 30})
    assert ok.gpu_share() == 0.5


def test_devices_per_replica():
    c = vLLMEngineProcessorConfig(model_source=MODEL, engine_kwargs={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert c.devices_per_replica() == 4


def test_http_config():
    c = HttpRequestProcessorConfig(url="http://localhost:8000/v1/chat/completions", qps=5, max_retries=2)
    assert c.base_retry_wait_time_in_s == 1.0 and c.batch_size == 64  # Ray's defaults
    assert c.max_concurrent_requests == 64 and c.resolved_max_concurrent_batches() == 2
    with pytest.raises(ConfigError):
        HttpRequestProcessorConfig(url="http://x", qps=0)
    with pytest.raises(ConfigError, match="must start with http"):
        HttpRequestProcessorConfig(url="localhost:8000")
    stage = HttpRequestProcessorConfig(url="http://x", http_request_stage={"num_cpus": 0.5, "concurrency": 3})
    assert isinstance(stage.http_request_stage, HttpRequestStageConfig) and stage.http_request_stage.num_cpus == 0.5
    with pytest.raises(ConfigError, match="cannot be disabled"):
        HttpRequestProcessorConfig(url="http://x", http_request_stage=False)


def test_http_keys_come_from_the_environment_and_never_show(monkeypatch):
    with pytest.raises(ConfigError, match="LLMBATCH_TEST_KEY .*is not set"):
        HttpRequestProcessorConfig(url="http://x", api_key_env="LLMBATCH_TEST_KEY")
    monkeypatch.setenv("LLMBATCH_TEST_KEY", "sk-test-0123456789")
    c = HttpRequestProcessorConfig(url="http://x", api_key_env="LLMBATCH_TEST_KEY",
                                   headers={"Authorization": "Bearer sk-literal-0123456789", "X-Team": "t"})
    shown = repr(c) + str(c)
    assert "sk-" not in shown and "LLMBATCH_TEST_KEY" in shown and "X-Team" in shown
    processor = build_processor(c)
    engine = processor.get_stage_by_name("engine").engine
    assert engine.headers["Authorization"].value == "Bearer sk-test-0123456789"  # api_key_env wins
    assert "sk-" not in repr(engine.headers)


def test_endpoint_processors_have_no_template_tokenizer_or_gpu():
    for config in (HttpRequestProcessorConfig(url="http://x", concurrency=3),
                   ServeDeploymentProcessorConfig(deployment_name="llm", app_name="app", concurrency=3)):
        processor = build_processor(config, preprocess=lambda r: r, postprocess=lambda r: r)
        assert processor.list_stage_names() == ["preprocess", "engine", "postprocess"]
        ops = processor.operators({"CPU": 64.0, "GPU": 8.0})
        assert [op.name for op in ops] == ["preprocess+engine+postprocess"]
        assert "num_gpus" not in ops[0].remote_args and ops[0].max_workers == 3
    ops = build_processor(HttpRequestProcessorConfig(url="http://x", http_request_stage={"num_cpus": 0.25})).operators()
    assert ops[0].remote_args["num_cpus"] == 0.25


def test_serve_and_deployment_configs():
    c = ServeDeploymentProcessorConfig(deployment_name="llm")
    assert c.app_name == "default" and c.request_timeout_s is None and c.should_continue_on_error is False
    with pytest.raises(ConfigError, match="deployment_name"):
        ServeDeploymentProcessorConfig(app_name="x")
    d = LLMConfig(model_loading_config={"model_id": "smol", "model_source": MODEL}, engine_kwargs={"max_model_len": 256})
    assert d.model_id() == "smol" and d.model_source() == MODEL
    with pytest.raises(ConfigError, match="unknown keys"):
        LLMConfig(model_loading_config={"model_id": "x", "model": MODEL})


def test_no_warning_for_modern_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vLLMEngineProcessorConfig(model_source=MODEL, chat_template_stage=True)


def test_field_docs_exist_for_every_field():
    for cls in (vLLMEngineProcessorConfig, ChatTemplateStageConfig, HttpRequestProcessorConfig,
                ServeDeploymentProcessorConfig, LLMConfig):
        docs = cls.field_docs()
        assert docs and all(docs.values()), [k for k, v in docs.items() if not v]


def test_configuration_reference_is_current():
    from pathlib import Path

    from llmbatch.jobs.reference import config_reference

    committed = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert committed.strip() == config_reference().strip(), "regenerate docs/configuration.md with llmbatch.jobs.reference.config_reference()"


def test_an_unknown_field_gets_the_one_did_you_mean_hint():
    """Every did-you-mean hint is worded by ``errors.suggestion``: the config's too."""
    with pytest.raises(ConfigError, match=r"unknown field 'batch_sise' \(did you mean 'batch_size'\?\)\."):
        vLLMEngineProcessorConfig(model_source=MODEL, batch_sise=3)
    with pytest.raises(ConfigError, match=r"unknown field 'zzzqqq'\. Known fields: accelerator_type, "):
        vLLMEngineProcessorConfig(model_source=MODEL, zzzqqq=3)
