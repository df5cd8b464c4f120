"""How ``make test`` hands test files to its workers (tests/suite_schedule.py)."""

from __future__ import annotations

from pathlib import Path

from suite_schedule import LONGEST_FIRST, SAME_WORKER, LongestFilesFirst


def test_the_files_grouped_on_one_worker_exist_once():
    repo = Path(__file__).resolve().parents[1]
    grouped = [path for group in SAME_WORKER for path in group]
    assert [p for p in grouped if not (repo / p).is_file()] == []
    assert len(grouped) == len(set(grouped))


def _schedule(queue: list[str]) -> LongestFilesFirst:
    """The scheduler's choice alone (no xdist session): its queue of files."""
    scheduler = LongestFilesFirst.__new__(LongestFilesFirst)
    scheduler.group_owner = {}
    scheduler.workqueue = dict.fromkeys(queue)
    return scheduler


def _take(scheduler: LongestFilesFirst, node: str) -> str:
    scope = scheduler._next_scope(node)
    del scheduler.workqueue[scope]
    return scope


def test_a_group_stays_with_the_worker_that_began_it_until_nothing_else_is_left():
    usual, media = SAME_WORKER
    scheduler = _schedule(list(LONGEST_FIRST))
    assert _take(scheduler, "a") == "tests/e2e/test_lora_logprobs.py"  # the longest first
    assert _take(scheduler, "b") == "tests/e2e/test_jobs.py"  # the next: b's group from now on
    # b takes the rest of its group, longest first, before any other file; a none of it
    taken = [_take(scheduler, "b") for _ in usual[1:]]
    assert taken == sorted(usual[1:], key=LONGEST_FIRST.index)
    # examples/embed.yaml's MiniLM: its last two files one after the other (on its warm engine)
    assert taken.index("tests/e2e/test_openai_batch_files.py") == taken.index("tests/e2e/test_terminal.py") + 1
    assert _take(scheduler, "a") == "tests/e2e/test_tasks.py"
    rest = [_take(scheduler, "a") for _ in range(len(scheduler.workqueue))]
    assert not set(rest) & set(usual) and sorted(rest) == sorted(set(LONGEST_FIRST) - set(usual) - {
        "tests/e2e/test_lora_logprobs.py", "tests/e2e/test_tasks.py"})
    # the media files one after the other (the second on the first's warm engine)
    assert rest.index(media[1]) == rest.index(media[0]) + 1


def test_another_workers_group_is_taken_once_nothing_else_is_left():
    usual, _ = SAME_WORKER
    scheduler = _schedule([usual[0], usual[1], "tests/test_rows.py"])
    assert _take(scheduler, "b") == usual[0]
    assert _take(scheduler, "a") == "tests/test_rows.py"
    assert _take(scheduler, "a") == usual[1]  # b's group, where a would otherwise wait
