"""The engine arguments llmbatch hands vLLM."""

from __future__ import annotations

import pytest

from llmbatch.engines.vllm_setup import engine_arguments


def test_generation_keeps_vllms_auto_runner():
    kwargs = engine_arguments("/m", {"max_num_seqs": 8}, "generate")
    assert "runner" not in kwargs and "convert" not in kwargs
    assert kwargs["model"] == "/m" and kwargs["max_num_seqs"] == 8


def test_a_runner_the_user_names_is_kept():
    assert engine_arguments("/m", {"runner": "generate"}, "generate")["runner"] == "generate"


def test_the_compile_cache_key_is_vllms_own(smollm2):
    """The config hash (part of vLLM's torch.compile cache key) of llmbatch's engine equals that
    of ``vllm.LLM`` with the same settings, so one warms the compile cache for the other."""
    import vllm
    from vllm.usage.usage_lib import UsageContext

    settings = {"max_model_len": 1024, "max_num_seqs": 64, "max_num_batched_tokens": 4096,
                "enable_prefix_caching": True, "enforce_eager": False, "kv_cache_memory_bytes": 1 << 30}
    plain = vllm.EngineArgs(model=str(smollm2), **settings).create_engine_config(UsageContext.LLM_CLASS)
    ours = vllm.AsyncEngineArgs(**engine_arguments(str(smollm2), settings, "generate")).create_engine_config(
        UsageContext.LLM_CLASS)
    assert ours.compute_hash() == plain.compute_hash()


def test_generating_with_an_embedding_model_fails_at_start_saying_what_to_set(minilm):
    import asyncio

    from llmbatch.engines.vllm import VLLMEngine
    from llmbatch.errors import EngineStartError

    engine = VLLMEngine(model_source=str(minilm), engine_kwargs={}, task_type="generate")
    with pytest.raises(EngineStartError, match=r"is a pooling model .*set task_type='embed'"):
        asyncio.run(engine.start())
    assert engine.llm is None  # the engine it had started is closed
