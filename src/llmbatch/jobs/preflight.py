"""What a job checks before it creates anything or starts any engine: that its prompt suits its
task (a text column to embed, a pair to score, chat templates to generate), that its input can be read
and has rows, that its output, error file and job directory can be written (a probe file created
and removed), and that its model can be found on this machine (resolved in the driver, before
Ray starts).

Every failure is a :class:`~llmbatch.errors.ConfigError` that names the flag and the job file's
field and says what to do; nothing is left behind. Mistakes only the whole input can show (a
template field no row has, duplicate ids) are found when the input is read, and a job that fails
there leaves nothing behind either (:func:`discard_unstarted`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from llmbatch.config import EndpointProcessorConfig
from llmbatch.errors import ConfigError, JobError, ModelNotFoundError
from llmbatch.io.readers import infer_format, open_input
from llmbatch.jobs.job import Job
from llmbatch.jobs.spec import JobSpec
from llmbatch.jobs.store import LOCK_NAME, JobDir
from llmbatch.model_names import alias_hint
from llmbatch.models import ALIASES, TEST_MODELS, check_model_source, resolve_model
from llmbatch.redact import reveal

#: Bytes read from the start of a text input to tell an empty one (a header and nothing else).
SNIFF_BYTES = 1 << 16
INPUT = "--input (input.path)"
MODEL = "--model (model.source)"


def check_job(job: Job, *, force: bool = False) -> None:
    """Every check a run makes before it touches anything (see the module docstring)."""
    spec = job.spec
    if spec.prompt is not None:  # (its preprocess is built on Ray, where it says so again)
        spec.prompt.check_task(job.task)
    if force or not _ingested(job.dir):
        check_input(spec, job.kind.input_flag)
    (output, output_flag), *others = job.kind.outputs(job)
    check_writable(output, output_flag)
    try:
        spec.output.resolved_format()
    except ConfigError as exc:
        raise ConfigError(f"--output (output.path): {exc} (on the command line: --set output.format=parquet)") from None
    for path, flag in others:
        check_writable(path, flag)
    flag = "--job-dir (job_dir)" if spec.job_dir else "--job-dir (job_dir; default: <output>.job)"
    check_writable(str(job.dir.root), flag, folder=True)
    check_model(spec)


def _ingested(job: JobDir) -> bool:
    try:
        return job.exists() and job.meta().ingested
    except JobError:
        return False


# ---------------------------------------------------------------------------- the input


def check_input(spec: JobSpec, flag: str = INPUT) -> None:
    """The input exists, can be read, and has rows (as far as its first bytes tell); ``flag``
    names it in messages."""
    path = spec.input.path
    if "://" in path:
        return  # a URL or object store: read when the job stages it
    if not os.path.exists(path):
        raise ConfigError(f"{flag}: {path} does not exist; give an existing file or folder (a job file's "
                          "relative paths are taken from its folder)")
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(f"{flag}: the folder {path} cannot be read (permission denied)")
    else:
        try:
            with open(path, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            raise ConfigError(f"{flag}: {path} cannot be read ({exc.strerror or exc}); check its "
                              "permissions") from None
    try:
        fmt = spec.input.format or infer_format(path)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc} (on the command line: --set input.format=csv, or --openai-batch FILE "
                          "for an OpenAI batch file)") from None
    if os.path.isdir(path):
        return  # a dataset folder: the reader says what it lacks
    if os.path.getsize(path) == 0:
        raise ConfigError(f"{flag}: the input has no rows: {path} is empty")
    if fmt == "parquet":
        _check_parquet_rows(path, flag)
    elif fmt in ("csv", "jsonl", "json", "openai-batch"):
        _check_text_rows(path, fmt, flag)


def _check_parquet_rows(path: str, flag: str) -> None:
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:  # noqa: BLE001 - not a parquet file: said as such
        raise ConfigError(f"{flag}: {path} is not a readable parquet file ({exc})") from None
    if rows == 0:
        raise ConfigError(f"{flag}: the input has no rows: {path} is a parquet file with no rows")


def _check_text_rows(path: str, fmt: str, flag: str) -> None:
    with open_input(path) as fh:
        head = fh.read(SNIFF_BYTES + 1)
    if len(head) > SNIFF_BYTES:
        return  # that much text has rows, or the reader says what is wrong with it
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or (fmt == "json" and text.strip() == "[]"):
        raise ConfigError(f"{flag}: the input has no rows: {path} holds no data")
    if fmt == "csv" and len(lines) == 1:
        raise ConfigError(f"{flag}: the input has no rows: {path} has a header ({lines[0].strip()[:200]}) "
                          "and no rows below it")


# ---------------------------------------------------------------------------- outputs


def check_writable(path: str, flag: str, *, folder: bool = False) -> None:
    """``path`` (a file, or with ``folder`` a folder) can be created or replaced: its nearest
    existing folder takes a probe file, which is removed at once."""
    if "://" in path:
        return  # an object store: written when the job ends
    target = Path(path).expanduser().absolute()
    if not folder and target.is_dir():
        raise ConfigError(f"{flag}: {path} is a folder; give a file path, e.g. {target / 'out.parquet'}")
    if folder and target.exists() and not target.is_dir():
        raise ConfigError(f"{flag}: {path} is a file; give a folder for the job directory")
    existing = target if folder and target.is_dir() else target.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag}: cannot create {path}: {existing} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".llmbatch-probe-", dir=existing)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot write in {existing} ({exc.strerror or exc}); choose a folder "
                          "you can write to") from None
    os.close(fd)
    os.unlink(probe)


def first_missing(path: str | os.PathLike) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (what a run would create)."""
    path = Path(path).absolute()
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def discard_unstarted(job: JobDir, created: Path | None) -> bool:
    """Under the job's lock, after a run that created the job directory failed before its input
    was read: remove what it wrote there (all but the lock); True when it did."""
    if created is None or _ingested(job):
        return False
    job.reset()
    return True


