"""Ray Data's checkpoint example (read -> processor -> write) with llmbatch's processor.

What a ray.data.llm user already has: ``DataContext.checkpoint_config`` with an id column,
``read_parquet`` of several files, the processor, ``write_parquet``. Run it, kill it, run it
again: the rerun skips the ids whose output was written. The engine is an OpenAI-compatible
endpoint (``--url``). Ray: a local one of 2 CPUs that this process starts (and a kill of its
process group ends), or the cluster at ``--address``. Used by tests/e2e/test_ray_checkpoints.py.
"""

from __future__ import annotations

import argparse
import os


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--address", help="join the Ray cluster at this address (default: start a local Ray)")
    args = parser.parse_args()

    import ray
    from ray.data.checkpoint import CheckpointConfig

    from llmbatch import HttpRequestProcessorConfig, build_processor

    os.environ.pop("RAY_ADDRESS", None)
    from llmbatch import startlog

    if args.address:
        ray.init(address=args.address, logging_level="ERROR")
    else:
        with startlog.timed("ray-cluster", cpus=2):
            ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.checkpoint_config = CheckpointConfig(id_column="id", checkpoint_path=args.checkpoint)

    # stall bound 120 s: with both test workers loading the 2-core machine (load average 13 in one
    # fresh-clone run) the replica's worker process once took over 60 s to start, before it beats
    config = HttpRequestProcessorConfig(url=args.url, model="fake-model", concurrency=1, batch_size=8,
                                        max_concurrent_requests=4, stall_timeout_s=120, should_continue_on_error=True)
    processor = build_processor(
        config,
        # a row whose name asks for it gets a 400 from the fake endpoint: an error row
        preprocess=lambda row: dict(messages=[{"role": "user", "content": f"Item {row['id']} is {row['name']}"}],
                                    sampling_params=dict(temperature=0, max_tokens=8)),
        postprocess=lambda row: dict(id=row["id"], answer=row["generated_text"]))
    processor(ray.data.read_parquet(args.inputs)).write_parquet(args.out)
    print("run finished", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
