"""The stall detector on the real engine: a plan that can never move fails with the reason.

The user's own actor pool holds every CPU of the cluster, so the read tasks in front of it can
never run; the engine replica starts (its heartbeat says so, which is not a stall), then
nothing moves, and the run fails within stall_timeout_s with what waits, for what, what holds
it and the fix, instead of waiting forever.
"""

from __future__ import annotations

import sys
import time

import pytest

from llmbatch import build_processor, vLLMEngineProcessorConfig
from llmbatch.errors import StallError

pytestmark = pytest.mark.e2e
TIMEOUT_S = 20


class Passthrough:
    def __call__(self, batch):
        return batch


def test_a_plan_that_cannot_move_fails_with_the_reason(ray_cluster, smollm2, tmp_path):
    import ray

    cpus = int(ray.cluster_resources()["CPU"])
    path = tmp_path / "rows.csv"
    path.write_text("id,name\n" + "".join(f"{i},n{i}\n" for i in range(40)))
    config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct", batch_size=8, stall_timeout_s=TIMEOUT_S,
                                       engine_kwargs=dict(max_model_len=512))  # the suite's usual (a warm engine)
    processor = build_processor(config, preprocess=lambda r: dict(prompt=f"Item {r['id']}",
                                                                  sampling_params=dict(max_tokens=2)))
    ds = ray.data.read_csv(str(path), override_num_blocks=4)
    # the user's own pool takes every CPU, before any read task got one
    ds = ds.map_batches(Passthrough, compute=ray.data.ActorPoolStrategy(size=cpus), num_cpus=1)
    # Ray pickles Passthrough by reference; the workers cannot import this test module
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    start = time.monotonic()
    try:
        with pytest.raises(StallError) as err:
            processor(ds).take_all()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    elapsed = time.monotonic() - start
    text = str(err.value)
    assert f"no progress for {TIMEOUT_S}" in text or "made no progress" in text
    assert "waiting: ReadCSV" in text and "needs 1 CPU" in text
    assert "holding: " in text and "MapBatches(Passthrough)" in text and f"{cpus} CPU" in text
    assert "fix:" in text and "stall_timeout_s" in text
    # it waited for the engine to start, then at most about the timeout more
    assert elapsed < 240
