"""Turning a row's request fields into SGLang's, and SGLang's answer into the row contract.

Rows carry vLLM's sampling-param names (the row contract), so a job switches engines by
changing its config class: ``max_tokens`` becomes SGLang's ``max_new_tokens``, ``seed``
``sampling_seed``, ``structured_outputs`` SGLang's ``json_schema`` / ``regex`` / ``ebnf``
(a ``choice`` is a regex of its alternatives). SGLang's own names, as Ray's SGLang stage
passes them, work too. A param SGLang cannot honour fails the row, with the param named,
before the engine sees it. Nothing here imports SGLang: these are pure functions.
"""

from __future__ import annotations

import json
from typing import Any

from llmbatch.errors import RowValidationError, suggestion
from llmbatch.params import check_types, row_sampling_params, validate_structured
from llmbatch.rows import to_python

#: vLLM's default ``max_tokens``; SGLang's own default (128) would change a row's answer
#: when a job switches engines, so rows without ``max_tokens`` get vLLM's.
DEFAULT_MAX_TOKENS = 16
#: vLLM name -> SGLang name, where they differ.
RENAMED = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed",
           "include_stop_str_in_output": "no_stop_trim"}
#: Names both engines share.
SHARED = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
          "spaces_between_special_tokens", "logit_bias", "stream_interval")
#: SGLang's own names (``sglang.srt.sampling.sampling_params.SamplingParams``, 0.5.17).
NATIVE = ("max_new_tokens", "min_new_tokens", "sampling_seed", "no_stop_trim", "stop_regex", "json_schema", "regex",
          "ebnf", "structural_tag", "custom_params")
#: vLLM params that SGLang has no equivalent for (or llmbatch does not map yet), with what to do.
UNSUPPORTED = {
    "logprobs": "logprobs are not returned by llmbatch's SGLang engine yet; use vLLMEngineProcessorConfig",
    "prompt_logprobs": "prompt logprobs are not returned by llmbatch's SGLang engine yet; use vLLMEngineProcessorConfig",
    "bad_words": "SGLang has no bad_words; use logit_bias or a regex in structured_outputs",
    "allowed_token_ids": "SGLang has no allowed_token_ids; use structured_outputs",
}
#: llmbatch's own keys that only steer vLLM, dropped here.
IGNORED = ("detokenize", "truncate_prompt_tokens")
_NATIVE_INTS = ("max_new_tokens", "min_new_tokens", "sampling_seed")
#: structured_outputs key -> how SGLang takes it.
_STRUCTURED = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: Characters that mean something in a regex; escaped in a choice's alternatives.
_REGEX_SPECIAL = set("\\.^$*+?{}[]|()/")


def choice_regex(choices: list[str]) -> str:
    """A regex that matches exactly one of ``choices`` (SGLang's grammar backends take regexes
    with the usual escapes; only the metacharacters are escaped)."""
    alternatives = ["".join("\\" + c if c in _REGEX_SPECIAL else c for c in choice) for choice in choices]
    return "(" + "|".join(alternatives) + ")"


def structured_params(spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SGLang sampling params, the spec as llmbatch checks answers against it) for a row's
    ``structured_outputs`` (vLLM's names: json, regex, choice, grammar, json_object, structural_tag)."""
    if not isinstance(spec, dict):
        raise RowValidationError(f"structured_outputs must be a dict (e.g. {{'choice': [...]}}), got {type(spec).__name__}")
    spec = {k: v for k, v in to_python(spec).items() if v is not None and v is not False}
    spec.pop("backend", None)  # legacy guided_decoding field; the engine picks the backend
    for key in spec:
        if key not in _STRUCTURED:
            raise RowValidationError(f"structured_outputs key '{key}' is not supported by the SGLang engine"
                                     f"{suggestion(key, list(_STRUCTURED))}; supported: {', '.join(_STRUCTURED)}")
    if len(spec) != 1:
        raise RowValidationError(f"structured_outputs takes exactly one of {', '.join(_STRUCTURED)}; got {sorted(spec) or 'none'}")
    spec = validate_structured(spec)
    key, value = next(iter(spec.items()))
    if key == "json":
        return {"json_schema": json.dumps(value)}, spec
    if key == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}, spec
    if key == "regex":
        return {"regex": value}, spec
    if key == "choice":
        return {"regex": choice_regex(value)}, spec
    if key == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise RowValidationError("structured_outputs.grammar must be a non-empty EBNF grammar string")
        return {"ebnf": value}, spec
    tag = value if isinstance(value, str) else json.dumps(value)
    return {"structural_tag": tag}, spec


