"""``llmbatch plan``: what a job will cost, before it runs.

Reads the input as a stream (memory stays flat however many rows there are: a few numbers
per row) and runs each batch of rows through the job's own CPU stages, in this process: the
processor the job would run is built (no Ray, no engine started) and its stages before the
engine (the job's preprocess, the multimodal stage where the job has one, the chat template,
tokenize) run on the rows; then the engine builds each row's request, whose key is the one the
engine stage deduplicates with. It reports rows, prompt tokens (min/median/max), rows that
cannot fit ``max_model_len``, duplicate requests (answered once with dedup), the share of
prompt tokens in prefixes shared with an earlier prompt (prefix-cache hits, in the engine's
16-token blocks), and an estimate of the run time from a given throughput or a short
calibration run. For an endpoint (``processor: http`` or ``serve``) whose model is not a local
one, prompt tokens are estimated as the endpoint's rate limits count them (about four characters
a token), and the run time follows from its ``qps``/``tokens_per_minute``.
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
from llmbatch.io.readers import READ_ERROR
from llmbatch.jobs.driver import build_job_processor
from llmbatch.jobs.job import Job, Row
from llmbatch.jobs.kinds import job_for
from llmbatch.jobs.run import run_job
from llmbatch.jobs.spec import JobSpec, load_job
from llmbatch.models import load_tokenizer
from llmbatch.openai.client import estimate_tokens
from llmbatch.rows import DEFAULT_MAX_TOKENS, is_error, normalize_messages
from llmbatch.stages.base import Stage
from llmbatch.stages.chat_template import ChatTemplateStage
from llmbatch.stages.tokenize import TokenizeStage
from llmbatch.stages.warm import WarmEngineStage

BLOCK = 16  # vLLM's default KV block size: the unit of prefix caching
BATCH = 4096


class _Sample:
    """The job's CPU stages and its engine's request builder, run here on batches of rows; what
    a plan needs of each row is kept as a few numbers."""

    def __init__(self, job: Job):
        processor = build_job_processor(job)  # builds, starts nothing
        self.stages: list[Stage] = [spec.stage for spec in processor.layout.pre]
        engine = processor.layout.engine  # (the engine stage itself, also where a warm host would run it)
        self.engine = (engine.local if isinstance(engine, WarmEngineStage) else engine).engine
        self.generate = job.task == "generate"
        tokenize = next((s for s in self.stages if isinstance(s, TokenizeStage)), None)
        self.hosted = False
        if tokenize is None:  # an endpoint: its model's tokenizer where this machine has it
            try:
                load_tokenizer(job.spec.model.source)
            except Exception:  # noqa: BLE001 - a hosted model's name: estimate its tokens instead
                self.hosted = True
            else:
                tokenize = TokenizeStage(job.spec.model.source, task=job.task)
                self.stages += [ChatTemplateStage(job.spec.model.source), tokenize]
        for stage in self.stages:
            stage.ensure_setup()
        #: every row's tokens are counted, also a row too long (tokenize then leaves it whole)
        self.max_len = tokenize.max_model_len if tokenize is not None else None
        if tokenize is not None:
            tokenize.max_model_len = None
        self.counts: list[np.ndarray] = []
        self.keys: list[np.ndarray] = []   # 64 bits of each shared request's key
        self.unkeyed = 0
        self.wants: list[np.ndarray] = []
        self.blocks: list[np.ndarray] = []
        self.bad_rows = 0

    def add(self, rows: list[Row]) -> None:
        for stage in self.stages:
            todo = [r for r in rows if not is_error(r) and stage.check_keys(r)]
            if todo:
                stage.process_batch(todo)
        counts: list[int] = []
        keys: list[int] = []
        wants: list[int] = []
        blocks: list[int] = []
        for row in rows:
            if is_error(row):
                self.bad_rows += 1
                continue
            try:
                key = self.engine.build_request(row).key
                tokens = self._tokens(row)
            except Exception:  # noqa: BLE001 - a row the job would turn into an error row
                self.bad_rows += 1
                continue
            counts.append(tokens)
            if key is None:  # never shared (a sampled answer): it runs
                self.unkeyed += 1
            else:
                keys.append(digest64(key) if isinstance(key, str) else int.from_bytes(bytes(key)[:8], "little"))
            sp = row.get("sampling_params") if self.generate else None
            wants.append(int((sp or {}).get("max_tokens") or DEFAULT_MAX_TOKENS) if self.generate else 0)
            ids = row.get("tokenized_prompt")
            h = 0
            for start in range(0, len(ids or ()) - BLOCK + 1, BLOCK):
                h = hash((h, tuple(ids[start:start + BLOCK])))
                blocks.append(h)
        self.counts.append(np.asarray(counts, dtype=np.int32))
        self.keys.append(np.asarray(keys, dtype=np.uint64))
        self.wants.append(np.asarray(wants, dtype=np.int32))
        if blocks:
            self.blocks.append(np.asarray(blocks, dtype=np.int64))

    def unique_requests(self) -> int:
        keys = np.concatenate(self.keys) if self.keys else np.zeros(0, np.uint64)
        return int(np.unique(keys).size) + self.unkeyed

    def _tokens(self, row: Row) -> int:
        if self.hosted:
            if row.get("messages") is not None:
                return estimate_tokens({"messages": normalize_messages(row["messages"])})
            return estimate_tokens({"prompt": str(row["prompt"])})
        return len(row["tokenized_prompt"]) + len(row.get("tokenized_prompt_2") or ())


def plan_job(spec: JobSpec, *, throughput: float | None = None, calibrate_rows: int = 0) -> dict[str, Any]:
    """The plan for ``spec`` (see module docstring)."""
    started = time.perf_counter()
    job = job_for(spec)
    endpoint = isinstance(job.config, EndpointProcessorConfig)
    sample = _Sample(job)
    rows = read_errors = 0
    checked_fields = False
    for batch in job.kind.read(job, BATCH):
        if not checked_fields:
            job.kind.check_columns(job, [k for k in batch[0] if k != READ_ERROR])
            checked_fields = True
        readable = []
        for row in batch:
            rows += 1
            if row.pop(READ_ERROR, ""):
                read_errors += 1
            else:
                readable.append(row)
        sample.add(readable)
    if rows == 0:
        raise ConfigError(f"the input {spec.input.path} has no rows")
    tokens = np.concatenate(sample.counts) if sample.counts else np.zeros(0, np.int32)
    wants_all = np.concatenate(sample.wants) if sample.wants else np.zeros(0, np.int32)
    unique_requests = sample.unique_requests()
    all_blocks = np.concatenate(sample.blocks) if sample.blocks else np.zeros(0, np.int64)
    shared_tokens = (all_blocks.size - np.unique(all_blocks).size) * BLOCK
    total_tokens = int(tokens.sum())
    answered = int(tokens.size)
    max_len, generate = sample.max_len, sample.generate
    # a generated answer needs room after the prompt; a pooled text may fill the context
    over = int(((tokens >= max_len) if generate else (tokens > max_len)).sum()) if max_len else 0
    no_room = int(((tokens + wants_all) > max_len).sum()) if max_len else 0
    plan: dict[str, Any] = {
        "input": spec.input.path,
        "model": spec.model.source,
        "rows": rows,
        "rows_unreadable": read_errors,
        "rows_failing_preprocess": sample.bad_rows,
        "prompt_tokens": {
            "min": int(tokens.min()) if answered else 0,
            "median": float(np.median(tokens)) if answered else 0.0,
            "max": int(tokens.max()) if answered else 0,
            "total": total_tokens,
        },
        "max_model_len": max_len,
        "rows_over_max_model_len": over,
        "task": job.task,
        "rows_where_max_tokens_does_not_fit": no_room,
        "duplicate_requests": answered - unique_requests,
        "unique_requests": unique_requests,
        "shared_prefix_token_share": (round(shared_tokens / total_tokens, 4) if total_tokens else 0.0)
        if not sample.hosted else None,
        "prompt_tokens_estimated": sample.hosted,
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
