"""The processes of this test session's Ray cluster (the ``ray_cluster`` fixture's, found by
its temp dir): a test that looks for its engine replicas must find its own, not those of a test
file running beside it (``make test`` runs two at once, each pytest worker with its cluster).
"""

from __future__ import annotations

import os

import psutil

from llmbatch.reaper import processes_naming


def cluster_processes() -> list[psutil.Process]:
    """The cluster's own processes (they name its temp dir) and all their descendants: its
    workers, their actors' engine processes."""
    temp = os.environ.get("LLMBATCH_TEST_RAY_TEMP")
    if not temp:  # a cluster this session did not start: every process on the machine
        return list(psutil.process_iter())
    found: dict[int, psutil.Process] = {}
    for root in processes_naming(f"{temp}/"):
        try:
            found.update((p.pid, p) for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            continue
    return list(found.values())


def command_line(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return ""


def engines(title: str = "") -> list[tuple[psutil.Process, psutil.Process]]:
    """The cluster's vLLM engine processes (``VLLM::EngineCore``), each with the Ray actor
    process that hosts it (its nearest ``ray::`` ancestor: the engine process is a child of
    the replica's fork server, engines/vllm_procs.py), for actors whose process title contains
    ``title`` (e.g. ``MapWorker``, ``ServeReplica:app:dep``)."""
    out = []
    for proc in cluster_processes():
        if "VLLM::EngineCore" not in command_line(proc):
            continue
        try:
            actor = next((a for a in proc.parents() if command_line(a).startswith("ray::")), None)
        except psutil.Error:
            continue
        if actor is not None and title in command_line(actor):
            out.append((actor, proc))
    return sorted(out, key=lambda pair: pair[0].pid)


def engine_replicas(title: str = "") -> list[psutil.Process]:
    """The cluster's actor processes that host a vLLM engine (see :func:`engines`)."""
    return list({actor.pid: actor for actor, _ in engines(title)}.values())
