"""Video: llmbatch and plain ``vllm.LLM.chat`` on the same few short seeded videos, same model,
same engine settings; a functional check (every row answered, no error row, the same prompt
token counts in both), not a throughput figure.

    python3 bench/mm_video.py --model DIR --device gpu --load-format dummy --json OUT.json

Videos (``--videos``, seeded by ``--seed``): ``--frames`` frames of ``--size`` x ``--size``, a
coloured square moving over a coloured background. Two ways to hand them over, both as
``{"type": "video_url", "video_url": {"url": ...}}`` content parts, which llmbatch's multimodal
stage passes to vLLM's chat parser as they are (vLLM reads them):

- ``mp4``: an MP4 file written with ``cv2.VideoWriter`` (``mp4v``), as a ``file://`` URL under
  ``allowed_local_media_path`` (vLLM's opencv video loader reads it); only where cv2 imports;
- ``jpeg``: a ``data:video/jpeg;base64,...`` URL, the frames as comma-separated base64 JPEGs
  (PIL-encoded; vLLM decodes them with PIL, no cv2 needed).

With ``--sources auto`` (the default) the rows alternate mp4, jpeg where cv2 imports, else all
jpeg. Each system runs in a fresh process, one after the other: ``vllm`` (``LLM.chat`` on all
conversations) then ``llmbatch`` (``ray.data.from_items`` -> the processor with
``prepare_multimodal_stage={"enabled": True}``, ``should_continue_on_error=True`` -> rows).
Engine settings (both): ``limit_mm_per_prompt={"image": 0, "video": 1}``,
``allowed_local_media_path`` = the videos' folder, ``enforce_eager`` unless ``--cuda-graphs``
(start-up time; this is not a speed test), greedy, ``ignore_eos``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "Describe this video in one sentence."


def engine_kwargs(args) -> dict:
    kw = {"max_model_len": args.max_model_len, "limit_mm_per_prompt": {"image": 0, "video": 1},
          "allowed_local_media_path": args.media_root}
    if args.device == "cpu":
        kw.update(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mib << 20)
        from llmbatch.engines.vllm_setup import native_bf16

        if not native_bf16():  # the float32 llmbatch picks on such a CPU, pinned for every system
            kw["dtype"] = "float32"
    else:
        kw.update(gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=not args.cuda_graphs)
    if args.load_format:
        kw["load_format"] = args.load_format
    return kw


def sampling(args) -> dict:
    return {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}


def conversation(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": PROMPT}]}]


# -- the videos -----------------------------------------------------------------------------------


def frames_of(index: int, args):
    import numpy as np

    rng = np.random.default_rng([args.seed, index])
    bg, fg = rng.integers(0, 256, 3, dtype=np.uint8), rng.integers(0, 256, 3, dtype=np.uint8)
    side = args.size // 4
    y = int(rng.integers(0, args.size - side))
    out = np.empty((args.frames, args.size, args.size, 3), np.uint8)
    for t in range(args.frames):
        out[t] = bg
        x = (t * (args.size - side)) // max(args.frames - 1, 1)
        out[t, y:y + side, x:x + side] = fg
    return out


def write_mp4(path: Path, frames, fps: int) -> int:
    """Writes ``frames`` (RGB) to ``path``; returns the frame count cv2 reads back."""
    import cv2

    h, w = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
    if not writer.isOpened():
        raise RuntimeError(f"cv2.VideoWriter cannot open {path} with mp4v")
    for f in frames:
        writer.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
    writer.release()
    cap = cv2.VideoCapture(str(path))
    n = 0
    while cap.read()[0]:
        n += 1
    cap.release()
    return n


def jpeg_url(frames) -> str:
    from PIL import Image

    parts = []
    for f in frames:
        buf = io.BytesIO()
        Image.fromarray(f).save(buf, format="JPEG", quality=90)
        parts.append(base64.b64encode(buf.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(parts)


def make_videos(args, folder: Path) -> tuple[list[dict], dict]:
    try:
        import cv2

        cv = {"cv2": cv2.__version__}
    except ImportError as exc:
        cv = {"cv2": None, "cv2_error": str(exc)}
    kinds = {"auto": ["mp4", "jpeg"] if cv["cv2"] else ["jpeg"], "mp4": ["mp4"], "jpeg": ["jpeg"],
             "both": ["mp4", "jpeg"]}[args.sources]
    rows = []
    for i in range(args.videos):
        frames, kind = frames_of(i, args), kinds[i % len(kinds)]
        if kind == "mp4":
            path = folder / f"video-{i}.mp4"
            read_back = write_mp4(path, frames, args.fps)
            rows.append({"id": i, "kind": kind, "url": path.as_uri(), "frames_read_back": read_back,
                         "bytes": path.stat().st_size})
        else:
            url = jpeg_url(frames)
            rows.append({"id": i, "kind": kind, "url": url, "frames_read_back": args.frames, "bytes": len(url)})
    return rows, cv


# -- the systems (run in the child process) -------------------------------------------------------


def run_vllm(args, items: list[dict]) -> list[dict]:
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(**sampling(args))
    try:
        outs = llm.chat([conversation(r["url"]) for r in items], params, use_tqdm=False)
        results = [{"id": r["id"], "text": o.outputs[0].text, "input_tokens": len(o.prompt_token_ids),
                    "output_tokens": len(o.outputs[0].token_ids), "error": None} for r, o in zip(items, outs)]
    except Exception as exc:  # noqa: BLE001 - then row by row, to name the failing rows
        print(f"LLM.chat on all rows failed: {type(exc).__name__}: {exc}", flush=True)
        results = []
        for r in items:
            try:
                o = llm.chat(conversation(r["url"]), params, use_tqdm=False)[0]
                results.append({"id": r["id"], "text": o.outputs[0].text, "input_tokens": len(o.prompt_token_ids),
                                "output_tokens": len(o.outputs[0].token_ids), "error": None})
            except Exception as row_exc:  # noqa: BLE001
                results.append({"id": r["id"], "error": f"{type(row_exc).__name__}: {row_exc}"})
    llm.llm_engine.engine_core.shutdown()
    return results


def run_llmbatch(args, items: list[dict]) -> list[dict]:
    import ray

    from llmbatch import build_processor, vLLMEngineProcessorConfig
    from llmbatch.rows import ERROR_COLUMN

    ray.init(include_dashboard=False, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = vLLMEngineProcessorConfig(model_source=args.model, engine_kwargs=engine_kwargs(args), batch_size=4,
                                       should_continue_on_error=True, prepare_multimodal_stage={"enabled": True})
    params = sampling(args)
    processor = build_processor(config, preprocess=lambda r: {"messages": conversation(r["url"]),
                                                                  "sampling_params": params})
    rows = processor(ray.data.from_items([{"id": r["id"], "url": r["url"]} for r in items])).take_all()
    ray.shutdown()
    return sorted(({"id": r["id"], "text": r.get("generated_text"), "input_tokens": r.get("num_input_tokens"),
                    "output_tokens": r.get("num_generated_tokens"), "error": r.get(ERROR_COLUMN) or None}
                   for r in rows), key=lambda r: r["id"])


SYSTEMS = {"vllm": run_vllm, "llmbatch": run_llmbatch}


def child(args) -> None:
    items = json.loads(Path(args.items).read_text())
    start = time.time()
    results = SYSTEMS[args.system](args, items)
    Path(args.out).write_text(json.dumps({"results": results, "seconds_in_child": time.time() - start}))
    os._exit(0)


# -- the parent -----------------------------------------------------------------------------------


def run_one(system: str, args, items_path: Path, folder: Path) -> dict:
    out = folder / f"{system}.json"
    cmd = [sys.executable, __file__, "--child", "--system", system, "--items", str(items_path), "--out", str(out)]
    for key in ("model", "device", "max_model_len", "max_tokens", "kv_cache_mib", "gpu_memory_utilization",
                "load_format", "media_root"):
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    if args.cuda_graphs:
        cmd.append("--cuda-graphs")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent / "src"), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    started = time.time()
    log = folder / f"{system}.log"
    try:
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, check=False, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout,
                                  start_new_session=True)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    wall = time.time() - started
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace").splitlines()[-40:]
        return {"system": system, "wall_s": wall, "error": f"exit {code}", "log_tail": tail}
    r = json.loads(out.read_text())
    return {"system": system, "wall_s": wall, **r}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    p.add_argument("--load-format", default=None, help="'dummy' for a weight-less model folder")
    p.add_argument("--systems", default="vllm,llmbatch")
    p.add_argument("--sources", choices=["auto", "mp4", "jpeg", "both"], default="auto")
    p.add_argument("--videos", type=int, default=4)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--fps", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--cuda-graphs", action="store_true", help="no enforce_eager (slower start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=400, help="seconds per system")
    p.add_argument("--make-only", action="store_true", help="write the videos and print the rows, run nothing")
    p.add_argument("--json", default=str(HERE / "mm-results" / "video.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--items", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--media-root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    work = Path(tempfile.mkdtemp(prefix="llmbatch-video-"))
    args.media_root = str(work)
    items, cv = make_videos(args, work)
    items_path = work / "items.json"
    items_path.write_text(json.dumps(items))
    summary = [{k: v for k, v in r.items() if k != "url"} | {"url": r["url"][:60]} for r in items]
    print(json.dumps({"videos": summary, **cv}), flush=True)
    if args.make_only:
        return
    if not args.model:
        p.error("--model is required")
    runs = {}
    for system in args.systems.split(","):
        folder = work / system
        folder.mkdir()
        runs[system] = run_one(system, args, items_path, folder)
        print(json.dumps(runs[system])[:3000], flush=True)
    check = {s: {"rows": len(r.get("results", [])), "error_rows": sum(1 for x in r.get("results", []) if x.get("error")),
                 "failed": r.get("error")} for s, r in runs.items()}
    if all(s in runs and runs[s].get("results") for s in ("vllm", "llmbatch")):
        pairs = zip(runs["vllm"]["results"], runs["llmbatch"]["results"])
        check["same_input_tokens"] = all(a["input_tokens"] == b["input_tokens"] for a, b in pairs)
    report = {"model": args.model, "device": args.device, "engine_kwargs": engine_kwargs(args),
              "sampling_params": sampling(args), "videos": summary, **cv, "check": check, "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({"check": check}))


if __name__ == "__main__":
    main()
