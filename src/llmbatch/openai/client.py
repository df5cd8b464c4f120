"""llmbatch as an OpenAI client: rows -> requests to an OpenAI-compatible server, its answers ->
rows (the HTTP engine and the Serve engine send rows this way).

- :func:`request_body`: a row as llmbatch's other engines take it (``messages`` or ``prompt``,
  ``sampling_params`` with ``structured_outputs``) -> an OpenAI chat/completions request body.
  So one job file runs against the local engine or an endpoint.
- :func:`answer_columns`: an OpenAI chat/completions response -> llmbatch's output columns
  (``generated_text``, ``finish_reason``, token usage...).

The server side (requests -> rows, rows -> responses) is :mod:`llmbatch.openai.requests` and
:mod:`llmbatch.openai.responses`.
"""

from __future__ import annotations

import base64
import io
import json
import math
from typing import Any

from llmbatch.errors import InvalidResponseError, RowValidationError, suggestion
from llmbatch.openai.vocab import (
    CHAT,
    COMPLETIONS,
    GUIDED,
    OPENAI_PARAMS,
    VLLM_PARAMS,
)
from llmbatch.params import check_types, row_sampling_params, structured_spec
from llmbatch.rows import (
    DEFAULT_MAX_TOKENS,
    SAMPLING_PARAM_NAMES,
    normalize_messages,
    to_python,
)

def endpoint_url(url: str, endpoint: str) -> str:
    """The URL for a chat or completions request: ``url`` is the endpoint itself
    (``.../v1/chat/completions``, ``.../v1/completions``) or the API base (``.../v1``)."""
    base = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base + endpoint.removeprefix("/v1")


def _constraint_fields(spec: dict[str, Any], fields: str) -> dict[str, Any]:
    if fields == "guided":
        out = {field: spec[key] for field, key in GUIDED.items() if key in spec}
        if spec.get("json_object"):
            out["response_format"] = {"type": "json_object"}
        return out
    out: dict[str, Any] = {}
    rest = {k: v for k, v in spec.items() if k not in ("json", "json_object")}
    if "json" in spec:
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": spec["json"]}}
    elif spec.get("json_object"):
        out["response_format"] = {"type": "json_object"}
    if rest:
        out["structured_outputs"] = rest
    return out


def _image_url(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return "data:image/png;base64," + base64.b64encode(bytes(value)).decode()
    if hasattr(value, "save"):  # a PIL image
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    raise RowValidationError(f"an image part must be a URL, bytes or a PIL image, got {type(value).__name__}")


def _wire_messages(messages: Any) -> list[dict[str, Any]]:
    out = []
    for msg in normalize_messages(to_python(messages)):
        content = msg["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "image":
                    parts.append({"type": "image_url", "image_url": {"url": _image_url(part.get("image"))}})
                else:
                    parts.append(part)
            msg = {**msg, "content": parts}
        out.append(msg)
    return out


def request_body(row: dict[str, Any], model: str | None, fields: str = "auto") -> tuple[str, dict[str, Any], dict | None]:
    """(endpoint, body, structured spec) for a row with ``messages`` (chat) or ``prompt``
    (completions) and ``sampling_params``; raises :class:`RowValidationError` naming the field."""
    sp, structured = row_sampling_params(to_python(row.get("sampling_params") or {}))
    spec = structured_spec(structured)
    for key in sp:
        if key not in SAMPLING_PARAM_NAMES:
            raise RowValidationError(f"unknown sampling param '{key}'{suggestion(key, sorted(SAMPLING_PARAM_NAMES))}")
    check_types(sp)
    if row.get("messages") is not None:
        kind, body = CHAT, {"messages": _wire_messages(row["messages"])}
    elif isinstance(row.get("prompt"), str) and row["prompt"].strip():
        kind, body = COMPLETIONS, {"prompt": row["prompt"]}
    else:
        raise RowValidationError("the row has neither 'messages' nor a non-empty 'prompt' (nor a 'payload')")
    name = row.get("model") or model
    if name:
        body["model"] = name
    body["max_tokens"] = sp.pop("max_tokens", DEFAULT_MAX_TOKENS)
    logprobs = sp.pop("logprobs", None)
    if logprobs is not None:
        body.update({"logprobs": True, "top_logprobs": logprobs} if kind == CHAT else {"logprobs": logprobs})
    for key, value in sp.items():
        if key in OPENAI_PARAMS or key in VLLM_PARAMS:
            body[key] = value
    if kind == CHAT and row.get("chat_template_kwargs"):
        body["chat_template_kwargs"] = to_python(row["chat_template_kwargs"])
    if spec:
        body.update(_constraint_fields(spec, fields))
    return kind, body, spec


def is_deterministic(body: dict[str, Any]) -> bool:
    """Whether identical bodies give identical answers (greedy or seeded, one answer)."""
    return (body.get("temperature") == 0 or body.get("seed") is not None) and body.get("n", 1) == 1


def estimate_tokens(body: Any) -> int:
    """Tokens a request is charged before it is sent, as OpenAI estimates them: about four
    characters a token for the prompt, plus ``max_tokens`` for each answer."""
    if not isinstance(body, dict):
        return 0
    chars, messages = 0, 0
    for msg in body.get("messages") or []:
        messages += 1
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            chars += len(content.encode("utf-8", "replace"))
        elif isinstance(content, list):
            chars += sum(len(str(p.get("text", "")).encode("utf-8", "replace")) for p in content if isinstance(p, dict))
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, str):
            chars += len(value.encode("utf-8", "replace"))
        elif isinstance(value, list):
            chars += sum(len(str(v)) for v in value)
    out = body.get("max_completion_tokens") or body.get("max_tokens") or 0
    n = body.get("n") or 1
    return math.ceil(chars / 4) + 4 * messages + 3 + int(out) * int(n)


def _logprobs(choice: dict[str, Any]) -> list[list[dict[str, Any]]] | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    if isinstance(lp.get("content"), list):  # chat
        return [[{"token_id": None, "logprob": t.get("logprob"), "rank": i, "decoded_token": t.get("token")}
                 for i, t in enumerate(entry.get("top_logprobs") or [entry])] for entry in lp["content"]]
    tops = lp.get("top_logprobs")
    if isinstance(tops, list):  # completions
        return [[{"token_id": None, "logprob": v, "rank": i, "decoded_token": k} for i, (k, v) in enumerate((t or {}).items())]
                for t in tops]
    return None


def usage_counts(data: Any) -> tuple[int, int, int | None]:
    """(prompt tokens, completion tokens, cached prompt tokens or None) from ``usage``."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0), cached


def answer_columns(kind: str, data: Any, prompt: str = "") -> dict[str, Any]:
    """llmbatch's generate columns from a chat/completions response."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise InvalidResponseError(f"the response has no choices: {json.dumps(data, default=str)[:200]}")
    first = choices[0]
    if kind == CHAT:
        message = first.get("message")
        if not isinstance(message, dict):
            raise InvalidResponseError("the response's choices[0] has no message")
        text = message.get("content") or ""
    else:
        text = first.get("text")
        if not isinstance(text, str):
            raise InvalidResponseError("the response's choices[0] has no text")
    prompt_tokens, completion_tokens, _ = usage_counts(data)
    out = {"generated_text": text, "finish_reason": first.get("finish_reason") or "",
           "num_input_tokens": prompt_tokens, "num_generated_tokens": completion_tokens,
           "generated_tokens": [int(t) for t in first.get("token_ids") or []], "prompt": prompt}
    logprobs = _logprobs(first)
    if logprobs is not None:
        out["logprobs"] = logprobs
    return out
