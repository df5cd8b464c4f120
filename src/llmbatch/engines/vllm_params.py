"""Turning a row's request fields into vLLM's: sampling params, pooling params, structured
outputs, each validated so that a bad row fails alone, with the field named, before the
engine sees it."""

from __future__ import annotations

import array
import collections
import copy
import functools
import hashlib
import json
import logging
import re
import warnings
from typing import Any

from llmbatch.errors import RowValidationError, suggestion
from llmbatch.rows import to_python

logger = logging.getLogger(__name__)
_GUIDED_WARNED = False


_INT_PARAMS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL_PARAMS = ("ignore_eos", "detokenize", "skip_special_tokens", "include_stop_str_in_output",
                "spaces_between_special_tokens")


def check_types(sp: dict[str, Any]) -> None:
    """Wrong types fail the row here, with the field named (vLLM would fail deep in a batch)."""
    for key, value in sp.items():
        if key in _INT_PARAMS and (isinstance(value, bool) or not isinstance(value, int)):
            raise RowValidationError(f"sampling param '{key}' must be an integer, got {value!r}")
        if key in _FLOAT_PARAMS and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RowValidationError(f"sampling param '{key}' must be a number, got {value!r}")
        if key in _BOOL_PARAMS and not isinstance(value, bool):
            raise RowValidationError(f"sampling param '{key}' must be true or false, got {value!r}")
    stop = sp.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))):
        raise RowValidationError(f"sampling param 'stop' must be a string or a list of strings, got {stop!r}")
    ids = sp.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in ids)):
        raise RowValidationError(f"sampling param 'stop_token_ids' must be a list of integers, got {ids!r}")


def request_digest(prompt: list[int] | str, canonical: Any, lora: str | None) -> bytes:
    """A 16-byte digest that identical requests share (prompt, sampling params, adapter)."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(prompt, str):
        h.update(b"t" + prompt.encode("utf-8", "surrogatepass"))
    else:
        h.update(b"i" + array.array("q", prompt).tobytes())
    h.update(b"\0" + json.dumps(canonical, sort_keys=True, default=str).encode())
    h.update(b"\0" + (lora or "").encode())
    return h.digest()


def validate_structured(spec: dict[str, Any]) -> dict[str, Any]:
    """Check a structured-output spec's json schema, regex and choice list (any engine); a
    JSON schema given as a string comes back parsed."""
    spec = dict(spec)
    if "json" in spec:
        schema = spec["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RowValidationError(f"structured_outputs.json is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise RowValidationError("structured_outputs.json must be a JSON schema object")
        import jsonschema

        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise RowValidationError(f"structured_outputs.json is not a valid JSON schema: {exc.message}") from exc
        except (TypeError, AttributeError) as exc:  # a schema the validator cannot walk
            raise RowValidationError(f"structured_outputs.json is not a valid JSON schema: {exc}") from exc
        spec["json"] = schema
    if "regex" in spec:
        try:
            re.compile(spec["regex"])
        except (re.error, TypeError) as exc:
            raise RowValidationError(f"structured_outputs.regex is not a valid regular expression: {exc}") from exc
    if "choice" in spec:
        choice = spec["choice"]
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
            raise RowValidationError("structured_outputs.choice must be a non-empty list of strings")
    return spec


def structured_outputs(spec: Any):
    from vllm.sampling_params import StructuredOutputsParams

    if isinstance(spec, StructuredOutputsParams):
        return spec
    if not isinstance(spec, dict):
        raise RowValidationError(f"structured_outputs must be a dict (e.g. {{'choice': [...]}}), got {type(spec).__name__}")
    spec = {k: v for k, v in spec.items() if v is not None}
    spec.pop("backend", None)  # legacy guided_decoding field; the engine picks the backend
    known = [f for f in StructuredOutputsParams.__dataclass_fields__ if not f.startswith("_")]
    for key in spec:
        if key not in known:
            raise RowValidationError(f"unknown structured_outputs key '{key}'{suggestion(key, known)}; known: {', '.join(known)}")
    spec = validate_structured(spec)
    try:
        return StructuredOutputsParams(**spec)
    except Exception as exc:  # noqa: BLE001
        raise RowValidationError(f"invalid structured_outputs: {exc}") from exc

def row_sampling_params(raw: Any) -> tuple[dict[str, Any], Any]:
    """A row's sampling params as plain values without unset ones, and its structured-output
    spec apart (``guided_decoding``, the old name, accepted with a warning), for any engine."""
    global _GUIDED_WARNED
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RowValidationError(f"sampling_params must be a dict, got {type(raw).__name__}")
    sp = {k: v for k, v in to_python(raw).items() if v is not None}
    if "guided_decoding" in sp:
        if not _GUIDED_WARNED:
            warnings.warn("sampling_params.guided_decoding is deprecated; use structured_outputs", DeprecationWarning, stacklevel=2)
            logger.warning("sampling_params.guided_decoding is deprecated; use structured_outputs")
            _GUIDED_WARNED = True
        if "structured_outputs" in sp:
            raise RowValidationError("sampling_params has both guided_decoding and structured_outputs; keep structured_outputs")
        sp["structured_outputs"] = sp.pop("guided_decoding")
    return sp, sp.pop("structured_outputs", None)


#: SamplingParams built for recent distinct sampling settings (rows of a job share a handful):
#: building and validating one took about as long as the rest of a row's CPU work
_PARAMS_MEMO: collections.OrderedDict[tuple, tuple[Any, dict[str, Any]]] = collections.OrderedDict()
_PARAMS_MEMO_SIZE = 1024


@functools.cache
def _vllm_params_types() -> tuple[Any, Any]:
    """vLLM's SamplingParams and RequestOutputKind, imported once (``from vllm import ...`` in
    a function goes through vLLM's lazy module attribute and the import system on every call)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams, RequestOutputKind


