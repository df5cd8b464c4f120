"""Seeded benchmark workloads: the same requests for every system under test.

Each workload is a list of rows ``{"id", "messages", "sampling_params"}``; systems must send
exactly these requests (llmbatch, plain vLLM and ray.data.llm alike).
"""

from __future__ import annotations

import random
from typing import Any

from llmbatch.sample_data import customers

# The demo's labels when the figures in RESULTS.md were taken, kept so that the workload stays
# the same (the demo's own prompt and labels changed since: see bench/demo_prompt.py).
INDUSTRIES = ["Law Firm", "Retail", "Technology", "Finance", "Healthcare", "Manufacturing", "Construction",
              "Real Estate", "Hospitality", "Transportation", "Energy", "Education", "Media", "Agriculture", "Other"]

SYSTEM = "You are a concise assistant for a CRM team."


def unique(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Unique prompts, equal output lengths (max_tokens=64, ignore_eos): raw engine speed."""
    rows = []
    for i, c in enumerate(customers(n, seed)):
        text = (f"Write one sentence introducing {c['First Name']} {c['Last Name']} of {c['Company']} "
                f"({c['City']}, {c['Country']}) to a new account manager.")
        rows.append({"id": i, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                     "sampling_params": {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}})
    return rows


def customers_industry(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The industry classification of the demo (its prompt before issue 8): one shared system
    prompt, companies repeat as in real customer data, short choice-constrained answers."""
    rows = []
    for i, c in enumerate(customers(n, seed)):
        rows.append({"id": i, "messages": [
            {"role": "system", "content": "You classify companies by industry. Answer with the industry only."},
            {"role": "user", "content": f"Which industry is the company '{c['Company']}' in?"}],
            "sampling_params": {"temperature": 0.0, "max_tokens": 8, "structured_outputs": {"choice": INDUSTRIES}}})
    return rows


def dates(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Date reformatting: medium outputs."""
    rng = random.Random(seed)
    rows = []
    for i, c in enumerate(customers(n, seed)):
        y, m, d = c["Subscription Date"].split("-")
        shown = rng.choice([f"{d}/{m}/{y}", f"{m}-{d}-{y}", f"{y}.{m}.{d}", f"{int(d)} {['Jan','Feb','Mar','Apr','May','Jun','Jul','Aug','Sep','Oct','Nov','Dec'][int(m)-1]} {y}"])
        rows.append({"id": i, "messages": [
            {"role": "user", "content": f"Rewrite the date '{shown}' as ISO 8601 (YYYY-MM-DD) and then say which weekday it was."}],
            "sampling_params": {"temperature": 0.0, "max_tokens": 40}})
    return rows


def mixed_lengths(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Long free-form generation with very mixed output lengths (16..512, ignore_eos)."""
    rng = random.Random(seed)
    rows = []
    for i, c in enumerate(customers(n, seed)):
        rows.append({"id": i, "messages": [
            {"role": "user", "content": f"Write a detailed account plan for {c['Company']} in {c['City']}."}],
            "sampling_params": {"temperature": 0.0, "max_tokens": rng.randint(16, 512), "ignore_eos": True}})
    return rows


def duplicates(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Half of the rows repeat other rows exactly (greedy): dedup's home ground."""
    rng = random.Random(seed)
    base = unique(max(1, n // 2), seed)
    for r in base:
        r["sampling_params"] = {"temperature": 0.0, "max_tokens": 48}
    rows = []
    for i in range(n):
        src = base[i] if i < len(base) else rng.choice(base)
        rows.append({"id": i, "messages": src["messages"], "sampling_params": dict(src["sampling_params"])})
    rng.shuffle(rows)
    for i, r in enumerate(rows):
        r["id"] = i
    return rows


WORKLOADS = {"unique": unique, "customers": customers_industry, "dates": dates, "mixed": mixed_lengths,
             "duplicates": duplicates}
