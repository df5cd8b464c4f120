"""A newcomer's mistakes, walked through the real command line: every one is caught before any
engine or Ray starts, in one line on stderr with exit code 2, naming the flag and the fix, with no
traceback, and leaves nothing behind (no job directory, no output folder).

The CLI's own entry point runs in the test process (``tests/inproc.py``), where the start-up
ledger (``LLMBATCH_START_LOG``) shows that nothing started; a case runs in a process of its own
where the process is the point: file permissions a root process gives up before it runs
(``unprivileged``), and variables read once at import (``HF_HUB_OFFLINE``). Those cases share
one process (``tests/cli_cases.py``), each in its own folder: one that gave up those permissions
and has every such variable set. Neither touches what the other cases check: the unprivileged
cases name an offline alias (found in the local cache, offline or not), and the offline cases
read and write only files this process owns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from inproc import llmbatch as llmbatch_inproc

SMOL = "smollm2-135m-instruct"
CLI_CASES = Path(__file__).parents[1] / "cli_cases.py"
#: capabilities a root process reads and writes past file permissions with (linux/capability.h)
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2
PR_CAPBSET_DROP = 24


@dataclass
class Mistake:
    args: list[str]
    says: list[str]                                   # words the one error line must hold
    files: dict[str, str] = field(default_factory=dict)  # name -> content ("/" ending: a folder)
    read_only: list[str] = field(default_factory=list)   # files/folders made unreadable/unwritable
    env: dict[str, str] = field(default_factory=dict)
    unprivileged: bool = False                        # needs permissions to hold (not root)
    not_says: list[str] = field(default_factory=lambda: ["JobSpec", "ModelSpec", "(got {"])  # internals


def run_args(*extra: str, model: str | None = SMOL, prompt: str | None = "Say {a}", inp: str | None = "in.csv",
             out: str | None = "out/x.parquet") -> list[str]:
    args = ["run"]
    for flag, value in (("-m", model), ("--input", inp), ("--prompt", prompt), ("--output", out)):
        if value is not None:
            args += [flag, value]
    return args + list(extra)


CSV = {"in.csv": "a,b\n1,2\n3,4\n"}
#: an output and its job directory beside it
JOB_BESIDE = {"out/": "", "out/x.parquet": "PAR1", "out/x.parquet.job/": "", "out/x.parquet.job/job.json": "{}"}
#: the model cases resolve with no network and an empty cache: nothing can be fetched
OFFLINE = {"HF_HUB_OFFLINE": "1"}

MISTAKES = {
    "missing input file": Mistake(run_args(inp="nosuch.csv"), ["--input", "nosuch.csv", "does not exist"], CSV),
    "unreadable input": Mistake(run_args(), ["--input", "cannot be read"], CSV, read_only=["in.csv"],
                                unprivileged=True),
    "output under a file": Mistake(run_args(out="reviews.csv/sub/out.parquet"), ["--output", "is a file"],
                                   {**CSV, "reviews.csv": "x\n1\n"}),
    "read-only output folder": Mistake(run_args("--job-dir", "jobs/one", out="ro/out.parquet"),
                                       ["--output", "cannot write"], {**CSV, "ro/": ""}, read_only=["ro"],
                                       unprivileged=True),
    "read-only job dir": Mistake(run_args("--job-dir", "ro/job"), ["--job-dir", "cannot write"],
                                 {**CSV, "ro/": ""}, read_only=["ro"], unprivileged=True),
    "job dir under a file": Mistake(run_args("--job-dir", "reviews.csv/job"), ["--job-dir", "is a file"],
                                    {**CSV, "reviews.csv": "x\n1\n"}),
    # a test model's name before make-test-models built it (in the empty cache)
    "model not resolvable offline": Mistake(run_args(model="tiny-vlm"), ["--model", "tiny-vlm", "llmbatch models"],
                                            CSV, env=OFFLINE),
    # the hub id of the model an offline alias is made from, with no hub: the alias is named
    "hub id of the offline model": Mistake(run_args(model="HuggingFaceTB/SmolLM2-135M-Instruct"),
                                           ["--model", "-m smollm2-135m-instruct", "GGUF Q4_1"], CSV, env=OFFLINE),
    "unknown model name": Mistake(run_args(model="no-such-model"), ["--model", "no-such-model", SMOL], CSV,
                                  env=OFFLINE),
    "empty input file": Mistake(run_args(inp="empty.csv"), ["--input", "has no rows"], {"empty.csv": ""}),
    "csv with a header and no rows": Mistake(run_args(inp="header.csv"), ["--input", "has no rows", "header"],
                                             {"header.csv": "a,b\n"}),
    "jsonl of blank lines": Mistake(run_args(inp="blank.jsonl"), ["--input", "has no rows"],
                                    {"blank.jsonl": "\n\n"}),
    "no --model": Mistake(run_args(model=None), ["--model", "-m", SMOL], CSV),
    "no --prompt": Mistake(run_args(prompt=None), ["--prompt", "{Company}"], CSV),
    "no --output": Mistake(run_args(out=None), ["--output"], CSV),
    "openai batch naming no model": Mistake(
        ["run", "--openai-batch", "batch.jsonl", "--output", "out/answers.jsonl"], ["--model", "each line"],
        {"batch.jsonl": json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"messages": [{"role": "user", "content": "Hi"}]}}) + "\n"}),
    "prompt field the input lacks": Mistake(run_args(prompt="Say {Company}"), ["--prompt", "{Company}", "a, b"], CSV),
    "input format unknown": Mistake(run_args(inp="data.txt"), ["--input", "--set input.format="], {"data.txt": "a\n1\n"}),
    # flag values out of range: refused by the command line itself, naming the flag
    "--limit 0": Mistake(run_args("--limit", "0"), ["--limit", "1"], CSV),
    "--max-tokens 0": Mistake(run_args("--max-tokens", "0"), ["--max-tokens", "1"], CSV),
    "two prompt sources": Mistake(run_args("--text-column", "b"), ["prompt.user", "prompt.text_column"], CSV,
                                  not_says=["(got"]),
    "output format unknown": Mistake(run_args(out="out/x.txt"), ["--output", "--set output.format="], CSV),
    # a prompt source that does not suit the task: found from the job alone, before Ray or an engine
    # starts (it was found where the preprocess is built, after Ray's start)
    "text column for generation": Mistake(run_args("--text-column", "b", prompt=None),
                                          ["prompt.text_column", "prompt.prompt_column"], CSV),
    # a path that is not what the command takes: the output for its job, a data file for a job file
    "resume given the output": Mistake(["resume", "out/x.parquet"], ["out/x.parquet.job", "llmbatch resume"], JOB_BESIDE),
    "status given the output": Mistake(["status", "out/x.parquet"], ["the job of that output is out/x.parquet.job"],
                                       JOB_BESIDE),
    "data file as the job file": Mistake(["run", "in.csv"], ["job file 'in.csv'", "--input in.csv"], CSV),
    "folder as the job file": Mistake(["run", "data"], ["job file 'data' is not a YAML job file"], {"data/": ""}),
    "two columns renamed to one name": Mistake(run_args("--set", "output.rename={generated_text: x, finish_reason: x}"),
                                               ["output.rename", "'generated_text' -> 'x'", "'finish_reason' -> 'x'"],
                                               CSV),
    "answer renamed onto an input column": Mistake(run_args("--set", "output.rename={generated_text: a}"),
                                                   ["output.rename", "'generated_text' -> 'a'", "the column 'a'"], CSV),
    "one text for task score": Mistake(run_args("--task", "score", "--text-column", "b", prompt=None),
                                       ["task 'score'", "prompt.pair_columns"], CSV),
}


@pytest.fixture
def workdir(tmp_path):
    yield tmp_path
    _readable_again(tmp_path)


def _readable_again(root: Path) -> None:
    for p in root.rglob("*"):  # what a case made unreadable, readable again for pytest's clean-up
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _lay_out(case: Mistake, root: Path) -> dict[str, str]:
    """The case's files and permissions under ``root``; the variables its run gets."""
    for rel, content in case.files.items():
        target = root / rel
        if rel.endswith("/"):
            target.mkdir(parents=True)
        else:
            target.write_text(content)
    for rel in case.read_only:
        (root / rel).chmod(0o555 if (root / rel).is_dir() else 0)
    env = dict(case.env)
    if env.get("HF_HUB_OFFLINE"):
        (root / "cache").mkdir()
        env["LLMBATCH_CACHE"] = str(root / "cache")
    return env


