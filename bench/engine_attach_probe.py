"""Probe: vLLM's engine process launched by one process, its front-end (``AsyncLLM``) attached
from another, later (issue 29: the engine's start beside Ray's and the replica's, not after).

    python bench/engine_attach_probe.py MODEL_DIR [--delay 10] [--kwargs JSON]

Two ways, each a fresh pair of processes, the front-end started ``--delay`` seconds after the
first process (what Ray's start and the replica's placement take before a replica exists):

- ``own``: the front-end starts its engine itself once it runs (what a replica does today);
- ``attached``: a launcher process starts at 0 s, imports vLLM, builds the engine config and
  launches the engine with vLLM's ``launch_core_engines`` on ZMQ addresses of its choosing (the
  engine's handshake is the launcher's); the front-end builds the same config and attaches with
  ``AsyncLLM(client_addresses=...)`` (vLLM's mode for engines "managed externally").

Prints seconds from the first process's start to the front-end ready and to its first answer,
and the answer (greedy), for both. Written on vLLM 0.32 (the CPU here); where
``launch_core_engines`` takes no addresses (older vLLM) it uses those it yields. On the GPU kit
(after ``bench/industry_gpu.sh install``): ``PYTHONPATH=/tmp/site python3
bench/engine_attach_probe.py DIR --delay 11 --kwargs '{"gpu_memory_utilization": 0.85}'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time


def engine_config(model: str, kwargs: dict):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor import Executor

    cfg = AsyncEngineArgs(model=model, **kwargs).create_engine_config(UsageContext.LLM_CLASS)
    return cfg, Executor.get_class(cfg)


def launcher(model: str, kwargs: dict, attach: str) -> None:
    from llmbatch.engines.vllm_launcher import core_engines

    cfg, executor = engine_config(model, kwargs)
    with core_engines(cfg, executor, False) as (manager, addresses):
        with open(attach + ".tmp", "w") as fh:  # the front-end may bind now: the engine connects to it
            json.dump({"input_address": addresses.inputs[0], "output_address": addresses.outputs[0]}, fh)
        os.rename(attach + ".tmp", attach)
    sys.stdin.readline()  # the engine lives while this process does
    (getattr(manager, "shutdown", None) or manager.close)()  # vLLM 0.32: shutdown


async def front_end(model: str, kwargs: dict, attach: str | None, t0: float) -> dict:
    from vllm import SamplingParams
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    cfg, executor = engine_config(model, kwargs)
    addresses = None
    if attach:
        while not os.path.exists(attach):
            await asyncio.sleep(0.05)
        with open(attach) as fh:
            addresses = json.load(fh)
    llm = AsyncLLM(vllm_config=cfg, executor_class=executor, log_stats=False, usage_context=UsageContext.LLM_CLASS,
                   client_addresses=addresses)
    ready = time.time() - t0
    out = None
    async for out in llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0),
                                  request_id="probe"):
        pass
    answered = time.time() - t0
    llm.shutdown()
    return {"ready_s": round(ready, 2), "answer_s": round(answered, 2), "text": out.outputs[0].text}


def run(way: str, args) -> dict:
    t0 = time.time()
    attach = None
    launch = None
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    if way == "attached":
        attach = os.path.join(tempfile.mkdtemp(prefix="engine-attach-"), "at.json")
        launch = subprocess.Popen([sys.executable, __file__, args.model, "--role", "launcher", "--attach", attach,
                                   "--kwargs", args.kwargs], stdin=subprocess.PIPE, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(args.delay)
    cmd = [sys.executable, __file__, args.model, "--role", "front-end", "--t0", repr(t0), "--kwargs", args.kwargs]
    if attach:
        cmd += ["--attach", attach]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        result = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-2000:]}
    finally:
        if launch is not None:
            launch.stdin.close()
            launch.wait(timeout=60)
    return {"way": way, **result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--role", choices=["launcher", "front-end"], default=None)
    p.add_argument("--attach", default=None)
    p.add_argument("--t0", type=float, default=None)
    p.add_argument("--delay", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--kwargs", default=json.dumps({"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20,
                                                   "max_model_len": 512}))
    args = p.parse_args()
    kwargs = json.loads(args.kwargs)
    if args.role == "launcher":
        return launcher(args.model, kwargs, args.attach)
    if args.role == "front-end":
        print(json.dumps(asyncio.run(front_end(args.model, kwargs, args.attach, args.t0))), flush=True)
        return
    for i in range(args.repeat):
        for way in (("own", "attached") if i % 2 == 0 else ("attached", "own")):
            print(json.dumps({"round": i + 1, "delay_s": args.delay, **run(way, args)}), flush=True)


if __name__ == "__main__":
    main()
