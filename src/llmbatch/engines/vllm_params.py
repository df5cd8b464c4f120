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
from typing import Any

from llmbatch.errors import RowValidationError, suggestion
from llmbatch.params import check_types, row_sampling_params, structured_spec


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


def structured_outputs(spec: Any):
    """A row's structured-output spec as vLLM's ``StructuredOutputsParams``, checked by
    :func:`llmbatch.params.structured_spec` against the fields this vLLM knows."""
    from vllm.sampling_params import StructuredOutputsParams

    if isinstance(spec, StructuredOutputsParams):
        return spec
    known = [f for f in StructuredOutputsParams.__dataclass_fields__ if not f.startswith("_")]
    checked = structured_spec(spec, known)
    try:
        return StructuredOutputsParams(**(checked or {}))
    except Exception as exc:  # noqa: BLE001
        raise RowValidationError(f"invalid structured_outputs: {exc}") from exc

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
