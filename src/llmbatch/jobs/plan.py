"""``llmbatch plan``: what a job will cost, before it runs.

Reads the input as a stream (memory stays flat however many rows there are: a few numbers
per row), renders each row's prompt exactly as the job would (template, chat template),
tokenizes it with the model's tokenizer, and reports rows, prompt tokens (min/median/max),
rows that cannot fit ``max_model_len``, duplicate requests (answered once with dedup), the
share of prompt tokens in prefixes shared with an earlier prompt (prefix-cache hits, in the
engine's 16-token blocks), and an estimate of the run time from a given throughput or a
short calibration run. For an endpoint (``processor: http`` or ``serve``) whose model is not
a local one, prompt tokens are estimated as the endpoint's rate limits count them (about four
characters a token), and the run time follows from its ``qps``/``tokens_per_minute``.
"""

from __future__ import annotations

import json
import resource
import time
from typing import Any

import numpy as np

from llmbatch.codec import digest64
from llmbatch.config import EndpointProcessorConfig
from llmbatch.errors import ConfigError
from llmbatch.io.readers import READ_ERROR, read_rows
from llmbatch.jobs.openai_batch import batch_options, is_openai_batch
from llmbatch.jobs.prompts import check_prompt_fields, job_preprocess
from llmbatch.jobs.run import run_job
from llmbatch.jobs.spec import PROCESSOR_CONFIGS, JobSpec, load_job
from llmbatch.models import load_tokenizer, model_max_len, resolve_model
from llmbatch.openai.batch_file import read_openai_batch
from llmbatch.openai.client import estimate_tokens
from llmbatch.rows import DEFAULT_MAX_TOKENS, normalize_messages

BLOCK = 16  # vLLM's default KV block size: the unit of prefix caching
BATCH = 4096


def _request_builder(spec: JobSpec):
    return job_preprocess(spec)


def _max_model_len(spec: JobSpec, model_path: str) -> int | None:
    fields = spec.model.processor_fields()
    value = (fields.get("engine_kwargs") or {}).get("max_model_len")
    return int(value) if value else model_max_len(model_path)


