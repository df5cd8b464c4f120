"""What counting a job's rows costs (``jobs/tally.py``'s ``Tally.add``), in this process: the
driver counts each part it commits (progress) and the output counts every part again (stats.json).
500,000 made-up answered rows of two replicas (a 2-engine job's stats column), counted in parts
of 888 rows (a 2,000,000-row job's commits), of 4,096, and as one table; best of three each.

    python bench/tally_costs.py [SRC]      # SRC: another llmbatch tree's src/ (an older commit's)
"""

from __future__ import annotations

import sys
import time

if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from llmbatch.jobs.tally import Tally  # noqa: E402
from llmbatch.rows import ERROR_COLUMN, STATS  # noqa: E402

ROWS = 500_000


def main() -> None:
    rng = np.random.default_rng(0)
    stats = pa.array([{"replica": f"vm:{1000 + i % 2}", "restarts": 0, "deduped": bool(i % 9),
                       "ready_at": 1795950000.5 + (i % 2), "start_at": 1795949990.0,
                       "first_request_at": 1795950001.0, "cached_tokens": None} for i in range(ROWS)])
    table = pa.table({ERROR_COLUMN: pa.array([None] * ROWS, pa.string()), STATS: stats,
                      "num_input_tokens": pa.array(rng.integers(20, 40, ROWS)),
                      "num_generated_tokens": pa.array(rng.integers(1, 8, ROWS))})
    for size in (888, 4096, ROWS):
        parts = [table.slice(i, size) for i in range(0, ROWS, size)]
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            tally = Tally()
            for part in parts:
                tally.add(part)
            best = min(best, time.perf_counter() - t0)
        assert tally.ok == ROWS and sum(tally.replicas.values()) == ROWS
        print(f"parts of {size}: {best:.3f} s for {ROWS:,} rows ({best / ROWS * 1e6:.2f} us a row)")


if __name__ == "__main__":
    main()
