"""Image captioning throughput: llmbatch against plain ``vllm.LLM.chat``, same images, same model,
same engine settings, same timing windows.

    python bench/mm_bench.py --smoke                     # this CPU: the tiny seeded VLM, 24 images
    python bench/mm_bench.py --model DIR --device gpu --load-format dummy --rows 2000 --repeats 3
    python bench/mm_bench.py ... --repeats 1 --start-repeat 1 --json r1.json   # one repeat per call
    python bench/mm_bench.py --merge r0.json r1.json r2.json                    # one table of them

Workload (the seeds' captioning flow): N seeded images (PIL-drawn, JPEG/PNG, ``--image-size``)
in a Parquet file of bytes, written once before any run; per row the preprocess decodes the
bytes, converts to RGB and resizes (``--resize``), and asks "Describe this image in one
sentence." (greedy, ``--max-tokens``, ``ignore_eos`` so both systems generate the same count).
Every system runs in a fresh process, interleaved (vllm, llmbatch, llmbatch, vllm, ...):

- ``vllm``: read the Parquet file, decode+resize every image in the process, one
  ``LLM.chat(all conversations)``, write ``id, caption`` to Parquet;
- ``llmbatch``: ``ray.data.read_parquet`` -> the processor (preprocess decodes+resizes, the
  multimodal stage hands the images to vLLM's chat path, both inside the engine replica, the
  default) -> ``write_parquet``;
- ``llmbatch-pool`` (add it with ``--systems vllm,llmbatch,llmbatch-pool``): the same, with the
  preprocess and the multimodal stage in CPU workers of their own (``--mm-concurrency``).

Windows, measured identically for both:
- **wall** (the headline): from the parent starting the process to the output file closed;
- **steady**: from the engine ready (plain vLLM: ``LLM(...)`` returned; llmbatch: its replica's
  ``ready_at``) to the output file closed.

Beside them, the CPU side: images decoded and resized per second by one core (the preprocess
alone, timed in the parent on the same images), to compare with the engine's images/s: the CPU
stages keep the GPU fed while ``cores x that >= engine images/s``. Raw JSON: ``--json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "Describe this image in one sentence."


def engine_kwargs(args) -> dict:
    kw = {"max_model_len": args.max_model_len, "limit_mm_per_prompt": {"image": 1}}
    if args.device == "cpu":
        kw.update(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mib << 20)
        from llmbatch.engines.vllm_setup import native_bf16

        if not native_bf16():  # the float32 llmbatch picks on such a CPU, pinned for every system
            kw["dtype"] = "float32"
    else:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.load_format:
        kw["load_format"] = args.load_format
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    return kw


def sampling(args) -> dict:
    return {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}


def decode_resize(data: bytes, size: int):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB").resize((size, size))


def conversation(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": PROMPT}]}]


def write(path: Path, ids: list[int], captions: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "caption": captions}), path)


# -- the systems (run in the child process) -------------------------------------------------------


def run_vllm(args, out: Path) -> dict:
    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    ready = time.time()
    table = pq.read_table(args.data)
    ids = table.column("id").to_pylist()
    convs = []
    for data in table.column("image").to_pylist():
        image = decode_resize(data, args.resize)
        convs.append([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                   {"type": "text", "text": PROMPT}]}])
    outs = llm.chat(convs, SamplingParams(**sampling(args)), use_tqdm=False)
    write(out, ids, [o.outputs[0].text for o in outs])
    done = time.time()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    llm.llm_engine.engine_core.shutdown()
    return {"ready_at": ready, "done_at": done, "rows": len(outs), "errors": 0, "output_tokens": tokens,
            "input_tokens": prompt_tokens}


def run_llmbatch(args, out: Path, pool: int | None = None) -> dict:
    import pyarrow.parquet as pq
    import ray

    from llmbatch import vLLMEngineProcessorConfig
    from llmbatch.builders import build_layout
    from llmbatch.processor import Processor
    from llmbatch.rows import STATS
    from llmbatch.stages.output import OutputStage

    ray.init(include_dashboard=False, logging_level="WARNING")
    ray_ready = time.time()
    ray.data.DataContext.get_current().enable_progress_bars = False
    # llmbatch-pool: the preprocess and the multimodal stage in a pool of CPU workers of their
    # own (images travel decoded to the replica); llmbatch: both inside the engine replica
    mm = {"enabled": True, **({"concurrency": (1, pool)} if pool else {})}
    config = vLLMEngineProcessorConfig(model_source=args.model, engine_kwargs=engine_kwargs(args),
                                       batch_size=args.batch_size, should_continue_on_error=True,
                                       prepare_multimodal_stage=mm)
    size, params = args.resize, sampling(args)
    processor = Processor(config, build_layout(
        config, preprocess=lambda r: {"messages": conversation(decode_resize(r["image"], size)), "sampling_params": params},
        preprocess_map_kwargs={"concurrency": (1, pool)} if pool else None,
        postprocess=lambda r: {"id": r["id"], "caption": r["generated_text"], "n_out": r["num_generated_tokens"],
                               "n_in": r["num_input_tokens"]},
        output=OutputStage(keep_private=(STATS,))))
    folder = out.with_suffix(".d")
    execute_at = time.time()  # the processor built; Ray Data plans, reads and starts the replica from here
    processor(ray.data.read_parquet(args.data)).write_parquet(str(folder))
    done = time.time()
    table = pq.read_table(folder)
    stats = [s for s in table.column(STATS).to_pylist() if s]
    ready = min((s["ready_at"] for s in stats if s.get("ready_at")), default=None)
    errors = table.num_rows - sum(1 for c in table.column("caption").to_pylist() if c is not None)
    ray.shutdown()
    # start-up phases: Ray up, the replica's engine start begun, its first request to the engine
    phases = {"ray_ready_at": ray_ready, "execute_at": execute_at,
              **{key: min((s[key] for s in stats if s.get(key)), default=None)
                 for key in ("process_start_at", "begin_at")},  # the replica's process, its stages' start
              "replica_start_at": min((s["start_at"] for s in stats if s.get("start_at")), default=None),
              "first_request_at": min((s["first_request_at"] for s in stats if s.get("first_request_at")), default=None)}
    return {**phases, "ready_at": ready, "done_at": done, "rows": table.num_rows, "errors": errors,
            "output_tokens": sum(n or 0 for n in table.column("n_out").to_pylist()),
            "input_tokens": sum(n or 0 for n in table.column("n_in").to_pylist()), "folder": str(folder)}


SYSTEMS = {"vllm": run_vllm, "llmbatch": run_llmbatch,
           "llmbatch-pool": lambda args, out: run_llmbatch(args, out, pool=args.mm_concurrency)}


def child(args) -> None:
    out = Path(args.out)
    result = SYSTEMS[args.system](args, out)
    out.with_suffix(".json").write_text(json.dumps(result))
    os._exit(0)


# -- the parent -----------------------------------------------------------------------------------


def make_data(args, folder: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(HERE.parent / "src"))
    from llmbatch.sample_images import sample_images

    w, h = (int(x) for x in args.image_size.split("x"))
    items = sample_images(args.rows, seed=args.seed, size=(w, h))
    path = folder / "images.parquet"
    pq.write_table(pa.table({"id": list(range(args.rows)), "image": pa.array([i["image"] for i in items], pa.binary())}),
                   path)
    return path


def cpu_stage_rate(data: Path, size: int, n: int = 200) -> dict:
    """Images decoded + resized per second on one core (the preprocess alone)."""
    import pyarrow.parquet as pq

    images = pq.read_table(data).column("image").to_pylist()[:n]
    start = time.perf_counter()
    for data_ in images:
        decode_resize(data_, size)
    elapsed = time.perf_counter() - start
    return {"images": len(images), "seconds": elapsed, "images_per_s_one_core": len(images) / elapsed,
            "cores": os.cpu_count()}


def run_one(system: str, args, data: Path, folder: Path) -> dict:
    out = folder / f"{system}.parquet"
    cmd = [sys.executable, __file__, "--child", "--system", system, "--data", str(data), "--out", str(out)]
    for key in ("model", "device", "max_model_len", "max_tokens", "resize", "batch_size", "kv_cache_mib", "mm_concurrency",
                "gpu_memory_utilization", "load_format", "max_num_seqs"):
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent / "src"), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    started = time.time()
    with open(folder / f"{system}.log", "w") as fh:
        proc = subprocess.run(cmd, check=False, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout,
                              start_new_session=True)
    if proc.returncode != 0 or not out.with_suffix(".json").exists():
        return {"system": system, "error": f"exit {proc.returncode}, log {folder / (system + '.log')}"}
    r = json.loads(out.with_suffix(".json").read_text())
    r.update(system=system, started_at=started, wall_s=r["done_at"] - started,
             steady_s=(r["done_at"] - r["ready_at"]) if r.get("ready_at") else None)
    return r


def summary(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="this CPU: the tiny seeded VLM, 24 small images, 1 repeat")
    p.add_argument("--systems", default="vllm,llmbatch")
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--start-repeat", type=int, default=0,
                   help="number the repeats from here (the order alternates by number): split repeats over calls")
    p.add_argument("--model")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    p.add_argument("--load-format", default=None, help="'dummy' for a weight-less model folder")
    p.add_argument("--image-size", default="640x480")
    p.add_argument("--resize", type=int, default=448, help="the preprocess resizes every image to this square")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--mm-concurrency", type=int, default=4,
                   help="llmbatch-pool: CPU workers for the preprocess and the multimodal stage")
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--json", default=str(HERE / "mm-results" / "mm.json"))
    p.add_argument("--merge", nargs="+", help="print one table from the JSON files of several calls")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.merge:
        return merge(args.merge)
    if args.smoke:
        sys.path.insert(0, str(HERE.parent / "src"))
        from llmbatch.toy_models import make_test_models

        args.model = args.model or str(make_test_models()["tiny-vlm"])
        args.device, args.rows, args.repeats, args.image_size, args.resize = "cpu", 24, 1, "160x120", 128
        args.max_tokens, args.max_model_len, args.batch_size = min(args.max_tokens, 8), 512, 8
        if args.json == str(HERE / "mm-results" / "mm.json"):
            args.json = str(HERE / "mm-results" / "mm-smoke.json")
    if not args.model:
        p.error("--model is required (or --smoke)")
    systems = args.systems.split(",")
    work = Path(tempfile.mkdtemp(prefix="llmbatch-mm-"))
    data = make_data(args, work)
    cpu = cpu_stage_rate(data, args.resize)
    print(json.dumps({"cpu_stage": cpu}), flush=True)
    runs: list[dict] = []
    for rep in range(args.start_repeat, args.start_repeat + args.repeats):
        for system in systems if rep % 2 == 0 else systems[::-1]:  # interleaved, alternating order
            folder = work / f"{system}-{rep}"
            folder.mkdir()
            r = run_one(system, args, data, folder)
            r["repeat"] = rep
            if "error" not in r:
                r["rows_s_wall"] = r["rows"] / r["wall_s"]
                r["rows_s_steady"] = r["rows"] / r["steady_s"] if r.get("steady_s") else None
            runs.append(r)
            print(json.dumps(r), flush=True)
    report = {"rows": args.rows, "model": args.model, "device": args.device, "engine_kwargs": engine_kwargs(args),
              "sampling_params": sampling(args), "image_size": args.image_size, "resize": args.resize,
              "batch_size": args.batch_size, "cpu_stage": cpu, "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summarize(report, systems), indent=1))
    print_table(report, systems)


def summarize(report: dict, systems: list[str]) -> dict:
    runs = report["runs"]
    table = {s: {k: summary([r for r in runs if r["system"] == s], k)
                 for k in ("wall_s", "steady_s", "rows_s_wall", "rows_s_steady")} for s in systems}
    ratios = {}
    if "vllm" in systems:
        for s in systems:
            if s != "vllm" and table[s]["rows_s_wall"] and table["vllm"]["rows_s_wall"]:
                ratios[s] = {k: table[s][f"rows_s_{k}"]["median"] / table["vllm"][f"rows_s_{k}"]["median"]
                             for k in ("wall", "steady") if table[s][f"rows_s_{k}"] and table["vllm"][f"rows_s_{k}"]}
    report.update(summary=table, ratios_vs_vllm=ratios)
    return report


def print_table(report: dict, systems: list[str]) -> None:
    report = summarize(report, systems)
    table, cpu = report["summary"], report["cpu_stage"]
    print(f"\n{report['rows']} images {report['image_size']} -> {report['resize']}px, "
          f"{report['sampling_params']['max_tokens']} tokens each, model {report['model']}")
    print("| system | wall s (median, min-max) | images/s wall | steady s (median, min-max) | images/s steady |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for s in systems:
        w, st = table[s]["wall_s"], table[s]["steady_s"]
        if not w:
            print(f"| {s} | failed | | | |")
            continue
        print(f"| {s} | {w['median']:.1f} ({w['min']:.1f}-{w['max']:.1f}) | {table[s]['rows_s_wall']['median']:.2f} | "
              + (f"{st['median']:.1f} ({st['min']:.1f}-{st['max']:.1f}) | {table[s]['rows_s_steady']['median']:.2f} |"
                 if st else "| |"))
    print(f"CPU stage: {cpu['images_per_s_one_core']:.0f} images decoded+resized/s on one core ({cpu['cores']} cores)")
    print("ratios vs vllm (median images/s):", json.dumps(report["ratios_vs_vllm"]))


def merge(paths: list[str]) -> None:
    """One table from the JSON files of several calls (``--repeats 1 --start-repeat k`` each)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    merged = {**reports[0], "runs": [r for rep in reports for r in rep["runs"]]}
    systems = list(dict.fromkeys(r["system"] for r in merged["runs"]))
    print_table(merged, systems)
    rates = [r["cpu_stage"]["images_per_s_one_core"] for r in reports]
    print(f"CPU stage per call (images/s, one core): {', '.join(f'{x:.0f}' for x in rates)}; "
          f"median {statistics.median(rates):.0f}")
    print(json.dumps(summarize(merged, systems)["summary"]))

if __name__ == "__main__":
    main()
