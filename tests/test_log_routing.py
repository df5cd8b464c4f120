"""While a job runs, Ray's and vLLM's lines go to its log.txt (llmbatch.terminal): in the Python
API their records below ERROR (errors still show), in the llmbatch process everything written
to stdout, stderr and file descriptor 2 but the job's own view."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

from llmbatch.terminal import job_terminal


def test_the_python_api_sends_library_records_below_error_to_the_log(tmp_path, capsys):
    logger = logging.getLogger("ray.llmbatch_test")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with job_terminal(tmp_path / "job" / "log.txt") as terminal:
            logger.warning("Specifying both num_cpus and num_gpus for map tasks is experimental")
            logger.error("a real error")
        logger.warning("after the job")
    finally:
        logger.removeHandler(handler)
    assert terminal.out is None and terminal.err is None  # the job's view writes where it always does
    err = capsys.readouterr().err
    assert "num_gpus" not in err and "a real error" in err and "after the job" in err
    log = (tmp_path / "job" / "log.txt").read_text()
    assert "WARNING" in log and "num_gpus" in log and "a real error" not in log and log.count("num_gpus") == 1


def test_the_llmbatch_process_keeps_only_its_own_view_on_the_terminal(tmp_path):
    """Ray's C++ lines (fd 2), its messages for the driver (sys.stdout) and the libraries'
    loggers go to the log; what the job writes to the terminal's streams stays there."""
    script = textwrap.dedent(f"""
        import logging, os, sys
        from pathlib import Path
        from llmbatch import terminal

        logging.getLogger("vllm").addHandler(logging.StreamHandler(sys.stdout))
        terminal.claim_process()
        with terminal.job_terminal(Path({str(tmp_path / "log.txt")!r})) as view:
            os.write(2, b"[2026 E 1 1] core_worker.cc:2465: Actor with class name ... max_restarts > 0\\n")
            print("(raylet) killed by ray.kill [repeated 23x]")
            logging.getLogger("vllm").warning("WARNING vllm chatter")
            view.out.write("the live view\\n")
            view.err.write("a progress line\\n")
        print("the summary")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shown = proc.stdout + proc.stderr
    assert "the live view" in proc.stdout and "the summary" in proc.stdout and "a progress line" in proc.stderr
    for foreign in ("core_worker", "raylet", "vllm chatter"):
        assert foreign not in shown, shown
    log = (tmp_path / "log.txt").read_text()
    assert "core_worker" in log and "raylet" in log and "vllm chatter" in log
