"""What each engine reads from its processor config, under the config's own field names.

A builder (:mod:`llmbatch.builders`) makes one settings object per engine from the config,
once; the engine reads it and nothing else, so a setting keeps its name and meaning from the
config the user wrote to the engine that uses it. :class:`EngineKwargs` is the one typed view
of the ``engine_kwargs`` keys llmbatch itself reads (the others go to the engine as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmbatch.models import model_max_len, resolve_model


class EngineKwargs(dict):
    """``engine_kwargs`` as given (passed to the engine as they are), with the keys llmbatch
    reads itself as typed properties. SGLang's names (``context_length``, ``tp_size``...) are
    read where the SGLang config has mapped vLLM's to them."""

    @property
    def max_model_len(self) -> int | None:
        """The context length the user set (vLLM's ``max_model_len``, SGLang's ``context_length``);
        None: the model's own (:func:`max_model_len`)."""
        value = self.get("max_model_len", self.get("context_length"))
        return int(value) if value else None

    @property
    def trust_remote_code(self) -> bool:
        return bool(self.get("trust_remote_code", False))

    @property
    def allowed_local_media_path(self) -> str | None:
        return self.get("allowed_local_media_path")

    @property
    def allowed_media_domains(self) -> list[str] | None:
        return self.get("allowed_media_domains")

    @property
    def skip_tokenizer_init(self) -> bool:
        return bool(self.get("skip_tokenizer_init", False))

    def devices(self) -> int:
        """GPUs one engine needs: tensor x pipeline parallel (x data parallel, SGLang's names)."""
        if any(k in self for k in ("tp_size", "pp_size", "dp_size")):
            return int(self.get("tp_size", 1)) * int(self.get("pp_size", 1)) * int(self.get("dp_size", 1))
        return int(self.get("tensor_parallel_size", 1)) * int(self.get("pipeline_parallel_size", 1))

    def single_process(self) -> bool:
        """Whether the engine runs in one engine process (no tensor, pipeline or data parallel)."""
        return all(int(self.get(key) or 1) == 1
                   for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))


def max_model_len(model_source: str, engine_kwargs: EngineKwargs) -> int | None:
    """The one context length of an engine and the stages before it: the user's
    (``engine_kwargs``), else the engine model's own (its config, read as vLLM reads it:
    :func:`~llmbatch.models.model_max_len`). The tokenize stage checks prompts against it and
    the vLLM engine is started with it, so the two never disagree (a tokenizer taken from
    another model, or a sentence-transformers model whose own limit is below its config's,
    gave them different numbers). Runs in the worker: it may resolve the model."""
    return engine_kwargs.max_model_len or model_max_len(resolve_model(model_source))


@dataclass(frozen=True)
class VLLMSettings:
    """The vLLM engine's settings (``vLLMEngineProcessorConfig``'s fields)."""

    model_source: str
    engine_kwargs: EngineKwargs
    task_type: str = "generate"
    dynamic_lora_loading_path: str | None = None
    #: the processor's replicas: on a CPU each sizes its KV cache for all of them on one node
    concurrency: int | tuple[int, int] = 1
    #: whether the detokenize stage runs (then the engine's front-end skips incremental detokenizing)
    detokenize_stage: bool = False
    log_engine_metrics: bool = False

    def __post_init__(self):
        object.__setattr__(self, "engine_kwargs", EngineKwargs(self.engine_kwargs))

    def max_replicas(self) -> int:
        """The most replicas the processor runs (``concurrency``, or its max)."""
        return self.concurrency if isinstance(self.concurrency, int) else self.concurrency[1]


@dataclass(frozen=True)
class SGLangSettings:
    """The SGLang engine's settings (``SGLangEngineProcessorConfig``'s fields)."""

    model_source: str
    engine_kwargs: EngineKwargs
    task_type: str = "generate"

    def __post_init__(self):
        object.__setattr__(self, "engine_kwargs", EngineKwargs(self.engine_kwargs))


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP engine's settings (``HttpRequestProcessorConfig``'s fields; ``headers`` with the
    key from ``api_key_env``, secret values as :class:`~llmbatch.redact.Secret`)."""

    url: str
    headers: dict[str, Any] | None = None
    model: str | None = None
    qps: float | None = None
    tokens_per_minute: int | None = None
    max_retries: int = 5
    base_retry_wait_time_in_s: float = 1.0
    max_concurrent_requests: int = 64
    request_timeout_s: float = 600.0
    dedup_requests: bool = True
    structured_output_fields: str = "auto"
    session_factory: Any = None


@dataclass(frozen=True)
class ServeSettings:
    """The Ray Serve engine's settings (``ServeDeploymentProcessorConfig``'s fields)."""

    deployment_name: str
    app_name: str = "default"
    dtype_mapping: dict[str, Any] | None = None
    request_timeout_s: float | None = None
    model: str | None = None
    max_concurrent_requests: int = 64
    dedup_requests: bool = True
    structured_output_fields: str = "auto"
