"""One OpenAI request body -> the request fields of an llmbatch row: one rule set for a batch
file's lines, ``llmbatch serve``'s batches and the Ray Serve deployment's requests.

``/v1/chat/completions`` becomes ``messages`` + ``sampling_params``, ``/v1/completions``
``prompt`` + ``sampling_params``, ``/v1/embeddings`` ``prompt`` + ``pooling_params``. Every
field OpenAI defines that maps to a vLLM setting is honoured; fields that change nothing in
the answer (``user``, ``metadata``, ``store``...) are accepted and ignored; vLLM's own extra
sampling fields (``top_k``, ``min_p``, ``repetition_penalty``...) pass through as vLLM's
server takes them (their types checked as every engine checks them), and its older ``guided_*``
constraints join ``response_format`` in ``structured_outputs``; anything else is an error that
names the field (why strict: :mod:`llmbatch.openai.vocab`). The same function validates a batch
file before any inference, builds each row's request in the workers, and builds the row of a
request the Serve deployment answers (:func:`rows_from_request`).
"""

from __future__ import annotations

from typing import Any

from llmbatch.errors import RowValidationError, suggestion
from llmbatch.openai.vocab import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    ENDPOINTS,
    FIELDS,
    GUIDED,
    NOT_SUPPORTED,
    RANGES,
    SERVE_METHODS,
    VLLM_PARAMS,
)
from llmbatch.params import check_types
from llmbatch.rows import OPENAI, normalize_messages


