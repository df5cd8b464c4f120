"""Answered rows -> OpenAI response objects and Batch output lines, in OpenAI's exact shape.

One builder (:func:`response_body`) makes the ``chat.completion``, ``text_completion`` or
embeddings ``list`` object from a request's answered rows: every one of ``n`` choices with its
finish and stop reason and logprobs, and the usage. A batch's output line wraps it
(:func:`output_line`); the Ray Serve deployment returns it as it is (:func:`response_object`).

An output line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}`` with a complete ``chat.completion``, ``text_completion`` or embeddings
``list`` as the body (with the fields vLLM's server adds, so a file written by
``vllm run-batch`` and one written here carry the same fields); a failed request is
``{"id", "custom_id", "response": null, "error": {"code", "message", "line"}}``.

Ids in a batch's output are stable: the same job writes the same ids for the same lines, however
often its output is written again (``resume``, a cancelled batch finished later); a response of
the Serve deployment gets a fresh id, as a server's does.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from llmbatch.openai.vocab import CHAT, COMPLETIONS, EMBEDDINGS, LINE_ID, OBJECTS, REQUEST_ID
from llmbatch.rows import STATS, parse_error

try:
    FINGERPRINT = f"llmbatch-{version('llmbatch')}"
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    FINGERPRINT = "llmbatch"

#: OpenAI error code per (stage, error type) of a failed row; a read error carries its own code.
STAGE_CODES = {"tokenize": "invalid_request", "validate": "invalid_request", "preprocess": "invalid_request",
               "chat_template": "invalid_request", "prepare_multimodal": "invalid_request",
               "check_output": "invalid_output", "engine": "server_error", "postprocess": "server_error"}


def stable_id(prefix: str, job_key: str, line: Any, size: int = 24) -> str:
    digest = hashlib.blake2b(f"{job_key}\0{prefix}\0{line}".encode(), digest_size=size // 2).hexdigest()
    return f"{prefix}{digest}"


def error_code(error_text: str) -> tuple[str, str]:
    """(OpenAI code, message) for an ``__inference_error__`` text."""
    stage, error_type, message = parse_error(error_text)
    if stage == "read":
        return error_type, message
    if error_type == "PromptTooLongError":
        return "context_length_exceeded", f"{stage}: {error_type}: {message}"
    return STAGE_CODES.get(stage, "server_error"), f"{stage}: {error_type}: {message}"


def error_line(job_key: str, custom_id: Any, line: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": stable_id(LINE_ID, job_key, line), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message, "line": line}}


def _token_text(entry: dict[str, Any]) -> str:
    text = entry.get("decoded_token")
    return text if text is not None else f"token_id:{entry['token_id']}"


def _chosen(sampled: int, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((e for e in entries if e["token_id"] == sampled), entries[0] if entries else None)


def _top(entries: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The ``k`` most likely tokens of one position (vLLM adds the sampled one when it ranks below)."""
    ranked = sorted((e for e in entries if e.get("rank") is not None), key=lambda e: e["rank"])
    return [e for e in ranked if e["rank"] <= k][:k]


def _logprob(entry: dict[str, Any]) -> float:
    return max(float(entry["logprob"]), -9999.0)  # -inf is not JSON; OpenAI's floor


def _chat_logprobs(answer: dict[str, Any], k: int) -> dict[str, Any] | None:
    positions = answer.get("logprobs")
    if positions is None:
        return None
    content = []
    for sampled, entries in zip(answer.get("token_ids") or [], positions):
        chosen = _chosen(sampled, entries)
        if chosen is None:
            continue
        token = _token_text(chosen)
        content.append({"token": token, "logprob": _logprob(chosen), "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [{"token": _token_text(e), "logprob": _logprob(e),
                                          "bytes": list(_token_text(e).encode("utf-8"))} for e in _top(entries, k)]})
    return {"content": content}


def _completion_logprobs(answer: dict[str, Any], k: int) -> dict[str, Any] | None:
    positions = answer.get("logprobs")
    if positions is None:
        return None
    out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for sampled, entries in zip(answer.get("token_ids") or [], positions):
        chosen = _chosen(sampled, entries)
        token = _token_text(chosen) if chosen else ""
        out["text_offset"].append(offset)
        offset += len(token)
        out["tokens"].append(token)
        out["token_logprobs"].append(_logprob(chosen) if chosen else None)
        out["top_logprobs"].append({_token_text(e): _logprob(e) for e in _top(entries, k)})
    return out