def sampling_params(raw: Any, max_model_len: int | None = None, detokenize_after: bool = False):
    """A row's vLLM SamplingParams (checked: unknown names, types, max_tokens against the
    context) and its canonical dict (the dedup key's part); the same settings again give a copy
    of the params built the first time."""
    sp, so = row_sampling_params(raw)
    memo = None
    if so is None:
        try:
            memo = (json.dumps(sp, sort_keys=True), max_model_len, detokenize_after)
        except (TypeError, ValueError):
            memo = None
        hit = _PARAMS_MEMO.get(memo) if memo is not None else None
        if hit is not None:
            return copy.copy(hit[0]), dict(hit[1])
    params, canonical = _build_sampling_params(sp, so, max_model_len, detokenize_after)
    if memo is not None:
        _PARAMS_MEMO[memo] = (copy.copy(params), dict(canonical))
        if len(_PARAMS_MEMO) > _PARAMS_MEMO_SIZE:
            _PARAMS_MEMO.popitem(last=False)
    return params, canonical


def _build_sampling_params(sp: dict[str, Any], so: Any, max_model_len: int | None, detokenize_after: bool):
    SamplingParams, RequestOutputKind = _vllm_params_types()
    sp.pop("truncate_prompt_tokens", None)  # applied by the tokenize stage
    known = [f for f in SamplingParams.__struct_fields__ if not f.startswith("_")]
    for key in sp:
        if key not in known or key == "output_kind":
            raise RowValidationError(f"unknown sampling param '{key}'{suggestion(key, known)}")
    check_types(sp)
    if so is not None:
        sp["structured_outputs"] = structured_outputs(so)
        so = {k: v for k, v in vars(sp["structured_outputs"]).items() if not k.startswith("_") and v not in (None, False)}
    try:
        params = SamplingParams(**sp)
    except Exception as exc:  # noqa: BLE001 - vLLM's own validation message names the field
        raise RowValidationError(f"invalid sampling_params: {exc}") from exc
    if max_model_len is not None and params.max_tokens is not None and params.max_tokens >= max_model_len:
        raise RowValidationError(
            f"max_tokens={params.max_tokens} cannot fit: max_model_len is {max_model_len}; lower max_tokens "
            f"or raise engine_kwargs.max_model_len"
        )
    params.output_kind = RequestOutputKind.FINAL_ONLY
    if (detokenize_after and "detokenize" not in sp and so is None and not params.stop
            and params.logprobs is None and params.prompt_logprobs is None):
        params.detokenize = False
    return params, {**sp, "structured_outputs": so} if so else sp

def pair_tokens(row: dict[str, Any], pair: tuple[str, str], tokenizer: Any, cross_encoder: bool) -> None:
    """A scoring pair's token ids into ``row``: one input with token type ids for a
    cross-encoder (as sentence-transformers and vLLM's own scoring build it), one input per
    text for a bi-encoder."""
    if cross_encoder:
        enc = tokenizer(pair[0], pair[1], add_special_tokens=True)
        row["tokenized_prompt"] = list(enc["input_ids"])
        if enc.get("token_type_ids") is not None:
            row["token_type_ids"] = list(enc["token_type_ids"])
    else:
        row["tokenized_prompt"] = list(tokenizer(pair[0], add_special_tokens=True)["input_ids"])
        row["tokenized_prompt_2"] = list(tokenizer(pair[1], add_special_tokens=True)["input_ids"])


def logprobs_rows(entries) -> list[list[dict[str, Any]]] | None:
    """vLLM logprobs (one {token_id: Logprob} per position) as Arrow-friendly lists."""
    if entries is None:
        return None
    out = []
    for position in entries:
        if position is None:
            out.append([])
            continue
        out.append([
            {"token_id": int(tid), "logprob": float(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in position.items()
        ])
    return out


def completion_row(completion) -> dict[str, Any]:
    """One of a request's ``n`` answers, with what OpenAI's response shows of it."""
    return {"index": completion.index, "text": completion.text, "finish_reason": completion.finish_reason or "",
            "stop_reason": completion.stop_reason, "num_tokens": len(completion.token_ids),
            "token_ids": list(completion.token_ids), "logprobs": logprobs_rows(completion.logprobs)}
