"""``--report``: a PNG chart of a run's throughput over time, from :class:`~llmbatch.progress.Progress`'s
timeline (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from llmbatch.errors import MissingDependencyError


def check_report_dependencies() -> None:
    """Raise :class:`MissingDependencyError` unless :func:`write_report` can run (call it before
    the work, so that a missing matplotlib is said at once, not after the job)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError("--report", "matplotlib")


def write_report(timeline: list[tuple[float, int, int, int]], path: Path, title: str = "llmbatch throughput") -> Path:
    """A PNG chart of rows/s and output tokens/s over the run (needs matplotlib)."""
    check_report_dependencies()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if len(timeline) < 2:
        timeline = list(timeline) + [timeline[-1]] if timeline else [(0, 0, 0, 0), (1, 0, 0, 0)]
    t0 = timeline[0][0]
    xs, rows_s, out_s = [], [], []
    for (ta, ra, _, oa), (tb, rb, _, ob) in zip(timeline, timeline[1:]):
        dt = max(1e-6, tb - ta)
        xs.append(tb - t0)
        rows_s.append((rb - ra) / dt)
        out_s.append((ob - oa) / dt)
    fig, ax1 = plt.subplots(figsize=(9, 4))
    ax1.plot(xs, rows_s, color="tab:blue", label="rows/s")
    ax1.set_xlabel("seconds since start")
    ax1.set_ylabel("rows/s", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(xs, out_s, color="tab:orange", label="generated tokens/s")
    ax2.set_ylabel("generated tokens/s", color="tab:orange")
    ax1.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