def _usage(rows: list[dict[str, Any]], completion: bool) -> dict[str, Any]:
    prompt = sum(int(r.get("num_input_tokens") or 0) for r in rows)
    generated = sum(int(r.get("num_generated_tokens") or 0) for r in rows) if completion else 0
    cached = [(r.get(STATS) or {}).get("cached_tokens") for r in rows]
    details = {"cached_tokens": sum(cached)} if cached and all(c is not None for c in cached) else None
    return {"prompt_tokens": prompt, "total_tokens": prompt + generated, "completion_tokens": generated,
            "prompt_tokens_details": details, "completion_tokens_details": None}


def _completions(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's answers: all ``n`` of them (``completions``), or its one answer."""
    found = row.get("completions")
    if found:
        return sorted(found, key=lambda c: c.get("index", 0))
    return [{"index": 0, "text": row.get("generated_text") or "", "finish_reason": row.get("finish_reason"),
             "stop_reason": None, "logprobs": None, "token_ids": []}]


def response_body(rows: list[dict[str, Any]], url: str, model: str, response_id: str) -> dict[str, Any]:
    """The body of one request's answer (``rows``: its rows in ``sub`` order)."""
    created = int(max(((r.get(STATS) or {}).get("finished_at") or 0) for r in rows)) or None
    kind, _ = OBJECTS[url]
    if url == EMBEDDINGS:
        data = []
        for index, row in enumerate(rows):
            vector = row.get("embeddings")  # a list, or the engine's float32 array
            vector = [] if vector is None else [float(v) for v in vector]
            if row.get("encoding_format") == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
            data.append({"index": index, "object": "embedding", "embedding": vector})
        return {"id": response_id, "object": kind, "created": created, "model": model,
                "data": data, "usage": _usage(rows, completion=False)}
    choices = []
    for row in rows:
        k = int(row.get("top_logprobs") or 0)
        for answer in _completions(row):
            finish = answer.get("finish_reason") or "stop"
            choice: dict[str, Any] = {"index": len(choices)}
            if url == CHAT:
                choice["message"] = {"role": "assistant", "content": answer.get("text", ""), "refusal": None,
                                     "annotations": None, "audio": None, "function_call": None, "reasoning": None}
                choice["logprobs"] = _chat_logprobs(answer, k)
            else:
                choice["text"] = answer.get("text", "")
                choice["logprobs"] = _completion_logprobs(answer, k)
            choice.update(finish_reason=finish, stop_reason=answer.get("stop_reason"), token_ids=None)
            if url == CHAT:
                choice["routed_experts"] = None
            else:
                choice.update(prompt_logprobs=None, prompt_token_ids=None)
            choices.append(choice)
    body = {"id": response_id, "object": kind, "created": created, "model": model,
            "choices": choices, "service_tier": None, "system_fingerprint": FINGERPRINT,
            "usage": _usage(rows, completion=True)}
    if url == CHAT:
        body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return body


def output_line(rows: list[dict[str, Any]], default_model: str, job_key: str) -> dict[str, Any]:
    """The output line of one answered request (``rows``: its rows in ``sub`` order)."""
    first = rows[0]
    line = first.get("line")
    url = first.get("url") or (COMPLETIONS if first.get("completions") else CHAT)
    body = response_body(rows, url, first.get("model") or default_model, stable_id(OBJECTS[url][1], job_key, line))
    return {"id": stable_id(LINE_ID, job_key, line), "custom_id": first.get("custom_id"),
            "response": {"status_code": 200, "request_id": stable_id(REQUEST_ID, job_key, line), "body": body},
            "error": None}


def response_object(endpoint: str, model: str, *rows: dict[str, Any]) -> dict[str, Any]:
    """The response a server sends for one request's answered ``rows`` (a fresh id; created now
    unless the rows say when they finished)."""
    body = response_body(list(rows), endpoint, model, f"{OBJECTS[endpoint][1]}{uuid.uuid4().hex}")
    body["created"] = body["created"] or int(time.time())
    return body
