"""How ``make test`` spreads test files over two workers (``make test TEST_WORKERS=2``).

pytest-xdist's ``--dist loadfile`` hands out whole files (each file's engine fixtures start
once) in collection order, and gives a worker its next file while two of its tests are still
to run. On a 2-core machine where a few files take minutes each, that leaves one worker
running the last long file alone. Here the longest files go out first (longest processing
time first) and a worker takes its next file only when its last test is up, so the two finish
close together. ``LONGEST_FIRST`` comes from the per-file times the suite prints at its end
(``conftest.pytest_terminal_summary``); a file not named goes after them in collection order.

Each worker has its own Ray cluster, so a warm engine (llmbatch.stages.warm) serves only the
files of its worker: the files of one engine setting (``SAME_WORKER``) go to one worker. The
first worker to take a file of a group takes the group's other files before any other file; the
other worker takes one only when nothing else is left (then it starts that engine itself, and
the two workers still end close together).
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

LONGEST_FIRST = (  # seconds per file in the fresh-clone run at c4f5baa: 294, 267, 209, 193, 158, ...
    "tests/e2e/test_lora_logprobs.py", "tests/e2e/test_jobs.py", "tests/e2e/test_plan_shapes.py",
    "tests/e2e/test_tasks.py", "tests/e2e/test_examples.py", "tests/e2e/test_http_vllm.py", "tests/e2e/test_serve.py",
    "tests/e2e/test_errors.py", "tests/e2e/test_cluster_nodes.py", "tests/e2e/test_terminal.py",
    # out of its place by time: right after test_terminal.py, the last other file of examples/embed.yaml's
    # MiniLM on its worker (with test_openai_server.py between them, a machine short of memory stopped
    # that warm engine in the fresh-clone run at 2dceebf, and this file started it again)
    "tests/e2e/test_openai_batch_files.py",
    "tests/e2e/test_ray_checkpoints.py", "tests/stages/test_warm.py", "tests/e2e/test_http_faults.py",
    "tests/e2e/test_openai_server.py", "tests/e2e/test_workload_optimizations.py", "tests/e2e/test_engine_early.py",
    "tests/e2e/test_multimodal.py",
    "tests/engines/test_vllm_setup.py", "tests/e2e/test_audio.py", "tests/e2e/test_processor_vllm.py",
    "tests/e2e/test_batch_media.py", "tests/e2e/test_trust.py", "tests/e2e/test_ray_address.py",
    "tests/test_models.py", "tests/e2e/test_stall.py", "tests/e2e/test_serve_tenants.py",
)

#: Files that share a warm engine where they run on one worker, longest first in each group.
SAME_WORKER = (
    # the suite's usual engine (smollm2-135m-instruct, max_model_len 512; test_examples.py,
    # test_terminal.py and test_openai_batch_files.py also share examples/embed.yaml's MiniLM): about
    # 1,250 of the suite's 2,650 s in the run above; the tasks' pooling models (test_tasks.py, 190 s)
    # stay out, so the other worker's files (LoRA, Serve, the media, the other clusters) weigh as much
    ("tests/e2e/test_jobs.py", "tests/e2e/test_plan_shapes.py", "tests/e2e/test_examples.py",
     "tests/e2e/test_http_vllm.py", "tests/e2e/test_errors.py", "tests/e2e/test_terminal.py",
     "tests/e2e/test_openai_server.py", "tests/e2e/test_workload_optimizations.py",
     "tests/e2e/test_processor_vllm.py", "tests/e2e/test_stall.py", "tests/e2e/test_openai_batch_files.py"),
    # the tiny VLM with two images a prompt, float32, a 128 MiB KV cache
    ("tests/e2e/test_multimodal.py", "tests/e2e/test_batch_media.py"),
)


class LongestFilesFirst(LoadFileScheduling):
    """``--dist loadfile`` with the next file chosen by :data:`LONGEST_FIRST` and
    :data:`SAME_WORKER`, handed out only when a worker is down to its last test (which xdist
    holds until more work comes)."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        #: SAME_WORKER's index -> the worker that took the group's first file
        self.group_owner: dict[int, object] = {}

    def _next_scope(self, node) -> str:
        rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
        group_of = {path: n for n, group in enumerate(SAME_WORKER) for path in group}

        def owner(scope: str):
            return self.group_owner.get(group_of[scope]) if scope in group_of else None

        def longest(scopes: list[str]) -> str:  # ties: collection order
            return min(scopes, key=lambda s: rank.get(s, len(rank)))

        queued = list(self.workqueue)
        own = [s for s in queued if owner(s) is node]
        if own:  # the rest of a group this worker began: its warm engine is here
            return longest(own)
        free = [s for s in queued if owner(s) is None]
        scope = longest(free or queued)  # another worker's group only where nothing else is left
        if scope in group_of:
            self.group_owner.setdefault(group_of[scope], node)
        return scope

    def _assign_work_unit(self, node) -> None:
        scope = self._next_scope(node)
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
