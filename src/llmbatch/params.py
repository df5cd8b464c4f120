"""The engine-neutral checks of a row's request fields, for every engine and the OpenAI client:
the types of its sampling params, its structured-output spec (keys, JSON schema, regex,
choices), and its ``sampling_params`` read as plain values (the old ``guided_decoding`` name
accepted with a warning). A bad row fails here, alone, with the field named, before any engine
sees it; each engine then maps the checked fields to its own (``engines/vllm_params``,
``engines/sglang_params``, ``openai/client``).
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from typing import Any

from llmbatch.errors import RowValidationError, suggestion
from llmbatch.rows import to_python

logger = logging.getLogger(__name__)
_GUIDED_WARNED = False

#: structured_outputs keys (vLLM's ``StructuredOutputsParams``).
STRUCTURED_KEYS = ("json", "json_object", "choice", "regex", "grammar", "structural_tag", "whitespace_pattern")
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


def structured_spec(raw: Any, known: tuple[str, ...] | list[str] = STRUCTURED_KEYS) -> dict[str, Any] | None:
    """A row's ``structured_outputs`` checked: its keys against ``known`` (an engine may pass its
    own list, as vLLM's engine passes its live ``StructuredOutputsParams`` fields), then its JSON
    schema, regex and choices as every engine checks them (:func:`validate_structured`); unset
    and false fields dropped (``backend``, the old ``guided_decoding`` field, too: the engine picks)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RowValidationError(f"structured_outputs must be a dict (e.g. {{'choice': [...]}}), got {type(raw).__name__}")
    spec = {k: v for k, v in raw.items() if v not in (None, False) and k != "backend"}
    for key in spec:
        if key not in known:
            raise RowValidationError(f"unknown structured_outputs key '{key}'{suggestion(key, known)}; "
                                     f"known: {', '.join(known)}")
    spec = validate_structured(spec)
    return spec or None


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