def _obey_file_permissions() -> None:
    """In the child, before it runs Python: a root process gives up reading and writing past
    file permissions (dropped from its bounding set, they are gone once it executes)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def _llmbatch(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in this process, with the start-up ledger's lines of this process checked: none
    is written (no Ray, no engine started)."""
    own = not os.environ.get("LLMBATCH_START_LOG")  # a run of this file alone: a ledger of its own
    if own:
        os.environ["LLMBATCH_START_LOG"] = tempfile.mkstemp(prefix="lbt-mistakes-", suffix=".jsonl")[1]
    ledger = Path(os.environ["LLMBATCH_START_LOG"])
    ledger.touch()
    seen = ledger.stat().st_size
    try:
        proc = llmbatch_inproc(*args, cwd=cwd, env={"LLMBATCH_KEEP_WARM_S": "0"})
        with ledger.open("rb") as f:
            f.seek(seen)
            mine = [json.loads(line) for line in f.read().splitlines() if line.strip()]
    finally:
        if own:
            ledger.unlink(missing_ok=True)
            os.environ.pop("LLMBATCH_START_LOG")
    started = [e["kind"] for e in mine if e.get("pid") == os.getpid()]
    assert not started, f"llmbatch {args[0]} started {started} before it failed"
    return proc


def _apart(case: Mistake) -> bool:
    """Whether a case needs a process of its own (see the module's text)."""
    return case.unprivileged or bool(case.env)


