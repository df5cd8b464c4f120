"""Ray start-up and cluster checks.

On a laptop Ray starts itself (``ray.init()`` with local resources); on a cluster the same
code joins it through ``RAY_ADDRESS``. Requests the cluster can never satisfy fail here, at
once, instead of leaving the job pending forever.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from llmbatch import startlog
from llmbatch.errors import ResourceError

logger = logging.getLogger(__name__)


def ensure_ray(**init_kwargs) -> None:
    """Start or join Ray if this process has not yet."""
    import ray

    if ray.is_initialized():
        return
    # Ray's start-up notices (token authentication, the local instance) stay in its log files
    kwargs = {"ignore_reinit_error": True, "include_dashboard": False, "logging_level": logging.ERROR}
    kwargs.update(init_kwargs)
    if os.environ.get("RAY_ADDRESS"):
        kwargs.pop("num_cpus", None)
        kwargs.pop("num_gpus", None)
    # ray.init makes SIGTERM sys.exit(15) in the driver; a handler of the process's own (run_job's:
    # stop cleanly, as Ctrl-C does) stays
    own = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    with startlog.timed("ray-init", joined=bool(os.environ.get("RAY_ADDRESS") or kwargs.get("address"))):
        ray.init(**kwargs)
    if callable(own):
        signal.signal(signal.SIGTERM, own)


def check_accelerator(accelerator_type: str, cluster: dict[str, float]) -> None:
    """Fail fast when no node has ``accelerator_type``."""
    key = f"accelerator_type:{accelerator_type}"
    if cluster.get(key, 0) > 0:
        return
    available = sorted(k.split(":", 1)[1] for k in cluster if k.startswith("accelerator_type:"))
    have = ", ".join(available) if available else "none (this cluster has no GPUs)" if not cluster.get("GPU") else "none labelled"
    raise ResourceError(
        f"accelerator_type={accelerator_type!r} is not available on this Ray cluster (accelerator types here: "
        f"{have}). Remove accelerator_type to run on what this machine has, or start the job on a cluster "
        f"with {accelerator_type} nodes."
    )
