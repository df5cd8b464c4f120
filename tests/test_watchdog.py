"""The stall diagnosis names what holds the cluster (plain objects stand in for Ray Data's
executor: the text is what is checked here; tests/e2e/test_stall.py and test_plan_shapes.py run
real stalls)."""

from __future__ import annotations

from types import SimpleNamespace

from llmbatch.watchdog import diagnose


class Op:
    def __init__(self, name, done=False, active=0, remote_args=None):
        self.name = name
        self._done = done
        self._active = active
        self._ray_remote_args = remote_args or {}

    def has_completed(self):
        return self._done

    def num_active_tasks(self):
        return self._active

    def incremental_resource_usage(self):
        return SimpleNamespace(cpu=1, gpu=0)


def executor(*ops):
    state = SimpleNamespace(total_enqueued_input_blocks=lambda: 0)
    usage = SimpleNamespace(cpu=1, gpu=0)
    return SimpleNamespace(_topology={op: state for op in ops},
                           _resource_manager=SimpleNamespace(get_op_usage=lambda op: usage))


def test_a_checkpoint_filter_in_the_plan_is_named_with_its_cpu():
    text = diagnose(executor(Op("ListFiles", active=1), Op("CheckpointFilter"), Op("MapBatches(StageRunner)")),
                    50, 45, [])
    assert "CheckpointFilter is an actor pool of 1 CPU per actor" in text
    assert "holding: ListFiles holds 1 CPU" in text and text.count("fix:") == 1


def test_without_checkpoints_nothing_is_said_of_them():
    text = diagnose(executor(Op("ReadCSV", active=1), Op("CheckpointFilter", done=True)), 50, 45, [])
    assert "CheckpointFilter" not in text and "no progress for 50 s" in text
