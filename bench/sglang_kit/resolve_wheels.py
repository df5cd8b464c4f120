#!/usr/bin/env python3
"""List (and download) the wheels SGLang 0.5.17 needs beyond the GPU image's packages.

Walks Requires-Dist from ``sglang==0.5.17`` recursively (extras only where a parent asked for
them), stops at packages the GPU image already has (IMAGE, from the device's KINDS.md: torch
2.11.0, numpy, pyarrow, transformers' own stack...) unless they are pinned to another version
in PINS, and downloads the newest wheel every specifier seen so far allows, for CPython 3.12
on Linux x86_64 (the GPU image's Python). Not a backtracking resolver: a clash is fixed by a
pin in PINS. Run it with a Python 3.12 that has ``packaging`` (markers are evaluated for the
running interpreter):

    python3.12 bench/sglang_kit/resolve_wheels.py OUTDIR [NAME [REQ ...]]

writes OUTDIR/../NAME.json (default NAME ``sglang``, REQ ``sglang==0.5.17``): the wheels to
carry, with who needs them, and the image packages relied on. ``pack_kit.sh`` runs it twice:
for SGLang, and for llmbatch's own needs on the image (``ray[data]==2.60.0``, jsonschema, gguf).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

HERE = os.path.dirname(os.path.abspath(__file__))
#: The GPU image's packages (KINDS.md, "Python packages already there", read 2026-11-17).
IMAGE = {canonicalize_name(n) for n in open(os.path.join(HERE, "image-packages.txt")).read().split()}
#: Image packages whose version SGLang pins to another one: carried anyway (SGLang's kit only).
#: transformers 5.12.1 checks at import that tokenizers <= 0.23.0 and huggingface-hub < 2.0 (the
#: image's transformers 5.17 may come with newer ones): those are carried too, at the newest allowed.
PINS = {"transformers": "==5.12.1", "tokenizers": ">=0.22.0,<0.23", "huggingface-hub": ">=1.5.0,<2.0"}
#: Not carried, with the reason (see README.md); the walk does not descend into them.
SKIP = {canonicalize_name(n) for n in open(os.path.join(HERE, "skip.txt")).read().split()
        if n and not n.startswith("#")} if os.path.exists(os.path.join(HERE, "skip.txt")) else set()
PLATS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)]


def download(req: str, out: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", out, "-q"]
    for p in PLATS:
        cmd += ["--platform", p]
    r = subprocess.run(cmd + [req], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"download failed for {req}: {r.stderr[-800:]}")


def wheels_of(out: str) -> dict[str, list[tuple[Version, str]]]:
    res: dict[str, list[tuple[Version, str]]] = {}
    for w in glob.glob(os.path.join(out, "*.whl")):
        name, ver = os.path.basename(w).split("-")[:2]
        res.setdefault(canonicalize_name(name), []).append((Version(ver), w))
    return res


def requires(whl: str) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    name = sys.argv[2] if len(sys.argv) > 2 else "sglang"
    pins = PINS if name == "sglang" else {}
    specs: dict[str, SpecifierSet] = {k: SpecifierSet(v) for k, v in pins.items()}
    extras: dict[str, set[str]] = {}
    parents: dict[str, set[str]] = {}
    chosen: dict[str, tuple[Version, str]] = {}
    image_hits: dict[str, set[str]] = {}
    # dill: sglang.srt.sampling.custom_logit_processor imports it at module level (on every
    # Engine's import path), but SGLang only gets it through datasets, which is not carried
    roots = [Requirement(r) for r in (sys.argv[3:] or ["sglang==0.5.17", "dill"])]
    todo = [(r.name, r.specifier, set(r.extras), "<root>") for r in roots]
    while todo:
        req_name, spec, ex, parent = todo.pop(0)
        cn = canonicalize_name(req_name)
        parents.setdefault(cn, set()).add(parent)
        if cn in SKIP:
            continue
        if cn in IMAGE and cn not in pins:
            image_hits.setdefault(cn, set()).add(f"{parent}: {spec or 'any'}")
            continue
        specs[cn] = specs.get(cn, SpecifierSet()) & spec
        new_ex = ex - extras.get(cn, set())
        extras[cn] = extras.get(cn, set()) | ex
        have = chosen.get(cn)
        if have and specs[cn].contains(have[0], prereleases=True) and not new_ex:
            continue
        if not have or not specs[cn].contains(have[0], prereleases=True):
            if have:
                os.remove(have[1])
            download(f"{req_name}{specs[cn]}", out)
            ws = sorted(w for w in wheels_of(out)[cn] if specs[cn].contains(w[0], prereleases=True))
            chosen[cn] = ws[-1]
        for r in requires(chosen[cn][1]):
            req = Requirement(r)
            if req.marker is not None:
                if "extra" in str(req.marker):
                    if not any(e and req.marker.evaluate({"extra": e}) for e in extras[cn]):
                        continue
                elif not req.marker.evaluate({"extra": ""}):
                    continue
            todo.append((req.name, req.specifier, set(req.extras), f"{cn}{sorted(extras[cn]) if extras[cn] else ''}"))
    rows = [{"name": cn, "version": str(v), "file": os.path.basename(p), "mb": round(os.path.getsize(p) / 2**20, 2),
             "parents": sorted(parents[cn]), "spec": str(specs[cn])} for cn, (v, p) in sorted(chosen.items())]
    json.dump({"carry": rows, "image_hits": {k: sorted(v) for k, v in sorted(image_hits.items())},
               "skipped": {k: sorted(parents.get(k, [])) for k in sorted(SKIP) if k in parents}},
              open(os.path.join(out, "..", f"{name}.json"), "w"), indent=1)
    for r in rows:
        print(f"{r['name']}=={r['version']}\t{r['mb']:8.2f} MB\t<- {', '.join(r['parents'])[:110]}")
    print("total MB:", round(sum(r["mb"] for r in rows), 1))
    print("image packages required:", "; ".join(f"{k} ({', '.join(v)})" for k, v in sorted(image_hits.items())))


if __name__ == "__main__":
    main()