class RequestError(RowValidationError):
    """A request body llmbatch cannot run; ``code`` and ``param`` as OpenAI's errors have them."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param = param
        self.code = code


def _number(body: dict[str, Any], key: str, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise RequestError(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", key, "invalid_type")
    lo, hi = RANGES.get(key, (None, None))
    if lo is not None and not lo <= value <= hi:
        raise RequestError(f"'{key}' must be between {lo} and {hi}, got {value!r}", key, "invalid_value")
    return value


def _check_fields(endpoint: str, body: dict[str, Any]) -> None:
    known = FIELDS[endpoint]
    for key in body:
        if key in known:
            continue
        if key in NOT_SUPPORTED or key in ("tools", "tool_choice"):
            what = NOT_SUPPORTED.get(key) or "this field"
            raise RequestError(f"unsupported parameter '{key}' ({what} is not supported by llmbatch)", key,
                               "unsupported_parameter")
        raise RequestError(f"unsupported parameter '{key}' for {endpoint}{suggestion(key, known, clause=True)}", key, "unsupported_parameter")
    if body.get("stream"):
        raise RequestError("'stream' must be false in a batch", "stream", "unsupported_parameter")


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    sp: dict[str, Any] = {}
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        if (value := _number(body, key)) is not None:
            sp[key] = value
    for key in ("n", "seed"):
        if (value := _number(body, key, integer=True)) is not None:
            sp[key] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("'stop' must be a string or a list of strings", "stop", "invalid_type")
        if stop:
            sp["stop"] = stop
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise RequestError("'logit_bias' must map token ids to biases", "logit_bias", "invalid_type")
        try:
            sp["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise RequestError("'logit_bias' keys must be token ids and values numbers", "logit_bias",
                               "invalid_value") from None
    for key in VLLM_PARAMS:
        if body.get(key) is not None:
            try:
                check_types({key: body[key]})  # as every engine checks them
            except RowValidationError as exc:
                raise RequestError(str(exc), key, "invalid_type") from None
            sp[key] = body[key]
    return sp


def _max_tokens(body: dict[str, Any], sp: dict[str, Any], *names: str) -> None:
    given = {n: body[n] for n in names if body.get(n) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise RequestError(f"give one of {' or '.join(names)}, not both with different values", names[0],
                           "invalid_value")
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(f"'{key}' must be a positive integer, got {value!r}", key, "invalid_value")
        sp["max_tokens"] = value


def _structured(body: dict[str, Any], sp: dict[str, Any]) -> None:
    """``structured_outputs``, the ``guided_*`` fields and ``response_format``, as one spec."""
    spec = body.get("structured_outputs")
    if spec is not None and not isinstance(spec, dict):
        raise RequestError("'structured_outputs' must be an object (e.g. {\"choice\": [...]})", "structured_outputs",
                           "invalid_type")
    spec = dict(spec or {})
    for field, key in GUIDED.items():
        if body.get(field) is not None:
            spec[key] = body[field]
    spec.update(_response_format(body))
    if spec:
        sp["structured_outputs"] = spec


def _response_format(body: dict[str, Any]) -> dict[str, Any]:
    fmt = body.get("response_format")
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON schema object",
                               "response_format", "invalid_value")
        import jsonschema

        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise RequestError(f"response_format.json_schema.schema is not a valid JSON schema: {exc.message}",
                               "response_format", "invalid_value") from None
        return {"json": schema}
    raise RequestError(f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                       "response_format", "invalid_value")


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    try:
        messages = normalize_messages(body.get("messages"))
    except RowValidationError as exc:
        raise RequestError(str(exc), "messages", "invalid_value") from None
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        raise RequestError("unsupported parameter 'tools' (tool calling is not supported by llmbatch)", "tools",
                           "unsupported_parameter")
    if body.get("modalities") not in (None, ["text"]):
        raise RequestError("only text output is supported ('modalities': ['text'])", "modalities",
                           "unsupported_parameter")
    sp = _sampling(body)
    _max_tokens(body, sp, "max_completion_tokens", "max_tokens")
    _structured(body, sp)
    detail: dict[str, Any] = {"max_tokens_auto": "max_tokens" not in sp}
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError("'logprobs' must be true or false for chat completions", "logprobs", "invalid_type")
    top = _number(body, "top_logprobs", integer=True)
    if top is not None and not logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    if logprobs:
        sp["logprobs"] = top or 0
        detail["top_logprobs"] = top or 0
    out: dict[str, Any] = {"messages": messages, "sampling_params": sp, OPENAI: detail}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
        out["chat_template_kwargs"] = kwargs
    return out


def prompts(endpoint: str, body: dict[str, Any]) -> list[Any]:
    """The inputs of a request that fans out (a list ``prompt`` or ``input``): one row each."""
    key = "prompt" if endpoint == COMPLETIONS else "input" if endpoint == EMBEDDINGS else None
    if key is None:
        return [None]
    value = body.get(key)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(v, int) or isinstance(v, list) for v in value):
        raise RequestError(f"'{key}' as token ids is not supported; give text", key, "unsupported_parameter")
    raise RequestError(f"'{key}' must be a non-empty string or a list of strings", key, "invalid_value")


def _completion(body: dict[str, Any], prompt: str) -> dict[str, Any]:
    if body.get("echo"):
        raise RequestError("unsupported parameter 'echo' (echo is not supported by llmbatch)", "echo",
                           "unsupported_parameter")
    if body.get("suffix"):
        raise RequestError("unsupported parameter 'suffix' (insertion is not supported by llmbatch)", "suffix",
                           "unsupported_parameter")
    sp = _sampling(body)
    best_of = body.get("best_of")
    if best_of is not None and best_of != sp.get("n", 1):
        raise RequestError("unsupported parameter 'best_of' (only best_of equal to n)", "best_of",
                           "unsupported_parameter")
    _max_tokens(body, sp, "max_tokens")
    sp.setdefault("max_tokens", 16)  # OpenAI's default for completions
    _structured(body, sp)
    detail: dict[str, Any] = {}
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 5:
            raise RequestError("'logprobs' must be an integer from 0 to 5 for completions", "logprobs",
                               "invalid_value")
        sp["logprobs"] = logprobs
        detail["top_logprobs"] = logprobs
    if not prompt.strip():
        raise RequestError("'prompt' is empty", "prompt", "invalid_value")
    return {"prompt": prompt, "sampling_params": sp, OPENAI: detail}


def _embedding(body: dict[str, Any], text: str) -> dict[str, Any]:
    if body.get("encoding_format", "float") not in ("float", "base64"):
        raise RequestError("'encoding_format' must be float or base64", "encoding_format", "invalid_value")
    if not text.strip():
        raise RequestError("'input' holds an empty string", "input", "invalid_value")
    out: dict[str, Any] = {"prompt": text}
    dims = _number(body, "dimensions", integer=True)
    if dims is not None:
        if dims < 1:
            raise RequestError("'dimensions' must be at least 1", "dimensions", "invalid_value")
        out["pooling_params"] = {"dimensions": dims}
    return out


def translate(endpoint: str, body: Any, item: Any = None) -> dict[str, Any]:
    """The row's request fields for ``body`` sent to ``endpoint``; ``item`` is one prompt of a
    request that fans out (see :func:`prompts`). Raises :class:`RequestError`."""
    if endpoint not in ENDPOINTS:
        raise RequestError(f"unsupported url {endpoint!r}; use one of {', '.join(ENDPOINTS)}", "url", "invalid_url")
    if not isinstance(body, dict):
        raise RequestError("'body' must be a JSON object", "body", "invalid_body")
    _check_fields(endpoint, body)
    if endpoint == CHAT:
        return _chat(body)
    if item is None:
        item = prompts(endpoint, body)[0]
    return _completion(body, item) if endpoint == COMPLETIONS else _embedding(body, item)


def rows_from_request(endpoint: str, request: Any) -> list[dict[str, Any]]:
    """The rows of a request the Serve deployment answers (a dict, or a pydantic model such as
    Ray Serve LLM's ``ChatCompletionRequest``: its fields set by the caller): one row, or one
    per prompt of a completions request whose ``prompt`` is a list. The batch path's rules
    (:func:`translate`); raises :class:`RequestError`."""
    if hasattr(request, "model_dump"):
        request = request.model_dump(exclude_unset=True)
    if not isinstance(request, dict):
        raise RequestError(f"the request must be a dict or a pydantic model, got {type(request).__name__}", "body",
                           "invalid_body")
    if endpoint not in SERVE_METHODS:
        raise RequestError(f"unsupported url {endpoint!r}; use one of {', '.join(SERVE_METHODS)}", "url",
                           "invalid_url")
    body = {k: v for k, v in request.items() if v is not None}
    return [translate(endpoint, body, item) for item in prompts(endpoint, body)]


def row_from_request(endpoint: str, request: Any) -> dict[str, Any]:
    """The one row of a request (:func:`rows_from_request`); a request that fans out is refused."""
    rows = rows_from_request(endpoint, request)
    if len(rows) != 1:
        raise RequestError(f"the request holds {len(rows)} prompts; send one", "prompt", "invalid_value")
    return rows[0]