def plan_job(spec: JobSpec, *, throughput: float | None = None, calibrate_rows: int = 0) -> dict[str, Any]:
    """The plan for ``spec`` (see module docstring)."""
    started = time.perf_counter()
    endpoint = issubclass(PROCESSOR_CONFIGS[spec.model.processor], EndpointProcessorConfig)
    try:
        model_path = resolve_model(spec.model.source)
        tokenizer = load_tokenizer(spec.model.source)
    except Exception:  # noqa: BLE001 - a hosted model's name: estimate its tokens instead
        if not endpoint:
            raise
        model_path = tokenizer = None
    max_len = _max_model_len(spec, model_path) if model_path else None
    build = _request_builder(spec)
    generate = spec.resolved_task() == "generate"
    counts: list[np.ndarray] = []
    request_hashes: list[np.ndarray] = []
    block_hashes: list[np.ndarray] = []
    max_tokens: list[np.ndarray] = []
    estimated: list[int] = []
    rows = read_errors = bad_rows = 0
    checked_fields = False
    if is_openai_batch(spec):
        batches = read_openai_batch(spec.input.path, batch_options(spec), spec.input.limit, BATCH)
    else:
        batches = read_rows(spec.input.path, spec.input.format, spec.input.columns, spec.input.limit, BATCH)
    for batch in batches:
        if not checked_fields and spec.prompt is not None:
            check_prompt_fields(spec, [k for k in batch[0] if k != READ_ERROR])
            checked_fields = True
        prompts: list[str] = []
        specials: list[bool] = []
        req_keys: list[int] = []
        wants: list[int] = []
        for row in batch:
            rows += 1
            if row.pop(READ_ERROR, ""):
                read_errors += 1
                continue
            try:
                req = build(row)
                if req.get("messages") is not None and tokenizer is None:
                    text, special = json.dumps(normalize_messages(req["messages"])), False
                    estimated.append(estimate_tokens({"messages": normalize_messages(req["messages"])}))
                elif req.get("messages") is not None:
                    messages = normalize_messages(req["messages"])
                    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                    special = False
                elif req.get("text_1") is not None:  # a scoring pair: both texts count
                    text, special = f"{req['text_1']}\n{req['text_2']}", True
                else:
                    text, special = str(req["prompt"]), True
                    if tokenizer is None:
                        estimated.append(estimate_tokens({"prompt": text}))
            except Exception:  # noqa: BLE001 - a row the job would turn into an error row
                bad_rows += 1
                continue
            sp = req.get("sampling_params" if generate else "pooling_params") or {}
            prompts.append(text)
            specials.append(special)
            req_keys.append(digest64(text + "\0" + json.dumps(sp, sort_keys=True, default=str)))
            wants.append(int(sp.get("max_tokens") or DEFAULT_MAX_TOKENS) if generate else 0)  # pooling: none
        if not prompts:
            continue
        if tokenizer is None:
            counts.append(np.asarray(estimated, dtype=np.int32))
            estimated.clear()
            request_hashes.append(np.asarray(req_keys, dtype=np.uint64))
            max_tokens.append(np.asarray(wants, dtype=np.int32))
            continue
        ids_list = [None] * len(prompts)
        for special in (False, True):
            idx = [i for i, s in enumerate(specials) if s is special]
            if idx:
                enc = tokenizer([prompts[i] for i in idx], add_special_tokens=special)["input_ids"]
                for i, ids in zip(idx, enc):
                    ids_list[i] = ids
        counts.append(np.fromiter((len(ids) for ids in ids_list), dtype=np.int32, count=len(ids_list)))
        request_hashes.append(np.asarray(req_keys, dtype=np.uint64))
        max_tokens.append(np.asarray(wants, dtype=np.int32))
        blocks = []
        for ids in ids_list:
            h = 0
            for start in range(0, len(ids) - BLOCK + 1, BLOCK):
                h = hash((h, tuple(ids[start:start + BLOCK])))
                blocks.append(h)
        if blocks:
            block_hashes.append(np.asarray(blocks, dtype=np.int64))
    if rows == 0:
        raise ConfigError(f"the input {spec.input.path} has no rows")
    tokens = np.concatenate(counts) if counts else np.zeros(0, np.int32)
    wants_all = np.concatenate(max_tokens) if max_tokens else np.zeros(0, np.int32)
    hashes = np.concatenate(request_hashes) if request_hashes else np.zeros(0, np.uint64)
    unique_requests = int(np.unique(hashes).size)
    all_blocks = np.concatenate(block_hashes) if block_hashes else np.zeros(0, np.int64)
    shared_tokens = (all_blocks.size - np.unique(all_blocks).size) * BLOCK
    total_tokens = int(tokens.sum())
    answered = int(tokens.size)
    # a generated answer needs room after the prompt; a pooled text may fill the context
    over = int(((tokens >= max_len) if generate else (tokens > max_len)).sum()) if max_len else 0
    no_room = int(((tokens + wants_all) > max_len).sum()) if max_len else 0
    plan: dict[str, Any] = {
        "input": spec.input.path,
        "model": spec.model.source,
        "rows": rows,
        "rows_unreadable": read_errors,
        "rows_failing_preprocess": bad_rows,
        "prompt_tokens": {
            "min": int(tokens.min()) if answered else 0,
            "median": float(np.median(tokens)) if answered else 0.0,
            "max": int(tokens.max()) if answered else 0,
            "total": total_tokens,
        },
        "max_model_len": max_len,
        "rows_over_max_model_len": over,
        "task": spec.resolved_task(),
        "rows_where_max_tokens_does_not_fit": no_room,
        "duplicate_requests": answered - unique_requests,
        "unique_requests": unique_requests,
        "shared_prefix_token_share": (round(shared_tokens / total_tokens, 4) if total_tokens else 0.0)
        if tokenizer is not None else None,
        "prompt_tokens_estimated": tokenizer is None,
        "max_output_tokens": int(wants_all.sum()),  # a total over the rows, at most
        "max_tokens_per_row": int(wants_all.max()) if wants_all.size else 0,
    }
    estimate = _estimate(spec, unique_requests, throughput, calibrate_rows)
    if endpoint and not throughput and not calibrate_rows:
        estimate = _limits_estimate(spec, unique_requests, total_tokens + int(wants_all.sum())) or estimate
    if estimate:
        plan["estimate"] = estimate
    plan["plan_seconds"] = round(time.perf_counter() - started, 1)
    plan["peak_memory_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return plan


def _limits_estimate(spec: JobSpec, requests: int, tokens: int) -> dict[str, Any] | None:
    """The least time an endpoint's rate limits allow (every request and its tokens counted)."""
    fields = spec.model.processor_fields()
    qps, tpm = fields.get("qps"), fields.get("tokens_per_minute")
    if not qps and not tpm:
        return None
    seconds = max(requests / float(qps) if qps else 0.0, tokens * 60.0 / float(tpm) if tpm else 0.0)
    return {"method": "rate limits (qps, tokens_per_minute), at best", "seconds": round(seconds * 1.05, 1)}


def _estimate(spec: JobSpec, unique_requests: int, throughput: float | None, calibrate_rows: int) -> dict[str, Any] | None:
    if throughput:
        return {"method": "given throughput", "rows_per_s": throughput,
                "seconds": round(unique_requests / throughput, 1)}
    if calibrate_rows <= 0:
        return {"method": "none", "hint": "pass --throughput ROWS_PER_S or --calibrate N for a run-time estimate"}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="llmbatch-calibrate-") as tmp:
        data = json.loads(spec.model_dump_json())
        data["input"]["limit"] = calibrate_rows
        data["output"] = {"path": f"{tmp}/out.parquet"}
        data["job_dir"] = f"{tmp}/job"
        result = run_job(load_job(data=data), quiet=True)
        rate = result.stats.get("steady_rows_per_s") or result.stats.get("rows_per_s") or 0.0
    return {"method": f"calibration run of {calibrate_rows} rows", "rows_per_s": round(rate, 3),
            "seconds": round(unique_requests / rate, 1) if rate else None,
            "note": "engine start-up is not included; calibration rows may dedup differently from the whole input"}


