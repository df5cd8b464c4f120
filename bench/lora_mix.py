"""Which mixes of LoRA adapters in one engine step does plain vLLM get right? (issue 30)

    python bench/lora_mix.py [--dtype float32] [--out bench/lora-mix-results/cpu-float32.json]
    python bench/lora_mix.py --make-model DIR          # a small seeded model + 3 adapters to carry
    python bench/lora_mix.py --model DIR/model --adapters DIR/adapters --rows 32 --out gpu.json

Plain ``vllm.LLM``, by default on SmolLM2-135M-Instruct with the seeded test adapters (``llmbatch
models make-test-models``: smollm2-lora-a, -b, -c; rank 8, 16, 8 on q_proj/v_proj); with
``--model``/``--adapters`` on any model folder and folder of peft adapters (``--make-model``
builds a 4-layer Llama on SmolLM2's tokenizer, 33 MB in bfloat16, small enough to carry to a GPU
machine, with weights scaled so that greedy answers are not near-ties, and three rank-8 adapters
strong enough to change every answer). The reference of each configuration (the base model, each
adapter) is one ``generate`` call holding only that configuration's rows; then each mix (base +
one adapter, two adapters, three, base + three) is one call with the configurations' rows
interleaved, and every row's greedy tokens are compared with its configuration's reference. Once
per ``--max-loras`` (1, 2, 4: below, at and above the adapters in flight). A control measures
the batch's own variance: each configuration's rows interleaved with as many other prompts of the
same configuration as the largest mix holds, compared with the same reference; a wrong mix shows
as rows wrong beyond the control's. The base model's rows are also compared with an engine
without LoRA. float32 by default, so that the batch's own rounding (larger in bfloat16) cannot
pass for a wrong adapter; a wrong adapter changes answers from the first tokens on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ADAPTERS = ["smollm2-lora-a", "smollm2-lora-b", "smollm2-lora-c"]
SMOLLM2 = os.path.expanduser("~/.cache/llmbatch/models/smollm2-135m-instruct")


def mixes(adapters: list[str]) -> list[list[str]]:
    a, b = adapters[0], adapters[1]
    return [["base", a], [a, b], ["base", a, b], list(adapters), ["base", *adapters]]


def prompts(n: int, offset: int = 0) -> list[str]:
    things = ["shoes", "a lamp", "coffee", "a phone", "books", "paint", "a bike", "tea"]
    return [f"Customer question {i}: how do I return an order of {things[i % len(things)]}?"
            for i in range(offset, offset + n)]


def make_model(out: Path, tokenizer: str = SMOLLM2) -> None:
    """A 4-layer Llama (hidden 256, head_dim 64) on SmolLM2's tokenizer, seeded, bfloat16, and
    three peft adapters (rank 8 on q_proj/v_proj, seeds 11-13) in ``out/model``, ``out/adapters``.
    The embeddings (tied to the head) have std 0.3 and the layers 1/sqrt(hidden), so the logits
    spread over several units and each layer moves the residual as much as the embedding does;
    the adapters' B matrices are scaled up so that they change answers from the first tokens."""
    import shutil

    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0, 0.3)
            elif p.dim() == 2:
                p.normal_(0, config.hidden_size ** -0.5)
    (out / "model").mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out / "model")
    for name in os.listdir(tokenizer):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(tokenizer, name), out / "model" / name)
    for i, name in enumerate(["lora-a", "lora-b", "lora-c"]):
        torch.manual_seed(11 + i)
        base = transformers.LlamaForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False))
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(4.0)
        peft_model.save_pretrained(out / "adapters" / name)
    print(f"model and adapters in {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, default=8, help="rows per configuration")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--max-loras", default="1,2,4")
    ap.add_argument("--model", default="", help="model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--adapters", default="", help="folder of peft adapters (default: the test adapters)")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs / compile (default: enforce_eager)")
    ap.add_argument("--make-model", default="", help="build a small seeded model + 3 adapters here and exit")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.make_model:
        return make_model(Path(args.make_model))

    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    if args.model:
        model = args.model
        folders = {e.name: e.path for e in sorted(os.scandir(args.adapters), key=lambda e: e.name)
                   if os.path.exists(os.path.join(e.path, "adapter_config.json"))}
    else:
        from llmbatch.models import prepare
        from llmbatch.toy_models import make_test_models

        model = str(prepare("smollm2-135m-instruct"))
        made = make_test_models()
        folders = {name: str(made[name]) for name in ADAPTERS}
    adapters = list(folders)[:3]
    ranks = [json.loads(Path(folders[a], "adapter_config.json").read_text())["r"] for a in adapters]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    texts = prompts(args.rows)
    all_mixes = mixes(adapters)
    widest = max(len(m) for m in all_mixes)
    fillers = prompts(args.rows * (widest - 1), offset=args.rows)
    common = dict(max_model_len=256, enforce_eager=not args.graphs, dtype=args.dtype)
    if torch.cuda.is_available():  # a small model: leave room in case an engine's memory is freed late
        common["gpu_memory_utilization"] = 0.15
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else (platform.processor() or platform.machine())
    result: dict = {"vllm": __import__("vllm").__version__, "torch": torch.__version__, "machine": device,
                    "model": os.path.basename(model.rstrip("/")), "adapters": dict(zip(adapters, ranks)),
                    "dtype": args.dtype, "enforce_eager": not args.graphs, "rows_per_config": args.rows,
                    "tokens": args.tokens, "runs": [], "controls": []}

    plain = LLM(model=model, **common)
    no_lora = [list(o.outputs[0].token_ids) for o in plain.generate(texts, params, use_tqdm=False)]
    del plain
    torch.cuda.empty_cache() if torch.cuda.is_available() else None

    for max_loras in [int(x) for x in args.max_loras.split(",")]:
        llm = LLM(model=model, enable_lora=True, max_lora_rank=max(16, *ranks), max_loras=max_loras, **common)
        requests = {"base": None}
        requests.update({name: LoRARequest(name, i + 1, folders[name]) for i, name in enumerate(adapters)})

        def run(configs: list[str], extra: list[str] = ()) -> dict[str, list[list[int]]]:
            """One generate call, the configurations' rows interleaved (``extra``: more rows of the
            first configuration, on other prompts, interleaved too); tokens per configuration."""
            order = [(c, i) for i in range(args.rows) for c in configs]
            rows = [(texts[i], requests[c]) for c, i in order]
            if extra:  # the control: measured rows and filler rows of the same configuration alternate
                per = len(extra) // args.rows
                rows = [r for i in range(args.rows) for r in
                        [rows[i], *[(t, requests[configs[0]]) for t in extra[i * per:(i + 1) * per]]]]
                order = [o for i in range(args.rows) for o in [order[i], *[("filler", -1)] * per]]
            outs = llm.generate([t for t, _ in rows], params, use_tqdm=False, lora_request=[lr for _, lr in rows])
            got: dict[str, list] = {c: [None] * args.rows for c in configs}
            for (c, i), o in zip(order, outs):
                if c != "filler":
                    got[c][i] = list(o.outputs[0].token_ids)
            return got

        alone = {c: run([c])[c] for c in ["base", *adapters]}
        base_alone_vs_no_lora = sum(a != b for a, b in zip(alone["base"], no_lora))
        adapters_change_answers = {a: sum(x != y for x, y in zip(alone[a], alone["base"])) for a in adapters}
        for c in ["base", *adapters]:
            got = run([c], extra=fillers)
            entry = {"max_loras": max_loras, "config": c, "batch_rows": args.rows * widest,
                     "wrong_rows": sum(g != r for g, r in zip(got[c], alone[c])), "rows": args.rows}
            result["controls"].append(entry)
            print(json.dumps(entry), flush=True)
        for mix in all_mixes:
            t = time.time()
            got = run(mix)
            wrong = {c: sum(g != r for g, r in zip(got[c], alone[c])) for c in mix}
            # a wrong row that carries another configuration's answer (the adapter's, say)
            wrong_as = {c: {o: sum(g != r and g == x for g, r, x in zip(got[c], alone[c], alone[o]))
                            for o in mix if o != c} for c in mix if wrong[c]}
            entry = {"max_loras": max_loras, "mix": mix, "wrong_rows": wrong, "wrong_rows_equal_to": wrong_as,
                     "rows": args.rows, "base_alone_vs_no_lora_engine": base_alone_vs_no_lora,
                     "adapter_rows_differing_from_base_alone": adapters_change_answers,
                     "seconds": round(time.time() - t, 2)}
            result["runs"].append(entry)
            print(json.dumps(entry), flush=True)
        llm = None  # this engine goes (its memory with it) before the next one starts
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    short = {"base": "base", **{a: a.replace("smollm2-", "").replace("lora-", "") for a in adapters}}
    print(f"\n{result['machine']} {args.dtype}: wrong rows per configuration (of {args.rows})")
    print(f"{'max_loras':>9}  {'mix':28} wrong rows")
    for e in result["controls"]:
        print(f"{e['max_loras']:>9}  {'control ' + short[e['config']] + ' x' + str(widest):28} {e['wrong_rows']}")
    for e in result["runs"]:
        print(f"{e['max_loras']:>9}  {' + '.join(short[m] for m in e['mix']):28} "
              + ", ".join(f"{short[k]}: {v}" for k, v in e["wrong_rows"].items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
