"""Which mixes of LoRA adapters in one engine step does plain vLLM get right? (issue 30)

    python bench/lora_mix.py [--dtype float32] [--out bench/lora-mix-results/cpu.json]

Plain ``vllm.LLM`` on SmolLM2-135M-Instruct with the seeded test adapters (``llmbatch models
make-test-models``: smollm2-lora-a, -b, -c; rank 8, 16, 8 on q_proj/v_proj). The reference of
each configuration (the base model, each adapter) is one ``generate`` call holding only that
configuration's rows; then each mix (base + one adapter, two adapters, three, base + three) is
one call with the configurations' rows interleaved, and every row's greedy tokens are compared
with its configuration's reference. Once with ``max_loras=1`` and once with ``max_loras=4`` (more
than the adapters in flight). The base model's rows are also compared with an engine without
LoRA. float32 by default, so that the batch's own rounding (larger in bfloat16) cannot pass for
a wrong adapter; a wrong adapter changes answers from the first tokens on.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ADAPTERS = ["smollm2-lora-a", "smollm2-lora-b", "smollm2-lora-c"]
MIXES = [["base", "smollm2-lora-a"], ["smollm2-lora-a", "smollm2-lora-b"], ["base", "smollm2-lora-a", "smollm2-lora-b"],
         ADAPTERS, ["base", *ADAPTERS]]


def prompts(n: int) -> list[str]:
    return [f"Customer question {i}: how do I return an order of {w}?" for i, w in
            zip(range(n), ["shoes", "a lamp", "coffee", "a phone", "books", "paint", "a bike", "tea"] * n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, default=8, help="rows per configuration")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from llmbatch.models import prepare
    from llmbatch.toy_models import make_test_models

    model = str(prepare("smollm2-135m-instruct"))
    folders = make_test_models()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    texts = prompts(args.rows)
    common = dict(max_model_len=256, enforce_eager=True, dtype=args.dtype)
    result: dict = {"vllm": __import__("vllm").__version__, "machine": platform.processor() or platform.machine(),
                    "dtype": args.dtype, "rows_per_config": args.rows, "tokens": args.tokens, "runs": []}

    plain = LLM(model=model, **common)
    no_lora = [list(o.outputs[0].token_ids) for o in plain.generate(texts, params, use_tqdm=False)]
    del plain

    for max_loras in (1, 2, 4):
        llm = LLM(model=model, enable_lora=True, max_lora_rank=16, max_loras=max_loras, **common)
        requests = {"base": None}
        requests.update({name: LoRARequest(name, i + 1, str(folders[name])) for i, name in enumerate(ADAPTERS)})

        def run(configs: list[str]) -> dict[str, list[list[int]]]:
            """One generate call, the configurations' rows interleaved; tokens per configuration."""
            order = [(c, i) for i in range(args.rows) for c in configs]
            outs = llm.generate([texts[i] for _, i in order], params, use_tqdm=False,
                                lora_request=[requests[c] for c, _ in order])
            got: dict[str, list] = {c: [None] * args.rows for c in configs}
            for (c, i), o in zip(order, outs):
                got[c][i] = list(o.outputs[0].token_ids)
            return got

        alone = {c: run([c])[c] for c in ["base", *ADAPTERS]}
        base_alone_vs_no_lora = sum(a != b for a, b in zip(alone["base"], no_lora))
        adapters_change_answers = {a: sum(x != y for x, y in zip(alone[a], alone["base"])) for a in ADAPTERS}
        for mix in MIXES:
            t = time.time()
            got = run(mix)
            wrong = {c: sum(g != r for g, r in zip(got[c], alone[c])) for c in mix}
            entry = {"max_loras": max_loras, "mix": mix, "wrong_rows": wrong, "rows": args.rows,
                     "base_alone_vs_no_lora_engine": base_alone_vs_no_lora,
                     "adapter_rows_differing_from_base_alone": adapters_change_answers,
                     "seconds": round(time.time() - t, 2)}
            result["runs"].append(entry)
            print(json.dumps(entry), flush=True)
        del llm
    print(f"\n{'max_loras':>9}  {'mix':40} wrong rows per configuration (of {args.rows})")
    for e in result["runs"]:
        print(f"{e['max_loras']:>9}  {' + '.join(m.replace('smollm2-lora-', '') for m in e['mix']):40} "
              + ", ".join(f"{k.replace('smollm2-lora-', '')}: {v}" for k, v in e["wrong_rows"].items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
