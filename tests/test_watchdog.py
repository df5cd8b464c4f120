"""The stall diagnosis names what holds the cluster (plain objects stand in for Ray Data's
executor: the text is what is checked here; tests/e2e/test_stall.py and test_plan_shapes.py run
real stalls)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import llmbatch.watchdog as watchdog
from llmbatch.watchdog import HEARTBEAT_FRESH_S, diagnose, wait_for_engines


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


def beats_of(monkeypatch, *sequence):
    """The heartbeats wait_for_engines reads: each read the next (the last repeats); the reads."""
    calls = []

    def read(run_id):
        beats = sequence[min(len(calls), len(sequence) - 1)]
        calls.append(run_id)
        return [{**b, "at": b.get("at", time.time())} for b in beats]

    monkeypatch.setattr(watchdog, "read_heartbeats", read)
    return calls


WORKING = {"role": "prepare", "state": "ready"}
STARTING = {"role": "engine", "state": "starting"}
READY = {"role": "engine", "state": "ready"}


def test_the_pools_first_worker_starts_while_the_engine_starts(monkeypatch):
    calls = beats_of(monkeypatch, [STARTING])
    assert wait_for_engines("run", "prepare", "engine", 30, poll_s=0.01) is False
    assert len(calls) == 1


def test_a_worker_added_to_a_working_pool_waits_until_the_engine_is_ready(monkeypatch):
    calls = beats_of(monkeypatch, [WORKING, STARTING], [WORKING, STARTING], [WORKING, STARTING], [WORKING, READY])
    assert wait_for_engines("run", "prepare", "engine", 30, poll_s=0.01) is True
    assert len(calls) == 4, "it went before the engine said ready, or kept waiting after"


def test_the_wait_is_bounded_and_old_heartbeats_say_nothing(monkeypatch):
    beats_of(monkeypatch, [WORKING, STARTING])
    began = time.monotonic()
    assert wait_for_engines("run", "prepare", "engine", 0.3, poll_s=0.01) is True
    assert 0.3 <= time.monotonic() - began < 3
    calls = beats_of(monkeypatch, [WORKING, {**STARTING, "at": time.time() - 10 * HEARTBEAT_FRESH_S}])
    assert wait_for_engines("run", "prepare", "engine", 30, poll_s=0.01) is False
    assert len(calls) == 1  # an engine whose heartbeat stopped (it died) holds nothing back


def test_heartbeats_that_cannot_be_read_hold_nothing_back(monkeypatch):
    def broken(run_id):
        raise ConnectionError("no GCS")

    monkeypatch.setattr(watchdog, "read_heartbeats", broken)
    assert wait_for_engines("run", "prepare", "engine", 30, poll_s=0.01) is False