@pytest.fixture(scope="module")
def apart(tmp_path_factory):
    """``apart(name)``: the case's run, its folder's tree before and after, from one process
    running all the cases that need one (``_apart``), each in a folder of its own."""
    done: dict[str, tuple[subprocess.CompletedProcess, set[str], set[str]]] = {}
    roots: list[Path] = []

    def run_all() -> None:
        names = [name for name, case in MISTAKES.items() if _apart(case)]
        env: dict[str, str] = {}  # the variables read at import: the process's own
        for name in names:
            for key, value in MISTAKES[name].env.items():
                assert env.setdefault(key, value) == value, f"two cases want {key} to differ: give them a process each"
        batch = tmp_path_factory.mktemp("apart")
        cases, befores = [], {}
        for name in names:
            root = batch / name.replace(" ", "-")
            root.mkdir()
            roots.append(root)
            case_env = _lay_out(MISTAKES[name], root)
            befores[name] = _tree(root)
            cases.append({"args": MISTAKES[name].args, "cwd": str(root),
                          "env": {k: v for k, v in case_env.items() if k not in env}})
        cases_path, results_path = batch / "cases.json", batch / "results.json"
        cases_path.write_text(json.dumps(cases))
        unprivileged = any(MISTAKES[name].unprivileged for name in names)
        preexec = _obey_file_permissions if unprivileged and os.geteuid() == 0 else None
        child = subprocess.run([sys.executable, str(CLI_CASES), str(cases_path), str(results_path)],
                               capture_output=True, text=True, timeout=300, preexec_fn=preexec,
                               env={**os.environ, "LLMBATCH_KEEP_WARM_S": "0", **env})
        assert child.returncode == 0 and results_path.exists(), \
            f"{CLI_CASES.name} failed:\n{child.stdout}{child.stderr}"
        results = json.loads(results_path.read_text())
        for name, case, result in zip(names, cases, results, strict=True):
            proc = subprocess.CompletedProcess(["llmbatch", *case["args"]], result["returncode"], result["stdout"],
                                               result["stderr"])
            done[name] = (proc, befores[name], _tree(Path(case["cwd"])))

    def result(name: str):
        if not done:
            run_all()
        return done[name]

    yield result
    for root in roots:
        _readable_again(root)


@pytest.mark.parametrize("name", list(MISTAKES))
def test_mistake_is_caught_before_anything_starts(name, workdir, apart):
    case = MISTAKES[name]
    if _apart(case):
        proc, before, after = apart(name)
    else:
        _lay_out(case, workdir)
        before = _tree(workdir)
        proc = _llmbatch(case.args, workdir)
        after = _tree(workdir)
    printed = proc.stdout + proc.stderr
    assert "Traceback" not in printed, printed
    assert proc.returncode == 2, printed
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    error_lines = [line for line in lines if line.startswith(("error:", "Error:"))]  # llmbatch's, click's
    assert len(error_lines) == 1, printed
    for word in case.says:
        assert word in error_lines[0], f"{word!r} not in {error_lines[0]!r}"
    assert not any(word in printed for word in case.not_says), printed
    assert after == before, "left behind: " + ", ".join(sorted(after - before))


def test_retry_errors_with_no_error_rows_starts_nothing(workdir):
    """A job that finished without errors: retry-errors says so (0 rows) and runs nothing."""
    import pyarrow as pa

    from llmbatch.jobs.kinds import job_for
    from llmbatch.jobs.run import open_job, read_input
    from llmbatch.jobs.spec import load_job
    from llmbatch.jobs.store import JobDir
    from llmbatch.rows import ERROR_COLUMN, ROW_ID

    (workdir / "in.csv").write_text(CSV["in.csv"])
    spec = load_job(data={"input": {"path": str(workdir / "in.csv")}, "model": {"source": SMOL},
                          "prompt": {"user": "Say {a}"}, "output": {"path": str(workdir / "out.parquet")}})
    job = JobDir(spec.resolved_job_dir())
    opened = job_for(spec)
    open_job(opened)
    meta = read_input(opened)
    job.commit(pa.table({ROW_ID: [0, 1], ERROR_COLUMN: ["", ""], "generated_text": ["1", "3"]}))
    meta.finished = {"parts_upto": 0}
    job.write_meta(meta)
    proc = _llmbatch(["retry-errors", str(job.root)], workdir)
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, printed
    assert "0 rows" in printed and "no error rows" in printed, printed
    assert job.meta().runs == [], "a run was recorded: something ran"
    assert not (workdir / "out.parquet").exists()


