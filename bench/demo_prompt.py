"""How often the demo's industry answers are right, per prompt variant (plain vLLM, no Ray).

    python bench/demo_prompt.py                      # before and after, 2,000 rows, seed 0
    python bench/demo_prompt.py --variants all       # and the variants that explain the choices
    python bench/demo_prompt.py --rows 20000 --seed 2 --exclude 2000:0,20000:1
                                                                    # held out: companies of none of those files

The demo (``llmbatch demo``) asks the model which industry each customer's company is in,
answers constrained to a list of labels. ``sample_data.known_industry`` knows the true
industry of the company names that reveal one ("Atlas Insurance" -> financial services).
This harness generates the same seeded customers file, takes its distinct revealing company
names, asks the model about each once with ``vllm.LLM.chat`` (temperature 0, the choice
constraint, the demo's chat template and ``max_model_len``), and prints per variant the share
of distinct companies answered right and the share of rows (each company weighted by its rows
in the file: what the demo prints). The engine loads once; each variant costs seconds.

"before" is the demo's prompt and labels before issue 8, frozen here; its right answers are
``BEFORE_TRUTH`` (the same trade words, mapped onto the labels of that time). "after" is
whatever ``llmbatch.demo`` ships. The other variants change one thing of "after" each.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from llmbatch.demo import FEW_SHOT, MAX_TOKENS, SYSTEM_PROMPT, USER_PROMPT
from llmbatch.models import DEFAULT_MODEL
from llmbatch.sample_data import INDUSTRIES, TRADE_INDUSTRY, customers, known_industry

BEFORE_LABELS = ["Law Firm", "Retail", "Technology", "Finance", "Healthcare", "Manufacturing", "Construction",
                 "Real Estate", "Hospitality", "Transportation", "Energy", "Education", "Media", "Agriculture", "Other"]
BEFORE_SYSTEM = "You classify companies by industry. Answer with the industry only."
BEFORE_USER = "Which industry is the company '{Company}' in?"
# The trade words of TRADE_INDUSTRY onto the labels before issue 8 (which had no consulting,
# food and beverage or automotive): same words reveal, "Security" still reveals none.
BEFORE_TRUTH = {
    "Legal": "Law Firm", "Law": "Law Firm", "Bakery": "Retail", "Foods": "Manufacturing", "Brewing": "Manufacturing",
    "Logistics": "Transportation", "Airlines": "Transportation", "Marine": "Transportation",
    "Software": "Technology", "Analytics": "Technology", "Robotics": "Technology", "Telecom": "Technology",
    "Consulting": "Other", "Construction": "Construction", "Dental": "Healthcare", "Health": "Healthcare",
    "Pharma": "Healthcare", "Realty": "Real Estate", "Motors": "Manufacturing", "Energy": "Energy",
    "Capital": "Finance", "Insurance": "Finance", "Bank": "Finance", "Media": "Media", "Games": "Media",
    "Apparel": "Retail", "Furniture": "Retail", "Textiles": "Manufacturing", "Hotels": "Hospitality",
    "Farms": "Agriculture", "Education": "Education", "Security": None,
}


def before_truth(company: str) -> str | None:
    for word in company.replace(",", " ").split():
        if BEFORE_TRUTH.get(word):
            return BEFORE_TRUTH[word]
    return None


@dataclass
class Variant:
    system: str | None
    user: str
    labels: list[str]
    truth: Callable[[str], str | None]
    note: str


def _examples(fmt: str, pairs=FEW_SHOT, label=lambda x: x) -> str:
    return "\n\n".join(fmt.format(c=c, l=label(l)) for c, l in pairs)


HEAD = "You classify companies by industry. Reply with the industry only.\n\n"
CAP = {label: label[0].upper() + label[1:] for label in INDUSTRIES}

VARIANTS: dict[str, Variant] = {
    "before": Variant(BEFORE_SYSTEM, BEFORE_USER, BEFORE_LABELS, before_truth,
                      "the demo before issue 8: instruction, question, capitalised labels"),
    "before, labels listed": Variant(
        f"You classify companies by industry. Answer with one of: {', '.join(BEFORE_LABELS)}.",
        BEFORE_USER, BEFORE_LABELS, before_truth, "the labels written into the system prompt"),
    "after": Variant(SYSTEM_PROMPT, USER_PROMPT, INDUSTRIES, known_industry,
                     "llmbatch.demo: lower-case labels, one chat-turn example per label, user turn = name"),
    "after, capitalised labels": Variant(
        HEAD + _examples("User: {c}\nAssistant: {l}", label=CAP.get), USER_PROMPT, [CAP[x] for x in INDUSTRIES],
        lambda c: CAP.get(known_industry(c)), "the same labels with a capital letter"),
    "after, no examples": Variant(
        f"You classify companies by industry. Reply with one of: {', '.join(INDUSTRIES)}.", USER_PROMPT,
        INDUSTRIES, known_industry, "the labels listed instead of examples"),
    "after, examples as a list": Variant(
        HEAD + "Examples:\n" + "\n".join(f"{c} -> {l}" for c, l in FEW_SHOT), USER_PROMPT, INDUSTRIES,
        known_industry, "examples as 'name -> label' lines instead of chat turns"),
    "after, question as user turn": Variant(
        SYSTEM_PROMPT, BEFORE_USER, INDUSTRIES, known_industry, "user turn = the old question"),
    "after, examples reordered": Variant(
        HEAD + _examples("User: {c}\nAssistant: {l}", random.Random(3).sample(FEW_SHOT, len(FEW_SHOT))),
        USER_PROMPT, INDUSTRIES, known_industry, "the same examples in another (seeded) order"),
}


def revealing_companies(rows: int, seed: int, exclude: set[str]) -> Counter:
    """Rows per distinct company name that reveals its industry (to both variants' truths)."""
    counts = Counter(r["Company"] for r in customers(rows, seed))
    return Counter({c: n for c, n in counts.items() if known_industry(c) is not None and c not in exclude})


def evaluate(llm, variant: Variant, companies: Counter) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(choice=variant.labels))
    names = list(companies)
    conversations = [([{"role": "system", "content": variant.system}] if variant.system else [])
                     + [{"role": "user", "content": variant.user.format(Company=c)}] for c in names]
    start = time.perf_counter()
    answers = [o.outputs[0].text for o in llm.chat(conversations, params, use_tqdm=False)]
    right = [a == variant.truth(c) for c, a in zip(names, answers)]
    return {
        "distinct_right": sum(right), "distinct": len(names),
        "rows_right": sum(companies[c] for c, ok in zip(names, right) if ok), "rows": sum(companies.values()),
        "answers": dict(Counter(answers).most_common()),
        "wrong": {c: {"answer": a, "known": variant.truth(c)} for c, a, ok in zip(names, answers, right) if not ok},
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000, help="rows of the seeded customers file (demo: 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the customers file (demo: 0)")
    parser.add_argument("--exclude", default="", help="ROWS:SEED,...: leave out the companies of these files "
                        "(a held-out check: the prompt was tuned on 2000:0 and on names of 20000:1)")
    parser.add_argument("--variants", default="before,after", help="comma-separated names, or 'all'")
    parser.add_argument("--unrevealing", action="store_true",
                        help="also ask about the names that reveal no industry: how many come out 'other'")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--json", help="write the results (wrong answers included) here")
    args = parser.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    assert set(TRADE_INDUSTRY) == set(BEFORE_TRUTH), "BEFORE_TRUTH must cover the trade words"

    exclude = {r["Company"] for spec in filter(None, args.exclude.split(","))
               for r in customers(*map(int, spec.split(":")))}
    companies = revealing_companies(args.rows, args.seed, exclude)
    print(f"{len(companies)} distinct revealing companies, {sum(companies.values()):,} rows of "
          f"{args.rows:,} (seed {args.seed}{', held out' if exclude else ''})", flush=True)

    from vllm import LLM

    from llmbatch.engines.vllm_setup import cpu_dtype
    from llmbatch.models import resolve_model

    # the demo's engine settings on CPU, with a small KV cache (the engine starts faster)
    model = resolve_model(args.model)
    llm = LLM(model, enforce_eager=True, max_model_len=512, seed=0, kv_cache_memory_bytes=256 * 1024 * 1024,
              dtype=cpu_dtype(model) or "auto")  # the dtype the demo's llmbatch engine runs in
    results = {}
    print("\n| variant | distinct companies right | rows right | what changes |\n| --- | ---: | ---: | --- |")
    for name in names:
        r = results[name] = evaluate(llm, VARIANTS[name], companies)
        print(f"| {name} | {r['distinct_right']}/{r['distinct']} = {100 * r['distinct_right'] / r['distinct']:.1f}% "
              f"| {r['rows_right']}/{r['rows']} = {100 * r['rows_right'] / r['rows']:.1f}% | {VARIANTS[name].note} |",
              flush=True)
    for name in names:
        print(f"{name}: answers {results[name]['answers']}")
    if args.unrevealing:
        counts = Counter(r["Company"] for r in customers(args.rows, args.seed))
        others = Counter({c: n for c, n in counts.items() if known_industry(c) is None and c not in exclude})
        for name in names:
            v = VARIANTS[name]
            fallback = v.labels[-1]  # the catch-all label, last in every variant
            catch_all = Variant(v.system, v.user, v.labels, lambda _c, label=fallback: label, v.note)
            r = results[name]["unrevealing"] = evaluate(llm, catch_all, others)
            r.pop("wrong")
            print(f"{name}: {r['distinct_right']}/{r['distinct']} names that reveal no industry answered "
                  f"{fallback!r}; answers {r['answers']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": args.rows, "seed": args.seed, "exclude": args.exclude, "model": args.model,
                       "variants": {n: {"note": VARIANTS[n].note, **results[n]} for n in names}}, fh, indent=1)


if __name__ == "__main__":
    main()
