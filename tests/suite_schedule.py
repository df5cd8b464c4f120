"""How ``make test`` spreads test files over two workers (``make test TEST_WORKERS=2``).

pytest-xdist's ``--dist loadfile`` hands out whole files (each file's engine fixtures start
once) in collection order, and gives a worker its next file while two of its tests are still
to run. On a 2-core machine where a few files take minutes each, that leaves one worker
running the last long file alone. Here the longest files go out first (longest processing
time first) and a worker takes its next file only when its last test is up, so the two finish
close together. ``LONGEST_FIRST`` comes from the per-file times the suite prints at its end
(``conftest.pytest_terminal_summary``); a file not named goes after them in collection order.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

LONGEST_FIRST = (  # seconds per file in a fresh-clone run at 20ab27f+: 382, 201, 199, 189, 182, ...
    "tests/e2e/test_lora_logprobs.py", "tests/e2e/test_jobs.py", "tests/e2e/test_examples.py",
    "tests/e2e/test_http_vllm.py", "tests/e2e/test_plan_shapes.py", "tests/e2e/test_tasks.py",
    "tests/e2e/test_errors.py", "tests/e2e/test_terminal.py", "tests/e2e/test_processor_vllm.py",
    "tests/e2e/test_http_faults.py", "tests/e2e/test_openai_server.py", "tests/e2e/test_serve.py",
    "tests/e2e/test_ray_checkpoints.py", "tests/e2e/test_workload_optimizations.py",
    "tests/e2e/test_batch_media.py", "tests/e2e/test_cluster_nodes.py", "tests/e2e/test_multimodal.py",
    "tests/e2e/test_trust.py", "tests/engines/test_vllm_setup.py", "tests/stages/test_warm.py",
    "tests/e2e/test_audio.py", "tests/e2e/test_openai_batch_files.py", "tests/e2e/test_ray_address.py",
    "tests/e2e/test_stall.py", "tests/e2e/test_serve_tenants.py",
)


class LongestFilesFirst(LoadFileScheduling):
    """``--dist loadfile`` with the next file chosen by :data:`LONGEST_FIRST` and handed out
    only when a worker is down to its last test (which xdist holds until more work comes)."""

    def _assign_work_unit(self, node) -> None:
        rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
        scope = min(self.workqueue, key=lambda s: rank.get(s, len(rank)))  # ties: collection order
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)
