"""What a person at a terminal sees of a real job: the start-up phase, then llmbatch's own view
(no line of Ray's or vLLM's loggers), and one set of figures: the live view's last frame
(progress.json's final snapshot), the summary and `llmbatch status` agree, over a named window;
a pooling job reports items/s, not generated tokens."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest
from inproc import llmbatch

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 600  # a cold engine start on a busy 2-core machine takes about a minute
#: Lines of Ray's and vLLM's loggers (C++ core worker, raylet, Python loggers' levels).
FOREIGN = re.compile(r"core_worker|raylet|\bINFO\b|\bWARNING\b|Specifying both num_cpus")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _flat(text: str) -> str:
    """A printed table as one line of words (its cells wrap at 80 columns)."""
    return " ".join(text.translate(str.maketrans("│┃┌┐└┘─━┬┴├┤", "            ")).split())


def _rate(text: str, label: str) -> float:
    found = re.search(label + r" .*?([\d,.]+) rows/s", text)
    assert found, text
    return float(found.group(1).replace(",", ""))


def _agree(*values: float) -> bool:
    return max(values) <= 1.05 * min(values) + 0.051  # within 5% (and the one decimal they are printed with)


def _rows(path: Path, n: int) -> Path:
    path.write_text("\n".join(json.dumps({"id": i, "name": f"item {i}"}) for i in range(n)) + "\n")
    return path


def run_in_pty(args: list[str], cwd: Path, bound_s: float) -> tuple[int, str]:
    """Run ``args`` with a pseudo-terminal as its stdin, stdout and stderr (100 columns); its
    exit code and everything it wrote. Fails the test past ``bound_s``."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 100, 0, 0))
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, close_fds=True,
                            env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "100"}, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + bound_s
    try:
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"{' '.join(args)} did not end within {bound_s:.0f} s; it wrote:\n"
                                     + b"".join(chunks).decode(errors="replace")[-3000:])
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk and proc.poll() is not None:
                    break
                chunks.append(chunk)
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
        os.close(master)
    return proc.returncode, ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r", "\n")


def test_a_job_in_a_terminal_shows_its_start_up_and_none_of_ray_or_vllm(ray_cluster, smollm2, tmp_path):
    """The real `llmbatch run` in a pseudo-terminal: the live view names the start-up phase,
    Ray's and vLLM's lines (the core worker's actor warning is one every run makes) go to the
    job's log.txt, and the run ends with its summary."""
    _rows(tmp_path / "in.jsonl", 6)
    code, seen = run_in_pty([str(REPO / ".venv" / "bin" / "llmbatch"), "run", "-m", "smollm2-135m-instruct",
                             "--input", "in.jsonl", "--id-column", "id", "--prompt", "Say {name}",
                             "--max-tokens", "4", "--output", "out.jsonl",
                             "--set", "model.engine_kwargs.max_model_len=512"], tmp_path, BOUND_S)
    assert code == 0, seen[-3000:]
    assert "starting" in seen and re.search(r"starting Ray|placing replicas|loading the model", seen), seen[-3000:]
    foreign = sorted({line.strip() for line in seen.splitlines() if FOREIGN.search(line)})
    assert not foreign, "\n".join(foreign)
    assert "llmbatch job finished" in seen and "6 answered" in seen
    log = (tmp_path / "out.jsonl.job" / "log.txt").read_text()
    assert "finished: 6 rows answered" in log


def test_the_last_frame_the_summary_and_status_agree(ray_cluster, smollm2, minilm, tmp_path):
    """One set of figures: rows/s in the live view's last frame (progress.json, written when
    the run ends), the end-of-run summary (stats.json and what it printed) and `llmbatch status`
    (its JSON and its table) agree within 5%, over the window they name."""
    _rows(tmp_path / "in.jsonl", 24)
    proc = llmbatch("run", "-m", "smollm2-135m-instruct", "--input", tmp_path / "in.jsonl", "--id-column", "id",
                    "--prompt", "Say {name}", "--max-tokens", "4", "--output", tmp_path / "out.jsonl", "--quiet",
                    "--set", "model.engine_kwargs.max_model_len=512")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    job = tmp_path / "out.jsonl.job"
    frame = json.loads((job / "progress.json").read_text())
    stats = json.loads((job / "stats.json").read_text())
    status = llmbatch("status", job, "--json")
    shown = json.loads(status.stdout)
    table = _flat(llmbatch("status", job).stdout)
    summary = _flat(proc.stdout)
    assert frame["window"] == stats["window"] == shown["window"] == "since start"
    assert "since start" in summary and "since start" in table, (summary, table)
    rates = [frame["rows_per_s"], stats["rows_per_s"], shown["rows_per_s"], _rate(summary, "this run"), _rate(table, "throughput")]
    assert rates[0] > 0 and _agree(*rates), rates
    tokens = [frame["generated_tokens_per_s"], stats["generated_tokens_per_s"], shown["generated_tokens_per_s"]]
    assert tokens[0] > 0 and _agree(*tokens), tokens

    # a pooling task: rows/s and items/s (embeddings), no generated tokens (examples/embed.yaml's
    # engine: the warm one of test_tasks.py and test_openai_batch_files.py, on the same worker)
    proc = llmbatch("run", "-m", "all-minilm-l6-v2", "--task", "embed", "--text-column", "name",
                    "--input", tmp_path / "in.jsonl", "--id-column", "id", "--output", tmp_path / "emb.parquet",
                    "--quiet", "--set", "model.engine_kwargs.max_model_len=256")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = _flat(proc.stdout)
    assert "rows/s" in summary and "items/s (embeddings)" in summary and "generated" not in summary, summary
    table = _flat(llmbatch("status", tmp_path / "emb.parquet.job").stdout)
    assert "items/s (embeddings)" in table and "generated" not in table, table


def test_a_job_sent_sigterm_stops_as_ctrl_c_does(ray_cluster, smollm2, tmp_path):
    """`kill PID` stops a CLI job cleanly (committed rows kept, exit code 130, `resume` goes on),
    although Ray's start in the driver makes SIGTERM a plain exit."""
    from waiting import committed, wait_for

    _rows(tmp_path / "in.jsonl", 400)
    job = tmp_path / "out.jsonl.job"
    proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "llmbatch"), "run", "-m", "smollm2-135m-instruct",
                             "--input", "in.jsonl", "--id-column", "id", "--prompt", "Write a story about {name}",
                             "--max-tokens", "64", "--output", "out.jsonl", "--quiet",
                             "--set", "model.engine_kwargs.max_model_len=512", "--set", "model.batch_size=16"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: committed(job) > 0, BOUND_S, "the job's first committed rows", proc, step=0.2)
        proc.terminate()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, out[-3000:]
    assert "stopped; answered rows are committed" in out and "Traceback" not in out, out[-3000:]
    assert llmbatch("status", job, "--json").stdout.count('"stopped (resume to continue)"') == 1