def sampling_params(raw: Any, context_len: int | None = None,
                    tokenizer_in_engine: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(SGLang sampling params, the structured-output spec to check answers against or None).

    Raises :class:`RowValidationError` naming the param for anything SGLang would not honour.
    """
    sp, so = row_sampling_params(raw)
    for key in IGNORED:
        sp.pop(key, None)
    known = list(RENAMED) + list(SHARED) + list(NATIVE) + ["structured_outputs"]
    for key in sp:
        if key in UNSUPPORTED:
            raise RowValidationError(f"sampling param '{key}': {UNSUPPORTED[key]}")
        if key not in known:
            raise RowValidationError(f"sampling param '{key}' is not supported by the SGLang engine{suggestion(key, known)}")
    check_types(sp)
    for key in _NATIVE_INTS:
        if key in sp and (isinstance(sp[key], bool) or not isinstance(sp[key], int)):
            raise RowValidationError(f"sampling param '{key}' must be an integer, got {sp[key]!r}")
    out: dict[str, Any] = {}
    for key, value in sp.items():
        name = RENAMED.get(key, key)
        if name in out:
            raise RowValidationError(f"sampling params '{key}' and '{name}' are the same setting; keep one")
        out[name] = value
    out.setdefault("max_new_tokens", DEFAULT_MAX_TOKENS)
    if out.get("n", 1) != 1:
        raise RowValidationError("sampling param 'n' must be 1 with the SGLang engine (one answer per row)")
    if out.get("top_k") == 0:
        out["top_k"] = -1  # vLLM's "no top-k"; SGLang spells it -1
    if "logit_bias" in out:
        bias = out["logit_bias"]
        if not isinstance(bias, dict):
            raise RowValidationError(f"sampling param 'logit_bias' must be a dict of token id -> bias, got {bias!r}")
        out["logit_bias"] = {str(k): float(v) for k, v in bias.items()}
    if out.get("max_new_tokens", 0) < 1:
        raise RowValidationError(f"max_tokens must be at least 1, got {out['max_new_tokens']}")
    if context_len is not None and out["max_new_tokens"] >= context_len:
        raise RowValidationError(f"max_tokens={out['max_new_tokens']} cannot fit: the model's context is {context_len} "
                                 "tokens; lower max_tokens or raise engine_kwargs.context_length")
    check = None
    native = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if k in out]
    if so is not None:
        if native:
            raise RowValidationError(f"sampling_params has both structured_outputs and SGLang's '{native[0]}'; keep one")
        params, check = structured_params(so)
        out.update(params)
    elif len(native) > 1:
        raise RowValidationError(f"sampling_params may constrain the answer one way only; got {', '.join(native)}")
    elif native and native[0] in ("json_schema", "regex"):
        value = out[native[0]]
        check = validate_structured({"json" if native[0] == "json_schema" else "regex":
                                     json.loads(value) if native[0] == "json_schema" and isinstance(value, str) else value})
        if native[0] == "json_schema" and not isinstance(value, str):
            out["json_schema"] = json.dumps(value)
    if not tokenizer_in_engine:
        needs = [k for k in ("json_schema", "regex", "ebnf", "structural_tag", "stop", "stop_regex") if out.get(k)]
        if needs:
            raise RowValidationError(f"sampling param '{needs[0]}' needs SGLang's tokenizer, but the engine runs with "
                                     "engine_kwargs.skip_tokenizer_init=True; leave skip_tokenizer_init out")
    return out, check


def finish_reason(meta: dict[str, Any]) -> str:
    """SGLang's finish reason ({"type": "stop" | "length" | "abort", ...}) as vLLM names it."""
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        return str(reason.get("type") or "")
    return str(reason or "")


def output_columns(out: dict[str, Any], prompt_ids: list[int] | None) -> dict[str, Any]:
    """The row contract's output columns from one finished SGLang answer (the dict that
    ``Engine.async_generate`` returns: ``text``, ``output_ids``, ``meta_info``).

    An aborted request (SGLang's "abort" finish reason: a bad request, an out-of-memory
    retraction that gave up) raises, so the row becomes an error row with SGLang's message."""
    meta = out.get("meta_info") or {}
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise RuntimeError(f"SGLang aborted the request: {reason.get('message') or 'no reason given'}")
    tokens = [int(t) for t in (out.get("output_ids") or [])]
    prompt_tokens = meta.get("prompt_tokens")
    return {
        "generated_text": out.get("text") or "",
        "generated_tokens": tokens,
        "num_input_tokens": int(prompt_tokens if prompt_tokens is not None else len(prompt_ids or [])),
        "num_generated_tokens": int(meta.get("completion_tokens", len(tokens))),
        "finish_reason": finish_reason(meta),
        "num_cached_tokens": int(meta.get("cached_tokens") or 0),
    }


#: vLLM engine arguments and their SGLang names (``ServerArgs``), so that a config written for
#: vLLM runs on SGLang by changing its class.
ENGINE_RENAMED = {"max_model_len": "context_length", "gpu_memory_utilization": "mem_fraction_static",
                  "max_num_seqs": "max_running_requests", "tensor_parallel_size": "tp_size",
                  "pipeline_parallel_size": "pp_size", "data_parallel_size": "dp_size", "seed": "random_seed",
                  "enforce_eager": "disable_cuda_graph"}
#: vLLM settings that only steer vLLM's logging: nothing to do on SGLang.
ENGINE_DROPPED = ("disable_log_stats", "enable_log_requests")
#: vLLM settings with no SGLang equivalent that llmbatch maps.
ENGINE_VLLM_ONLY = ("enable_chunked_prefill", "swap_space", "distributed_executor_backend", "compilation_config",
                    "kv_cache_memory_bytes", "block_size", "cpu_offload_gb", "max_num_batched_tokens", "enable_lora",
                    "max_lora_rank", "max_loras", "max_cpu_loras", "runner", "convert", "max_logprobs",
                    "limit_mm_per_prompt", "mm_processor_kwargs", "allowed_local_media_path", "allowed_media_domains")


def engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` in SGLang's names: vLLM's names mapped (``max_model_len`` ->
    ``context_length``, ``gpu_memory_utilization`` -> ``mem_fraction_static``, ``tensor_parallel_size``
    -> ``tp_size``...; ``enable_prefix_caching=False`` -> ``disable_radix_cache=True``), SGLang's
    own kept; raises ValueError for a vLLM-only setting or one given under both names."""
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}

    def put(name: str, value: Any, given: str) -> None:
        if name in out and out[name] != value:
            raise ValueError(f"engine_kwargs sets SGLang's '{name}' twice, as '{given_as[name]}' and as '{given}', "
                             "with different values; keep one")
        out[name] = value
        given_as[name] = given

    for key, value in kwargs.items():
        if key in ENGINE_DROPPED:
            continue
        if key in ENGINE_VLLM_ONLY:
            raise ValueError(f"engine_kwargs.{key} is a vLLM setting that the SGLang engine has no equivalent for; "
                             "remove it (engine_kwargs go to sglang.Engine: its ServerArgs names)")
        if key == "enable_prefix_caching":
            put("disable_radix_cache", not value, key)
        else:
            put(ENGINE_RENAMED.get(key, key), value, key)
    return out