def remove_created(job: JobDir, created: Path) -> None:
    """Once the lock is released: the lock file and the folders the run created, while they are
    empty and no driver took the lock meanwhile (that one keeps its files)."""
    if job.is_running():
        return
    (job.root / LOCK_NAME).unlink(missing_ok=True)
    folder = job.root
    while folder != created.parent:
        try:
            folder.rmdir()
        except OSError:  # not empty: someone else's now
            return
        folder = folder.parent


# ---------------------------------------------------------------------------- the model


def check_model(spec: JobSpec) -> None:
    """An in-process engine's model can be found here: an offline alias (prepared now, once), a
    test model that is built, a local folder or file, or a hub id the hub (or, offline, the local
    hub cache) has. Nothing but
    a hub model's config.json is downloaded; an object-store folder is copied when the engine
    starts."""
    config = spec.processor_config()
    if isinstance(config, EndpointProcessorConfig):
        return  # the endpoint serves its own model
    source = config.model_source
    try:
        check_model_source(source)
        if source in ALIASES or source in TEST_MODELS:
            resolve_model(source)  # an alias prepared (once), a test model found built
        elif not os.path.exists(os.path.expanduser(source)) and "://" not in source:
            env = (config.runtime_env or {}).get("env_vars") or {}  # the replicas' token, where the job gives one
            _check_hub_model(source, reveal(env.get("HF_TOKEN")) or None)
    except ModelNotFoundError as exc:
        raise ConfigError(f"{MODEL}: {exc} See `llmbatch models list`.") from None


def _check_hub_model(repo_id: str, token: str | None) -> None:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, allow_patterns=["config.json"], token=token)
    except Exception as exc:  # noqa: BLE001 - offline, no such repo, gated: all say the same
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        where = ("HF_HUB_OFFLINE is set and the local hub cache does not have it" if offline
                 else f"the Hugging Face hub did not give it ({type(exc).__name__}: {_first_line(exc)})")
        raise ModelNotFoundError(
            f"cannot find model '{repo_id}': it is not an offline alias ({', '.join(ALIASES)}) or a test model, not a local "
            f"folder or file, and {where}. Give an alias, a model folder (./path), or a hub id this machine "
            f"can reach.{alias_hint(repo_id)}") from None


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:200]
