"""Plain vLLM's chat, for comparison: ``python vllm_chat_reference.py request.pkl answer.json``.

The request (a pickle: the test wrote it) names the model, engine settings, sampling params and
conversations whose images are encoded bytes in ``{"type": "image_pil", "image_pil": bytes}``
parts; each becomes the PIL image those bytes decode to, and all conversations go to one
``vllm.LLM.chat`` call. The answer holds, per conversation, the generated token ids and the
prompt's token count (image tokens included).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys

if __name__ == "__main__":
    from PIL import Image
    from vllm import LLM, SamplingParams

    req = pickle.load(open(sys.argv[1], "rb"))
    for conv in req["conversations"]:
        for msg in conv:
            for part in msg["content"] if isinstance(msg["content"], list) else []:
                if part.get("type") == "image_pil":
                    part["image_pil"] = Image.open(io.BytesIO(part["image_pil"])).convert("RGB")
    from llmbatch.engines.vllm_setup import cpu_dtype

    # the same settings as llmbatch's engine: where they name no dtype, the one llmbatch picks on
    # this CPU (float32 where it has no native bfloat16)
    settings = {"dtype": cpu_dtype(req["model"]) or "auto", **req["engine_kwargs"]}
    if os.environ.get("LLMBATCH_CPU_KV_CACHE_BYTES"):  # the suite's KV cache size, as llmbatch's engines get
        settings.setdefault("kv_cache_memory_bytes", int(os.environ["LLMBATCH_CPU_KV_CACHE_BYTES"]))
    from llmbatch import startlog

    with startlog.timed("vllm-reference", model=req["model"]):
        llm = LLM(model=req["model"], **settings)
    outs = llm.chat(req["conversations"], SamplingParams(**req["sampling_params"]), use_tqdm=False)
    json.dump([{"tokens": list(o.outputs[0].token_ids), "num_input_tokens": len(o.prompt_token_ids),
                "prompt": o.prompt} for o in outs], open(sys.argv[2], "w"))