def test_embed_without_a_model_runs_the_shipped_embedding_model(tmp_path):
    from llmbatch.errors import ConfigError
    from llmbatch.jobs.spec import load_job

    data = {"input": {"path": str(tmp_path / "in.csv")}, "output": {"path": str(tmp_path / "out.parquet")},
            "task": "embed", "prompt": {"text_column": "a"}}
    spec = load_job(data=data)
    assert spec.model.source == "all-minilm-l6-v2"
    assert spec.processor_config().task_type == "embed"
    with pytest.raises(ConfigError, match="--model"):  # other tasks still need one
        load_job(data={**data, "task": "classify"})


def test_models_found_by_name_pass_the_model_check(tmp_path, monkeypatch):
    """A built test model and a prepared alias pass; the check downloads nothing for them."""
    from llmbatch.jobs.preflight import check_model
    from llmbatch.jobs.spec import load_job
    from llmbatch.models import prepare

    prepare(SMOL)  # in the real cache, before the cache moves
    data = {"input": {"path": str(tmp_path / "in.csv")}, "output": {"path": str(tmp_path / "out.parquet")},
            "prompt": {"user": "{a}"}}
    check_model(load_job(data={**data, "model": {"source": SMOL}}))
    monkeypatch.setenv("LLMBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    built = tmp_path / "cache" / "test-models" / "tiny-vlm"
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    check_model(load_job(data={**data, "model": {"source": "tiny-vlm"}}))


def test_a_hub_model_is_checked_by_its_config_alone(tmp_path, monkeypatch):
    """A hub id is looked up before Ray starts, with the token the replicas get, fetching only
    config.json (never the weights); a hub that does not give it is a --model mistake."""
    import huggingface_hub

    from llmbatch.errors import ConfigError
    from llmbatch.jobs.preflight import check_model
    from llmbatch.jobs.spec import load_job

    asked = []

    def snapshot_download(repo_id, allow_patterns=None, token=None, **kwargs):
        asked.append((repo_id, allow_patterns, token))
        if repo_id != "org/there":
            raise OSError("404: no such repository\nmore detail")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    data = {"input": {"path": str(tmp_path / "in.csv")}, "output": {"path": str(tmp_path / "out.parquet")},
            "prompt": {"user": "{a}"}}
    model = {"runtime_env": {"env_vars": {"HF_TOKEN": "hf_from_the_job"}}}
    check_model(load_job(data={**data, "model": {**model, "source": "org/there"}}))
    assert asked == [("org/there", ["config.json"], "hf_from_the_job")]
    with pytest.raises(ConfigError, match="--model .*'org/missing'.*OSError: 404: no such repository\\)"):
        check_model(load_job(data={**data, "model": {"source": "org/missing"}}))


def test_a_run_refused_by_the_lock_leaves_the_other_drivers_new_job_alone(tmp_path, monkeypatch):
    """Two starts of the same new job: the one refused by the lock removes nothing of the one
    reading its input (a new job's directory goes only when its own run failed under the lock)."""
    from llmbatch.errors import JobError
    from llmbatch.jobs import run as run_module
    from llmbatch.jobs.spec import load_job
    from llmbatch.jobs.store import JobDir

    (tmp_path / "in.csv").write_text(CSV["in.csv"])
    spec = load_job(data={"input": {"path": str(tmp_path / "in.csv")}, "model": {"source": SMOL},
                          "prompt": {"user": "Say {a}"}, "output": {"path": str(tmp_path / "out" / "x.parquet")}})
    job = JobDir(spec.resolved_job_dir())
    # this run looked before the other one made the folder
    monkeypatch.setattr(run_module, "first_missing", lambda root: tmp_path / "out")
    with job.locked():  # the other driver: its job.json written, its input not read yet
        run_module.open_job(run_module.job_for(spec))
        with pytest.raises(JobError, match="another process"):
            run_module.run_job(spec, quiet=True)
        assert job.meta_path.exists()
    assert job.meta_path.exists() and not job.meta().ingested
