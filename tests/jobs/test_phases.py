"""stats.json's start-up phases: each from the end of the one before, None where it did not happen."""

import time

from llmbatch.jobs.output import startup_phases
from llmbatch.jobs.tally import Tally


def test_phases_follow_one_another_and_add_up_to_the_whole_process():
    t0 = time.time() - 100
    run_info = {"started_at": t0 + 5, "ended_at": t0 + 90,
                "marks": {"process_start": t0, "entered": t0 + 2, "ingest_s": 1.5, "ray_ready": t0 + 12,
                          "ray_began": t0 + 2.5, "ray_up": t0 + 11.5,
                          "first_row": t0 + 40, "last_row": t0 + 86.5}}
    totals = Tally()
    totals.start_at += [t0 + 20, t0 + 21]
    totals.ready_at += [t0 + 35, t0 + 38]
    phases = startup_phases(run_info, totals)
    assert [phases[k] for k in ("process", "prepare_job", "ray_start", "replica_placement", "engine_start",
                                "first_answer", "rows")] == [2, 3, 7, 8, 15, 5, 50]
    assert 9.5 < phases["output"] < 11 and phases["ingest"] == 1.5 and phases["to_first_row"] == 40
    assert phases["after_last_row"] == 3.5  # the rows phase's last commits, inside "rows"
    assert phases["ray_init"] == 9  # Ray's start began beside the preparation: 3 s of it were covered
    inside = ("ingest", "ray_init", "to_first_row", "total", "after_last_row")
    assert abs(sum(v for k, v in phases.items() if k not in inside) - phases["total"]) < 0.01


def test_a_resumed_run_ignores_replicas_of_an_earlier_run_and_an_unknown_start():
    t0 = time.time() - 50
    run_info = {"started_at": t0, "ended_at": t0 + 40, "marks": {"entered": t0 - 1, "first_row": t0 + 30}}
    totals = Tally()
    totals.ready_at += [t0 - 500]  # a replica of the run before
    phases = startup_phases(run_info, totals)
    assert phases["process"] is None and phases["total"] is None and phases["ingest"] is None
    assert phases["ray_init"] is None
    assert phases["replica_placement"] is None and phases["engine_start"] is None and phases["first_answer"] is None
    assert phases["prepare_job"] == 1 and phases["rows"] == 10
    assert phases["after_last_row"] is None  # no last row noted
