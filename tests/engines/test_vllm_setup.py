"""The engine arguments llmbatch hands vLLM."""

from __future__ import annotations

import pytest

from llmbatch.engines.settings import VLLMSettings
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
    ours_kwargs = engine_arguments(str(smollm2), settings, "generate")
    same = {"dtype": ours_kwargs["dtype"]} if "dtype" in ours_kwargs else {}  # a CPU without native bf16
    plain = vllm.EngineArgs(model=str(smollm2), **settings, **same).create_engine_config(UsageContext.LLM_CLASS)
    ours = vllm.AsyncEngineArgs(**ours_kwargs).create_engine_config(UsageContext.LLM_CLASS)
    assert ours.compute_hash() == plain.compute_hash()


def test_on_a_cpu_without_native_bfloat16_a_small_model_runs_in_float32(smollm2, monkeypatch):
    from llmbatch.engines import vllm_setup

    monkeypatch.setattr(vllm_setup, "on_cpu", lambda: True)
    monkeypatch.setattr(vllm_setup, "native_bf16", lambda: False)
    assert engine_arguments(str(smollm2), {}, "generate")["dtype"] == "float32"
    assert engine_arguments(str(smollm2), {"dtype": "bfloat16"}, "generate")["dtype"] == "bfloat16"  # the user's
    assert "dtype" not in engine_arguments("HuggingFaceTB/not-local", {}, "generate")  # size unknown: vLLM's
    monkeypatch.setattr(vllm_setup, "FLOAT32_MEMORY_SHARE", 1e-9)  # weights that would not fit: vLLM's
    assert "dtype" not in engine_arguments(str(smollm2), {}, "generate")
    monkeypatch.setattr(vllm_setup, "FLOAT32_MEMORY_SHARE", 0.25)
    monkeypatch.setattr(vllm_setup, "native_bf16", lambda: True)
    assert "dtype" not in engine_arguments(str(smollm2), {}, "generate")


def test_generating_with_an_embedding_model_fails_at_start_saying_what_to_set(minilm):
    import asyncio

    from llmbatch.engines.vllm import VLLMEngine
    from llmbatch.errors import EngineStartError

    engine = VLLMEngine(VLLMSettings(model_source=str(minilm), engine_kwargs={}, task_type="generate"))
    with pytest.raises(EngineStartError, match=r"is a pooling model .*set task_type='embed'"):
        asyncio.run(engine.start())
    assert engine.llm is None  # the engine it had started is closed


def test_an_engine_process_that_fails_to_start_gives_its_own_reason(smollm2, tmp_path, monkeypatch):
    """vLLM's front-end says only "Engine core initialization failed. See root cause above.";
    the engine process's own exception, from the engine log, leads the error (here vLLM's CPU
    build refusing Ray's executor, which fails before the model loads).

    The temp dir is deep (a scheduler's per-job scratch): vLLM names its IPC sockets
    ``{temp dir}/{uuid4}``, past the 107 bytes a socket's path may have, and its front-end failed
    with ZMQError before the engine process ran (leaving a ZeroMQ context whose clean-up blocked
    the next garbage collection for ever). They now go to /tmp, and the engine process runs."""
    import asyncio
    import os
    import tempfile

    from llmbatch.engines.vllm import VLLMEngine
    from llmbatch.engines.vllm_setup import IPC_NAME_LEN
    from llmbatch.errors import EngineStartError

    deep = tmp_path / ("scratch-" + "d" * 60)
    deep.mkdir()
    assert len(str(deep)) + IPC_NAME_LEN > 107
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)  # (put back as it was after the test)
    engine = VLLMEngine(VLLMSettings(model_source=str(smollm2), task_type="generate",
                                     engine_kwargs={"max_model_len": 256, "distributed_executor_backend": "ray"}))
    try:
        with pytest.raises(EngineStartError) as failed:
            asyncio.run(engine.start())
        said = str(failed.value)
        assert said.startswith(f"vLLM could not start model '{smollm2}'"), said
        assert "ValueError: current platform cpu does not support ray. (vLLM: " in said, said
        assert "Engine core initialization failed" in said and engine.log.path in said, said
        assert os.environ["VLLM_RPC_BASE_PATH"] == "/tmp"  # (the engine log goes to Ray's logs where Ray is up)
    finally:
        if engine.log is not None:
            engine.log.fh.close()
            os.unlink(engine.log.path)