def plan_lines(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """The plan as (label, value) lines for a person: per-row figures labelled per row, totals
    as totals, no raw dicts (``llmbatch plan``; ``--json`` prints the dict itself)."""
    toks = plan["prompt_tokens"]
    estimated = " (estimated: about 4 characters a token)" if plan.get("prompt_tokens_estimated") else ""
    lines = [("input", str(plan["input"])), ("model", str(plan["model"])), ("task", str(plan["task"])),
             ("rows", f"{plan['rows']:,} ({plan['rows_unreadable']:,} unreadable, "
                      f"{plan['rows_failing_preprocess']:,} failing the prompt)"),
             ("prompt tokens per row", f"min {toks['min']:,}, median {toks['median']:,.0f}, max {toks['max']:,}{estimated}"),
             ("prompt tokens, total", f"{toks['total']:,}")]
    if plan.get("max_model_len"):
        lines.append(("max_model_len, per row", f"{plan['max_model_len']:,} tokens (prompt and answer)"))
        lines.append(("rows too long", f"{plan['rows_over_max_model_len']:,} prompts over max_model_len; "
                                       f"{plan['rows_where_max_tokens_does_not_fit']:,} rows where max_tokens does not fit"))
    if plan["task"] == "generate":
        lines.append(("max_tokens, per row", f"{plan.get('max_tokens_per_row', 0):,} tokens at most"))
        lines.append(("output tokens, total", f"{plan['max_output_tokens']:,} at most (every row's max_tokens)"))
    lines.append(("duplicate requests", f"{plan['duplicate_requests']:,} (answered once each: "
                                        f"{plan['unique_requests']:,} unique requests run)"))
    if plan.get("shared_prefix_token_share") is not None:
        lines.append(("shared prefixes", f"{plan['shared_prefix_token_share']:.0%} of prompt tokens "
                                         "(prefix-cache hits)"))
    estimate = plan.get("estimate") or {}
    if estimate.get("seconds") is not None:
        rate = f" at {estimate['rows_per_s']:,} rows/s" if estimate.get("rows_per_s") else ""
        note = f"; {estimate['note']}" if estimate.get("note") else ""
        lines.append(("run time, estimated", f"{estimate['seconds']:,.1f} s{rate} ({estimate['method']}{note})"))
    elif estimate:
        lines.append(("run time, estimated", estimate.get("hint") or estimate.get("method", "")))
    lines.append(("this plan took", f"{plan['plan_seconds']} s, {plan['peak_memory_mib']:,.0f} MiB of memory at most"))
    return lines
