"""Placement: the CPUs and workers each of a processor's Ray Data operators takes, and how many
rows its blocks carry (:mod:`llmbatch.processor` lays the operators out with these)."""

from __future__ import annotations

#: CPUs a CPU-stage worker reserves unless its stage config says otherwise: none. Stage
#: workers are light; a reservation would only take the whole CPU that a read, shuffle or
#: write task of the input plan needs (a 1-CPU cluster cannot run a 1-CPU task beside a
#: 0.1-CPU actor).
DEFAULT_STAGE_NUM_CPUS = 0.0
#: Whole CPUs kept free beside the engine replicas on a cluster without GPUs: one for a task of
#: the input plan that may hold its CPU while it waits (a read that a ``limit`` no longer
#: consumes), one for the task that must run next (a shuffle, a write).
CPU_HEADROOM = 2.0
#: Rows a Ray Data block holds at least where one worker takes every block (0: one batch a
#: block). Each block costs a task, its objects and the executor's bookkeeping (a few
#: milliseconds of the driver's and the worker's CPU on a small machine), and a block of several
#: batches runs them side by side (``stages/runner.run_batches``): 1,024 rows gave the H100
#: figures of bench/RESULTS. Off by default: Ray Data hands a task's output on only when the
#: task ends (its output buffer builds blocks of ``target_max_block_size``), so the rows of a
#: block of several batches leave together, after its slowest batch: commits, progress and a
#: job's last rows wait for it, and a SIGTERM'd or killed job loses more (test_jobs, test_terminal).
MIN_BLOCK_ROWS = 0


def block_batches(batch_size: int, workers: int) -> int:
    """Batches of ``batch_size`` rows per block: enough for :data:`MIN_BLOCK_ROWS` rows where one
    worker takes every block; one where blocks spread over several workers (a small input must
    still reach each of them)."""
    return max(1, MIN_BLOCK_ROWS // batch_size) if workers == 1 else 1


def engine_cpu_share(cluster_cpus: float, replicas: int, cpu_reserved: float) -> float:
    """CPUs each engine replica reserves on a cluster without GPUs.

    One each when the cluster has room for the replicas, what the CPU stages reserve and
    :data:`CPU_HEADROOM` whole CPUs beside them; otherwise none. The reservation is Ray's
    bookkeeping only (vLLM on CPU uses the cores the OS gives it either way), and on a small
    cluster any reservation would leave a 1-CPU task of the input plan (a read, a shuffle, a
    write, a checkpoint filter) waiting forever.
    """
    if cluster_cpus - cpu_reserved >= replicas + CPU_HEADROOM:
        return 1.0
    return 0.0


#: Whole CPUs a node must have free beside its engine replicas and :data:`CPU_HEADROOM` before
#: the CPU stages leave the replicas for a pool of their own (:func:`spread_workers`).
MIN_SPREAD_CPUS = 2
#: CPUs each worker of that pool reserves.
SPREAD_WORKER_CPUS = 1.0


def spread_workers(cluster: dict[str, float], replicas: int, devices_per_replica: float, cpu_reserved: float) -> int:
    """Workers for the CPU stages before the engine, in a pool of their own, or 0: keep them in
    the replicas.

    Only where the engines run on GPUs: a replica does all its rows' CPU work (preprocess, chat
    template, tokenize, dedup, copies, detokenize, postprocess, the codec) on one thread, which
    sets the pace of short answers while the node's other cores idle (issue 29: 2,700 rows/s on
    an H100 node of 16 cores). A CPU engine's own threads use every core, and a laptop's
    cores are the input plan's and the engine's (``engine_cpu_share``): there nothing moves."""
    if not (cluster.get("GPU", 0) > 0 and devices_per_replica > 0):
        return 0
    free = cluster.get("CPU", 0) - cpu_reserved - replicas - CPU_HEADROOM
    return int(free) if free >= MIN_SPREAD_CPUS else 0