def test_in_a_ray_actor_the_engine_process_comes_from_the_warm_fork_server(ray_cluster, smollm2):
    """A replica's vLLM engine process is forked from llmbatch's fork server (which imported
    vLLM beside the replica), not spawned afresh, and answers as usual. It starts before the
    front-end is built: ``AsyncLLM`` loads the tokenizer and the processor first and only then
    starts its engine; here, while the front-end builds, the engine process is already there.
    A front-end that fails after the engine has started stops that engine too."""
    import ray

    @ray.remote(num_cpus=0)
    class Replica:
        async def start_and_ask(self, model: str):
            import time

            import psutil
            from vllm.v1.engine import async_llm

            from llmbatch.engines.vllm import VLLMEngine
            from llmbatch.errors import EngineStartError

            def engine_processes():
                return [p for p in psutil.Process().children(recursive=True) if p.name() == "VLLM::EngineCore"]

            seen = {}
            own = async_llm.renderer_from_config

            def renderer_from_config(*args, **kwargs):  # the front-end's first step: is the engine there?
                # (it comes once the fork server has imported vLLM: on 2 busy cores, up to a minute)
                deadline = time.monotonic() + 180
                while not engine_processes() and time.monotonic() < deadline:
                    time.sleep(0.1)
                seen.setdefault("engine_before_front_end", []).append(bool(engine_processes()))
                if len(seen["engine_before_front_end"]) == 1:
                    raise OSError("the tokenizer could not be read")
                return own(*args, **kwargs)

            async_llm.renderer_from_config = renderer_from_config
            settings = {"max_model_len": 256, "kv_cache_memory_bytes": 256 << 20}
            try:
                failed = VLLMEngine(VLLMSettings(model_source=model, engine_kwargs=settings))
                try:
                    await failed.start()
                except EngineStartError as exc:
                    seen["first_start"] = str(exc)
                time.sleep(1)
                seen["engines_left_after_it"] = len(engine_processes())
                engine = VLLMEngine(VLLMSettings(model_source=model, engine_kwargs=settings))
                await engine.start()
            finally:
                async_llm.renderer_from_config = own
            try:
                parents = [" ".join(p.parent().cmdline()) for p in engine_processes()]
                row = {"prompt": "The capital of France is", "sampling_params": {"max_tokens": 4, "temperature": 0}}
                answer = await engine.run(engine.build_request(row))
            finally:
                await engine.close()
            return parents, answer["generated_text"], seen

    parents, text, seen = ray.get(Replica.remote().start_and_ask.remote(smollm2), timeout=900)
    assert parents and all("multiprocessing.forkserver" in p for p in parents), parents
    assert text.strip()
    assert seen["engine_before_front_end"] == [True, True]
    assert "the tokenizer could not be read" in seen["first_start"]
    assert seen["engines_left_after_it"] == 0


def test_a_warm_engine_serves_runs_that_ask_for_its_defaults_and_more_replicas_where_they_do_not_size_it(monkeypatch):
    from llmbatch.engines.vllm import VLLMEngine
    from llmbatch.engines.vllm_setup import KV_BYTES_ENV

    def key(gpu=False, concurrency=1, task="generate", detokenize=False, **kwargs):
        settings = VLLMSettings("m", kwargs, task_type=task, concurrency=concurrency, detokenize_stage=detokenize)
        return VLLMEngine(settings).warm_key(gpu=gpu)

    monkeypatch.delenv(KV_BYTES_ENV, raising=False)
    # a CPU: enforce_eager is llmbatch's default there; the replicas size the default KV cache
    assert key(max_model_len=512) == key(max_model_len=512, enforce_eager=True) != key(max_model_len=512, enforce_eager=False)
    assert key(max_model_len=512) != key(max_model_len=512, concurrency=2)
    assert key(kv_cache_memory_bytes=1 << 28) == key(kv_cache_memory_bytes=1 << 28, concurrency=2)
    monkeypatch.setenv(KV_BYTES_ENV, str(1 << 28))  # the KV cache fixed for every engine of the machine
    assert key() == key(kv_cache_memory_bytes=1 << 28) == key(concurrency=2) != key(kv_cache_memory_bytes=1 << 29)
    # a GPU: no CPU defaults, and the replicas never change an engine's arguments
    assert key(gpu=True) == key(gpu=True, concurrency=4) != key(gpu=True, enforce_eager=True)
    assert key(gpu=True) != key()
    # the detokenize stage changes the engine's front-end for generation only
    assert key(detokenize=True) != key() and key(task="embed", detokenize=True) == key(task="embed")


def test_a_warm_engine_serves_runs_whose_media_policy_differs():
    """Which media rows may name (allowed_local_media_path, allowed_media_domains) is the run's
    own prepare-multimodal stage's, shipped with each lease: the engine gets decoded media only."""
    from llmbatch.engines.vllm import VLLMEngine

    def key(**kwargs):
        return VLLMEngine(VLLMSettings("m", {"max_model_len": 512, **kwargs})).warm_key()

    assert key() == key(allowed_local_media_path="/srv/a") == key(allowed_local_media_path="/srv/b") \
        == key(allowed_media_domains=["example.com"])
    assert key() != key(limit_mm_per_prompt={"image": 2})


def test_begin_imports_what_the_engine_start_shares_with_the_tokenizer_stages_before_they_run_side_by_side():
    """The replica's runner starts the engine on one thread and the tokenizer stages on another
    after every stage's begin(); modules both import must be imported before, by begin()
    (a half-imported transformers module failed a replica's start: "cannot import name
    'PreTrainedConfig'"). In a fresh interpreter, so that nothing imported them already."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from llmbatch.engines.settings import VLLMSettings\n"
        "from llmbatch.engines.vllm import VLLMEngine\n"
        "shared = ('vllm.engine.arg_utils', 'transformers.configuration_utils', 'transformers.tokenization_utils_base')\n"
        "assert not any(m in sys.modules for m in shared), [m for m in shared if m in sys.modules]\n"
        "VLLMEngine(VLLMSettings(model_source='m', engine_kwargs={})).begin()\n"
        "missing = [m for m in shared if m not in sys.modules]\n"
        "assert not missing, missing\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
