"""The job file: what to read, which model, what to ask per row, where to write.

```yaml
input:  {path: customers.csv, id_column: Index, limit: 1000}
model:  {source: smollm2-135m-instruct, engine_kwargs: {max_model_len: 512}, concurrency: 1}
prompt: {system: "...", user: "What industry is {Company} in?", choices: [Retail, Finance, Other]}
sampling_params: {temperature: 0, max_tokens: 8}
output: {path: out.parquet, columns: [Index, Company, generated_text]}
```

Every field is validated when the file is loaded; ``--set a.b=value`` overrides any field.
Relative paths are taken from the job file's folder.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import string
import sys
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from llmbatch.builders import builder_for
from llmbatch.config import (
    BaseConfig,
    EndpointProcessorConfig,
    HttpRequestProcessorConfig,
    ProcessorConfig,
    ServeDeploymentProcessorConfig,
    SGLangEngineProcessorConfig,
    vLLMEngineProcessorConfig,
)
from llmbatch.errors import ConfigError, suggestion
from llmbatch.jobs.document import (
    apply_openai_defaults,
    apply_overrides,
    check_required,
    expand_environment,
    fill_defaults,
    merge,
    public_media,
    resolve_paths,
)
from llmbatch.openai.batch_file import FORMAT as OPENAI_BATCH
from llmbatch.redact import redact
from llmbatch.rows import SAMPLING_PARAM_NAMES

PROCESSOR_CONFIGS: dict[str, type[ProcessorConfig]] = {
    "vLLMEngineProcessorConfig": vLLMEngineProcessorConfig,
    "vllm": vLLMEngineProcessorConfig,
    "SGLangEngineProcessorConfig": SGLangEngineProcessorConfig,
    "sglang": SGLangEngineProcessorConfig,
    "HttpRequestProcessorConfig": HttpRequestProcessorConfig,
    "http": HttpRequestProcessorConfig,
    "ServeDeploymentProcessorConfig": ServeDeploymentProcessorConfig,
    "serve": ServeDeploymentProcessorConfig,
}


class InputSpec(BaseConfig):
    """Where the rows come from."""

    path: str = Field(..., description="Local path, http(s):// URL, or s3:// / gs:// (with the s3/gcs extra).")
    format: Optional[Literal["csv", "jsonl", "json", "parquet", "hf", "images", "openai-batch"]] = Field(None, description="Input format; inferred from the path when omitted. 'hf' is a Hugging Face dataset saved with save_to_disk; 'images' a folder of image files (one row per file: path, name; use prompt.image_column: path); 'openai-batch' an OpenAI Batch API file (one request per line: custom_id, method, url, body), which needs no prompt.")
    limit: Optional[int] = Field(None, ge=1, description="Read only the first N rows.")
    columns: Optional[list[str]] = Field(None, description="Read only these columns.")
    id_column: Optional[str] = Field(None, description="Column with a unique id per row. Without it, the row's position in the input is its id.")
    invalid_lines: Literal["fail", "error"] = Field("fail", description="openai-batch: 'fail' lists every invalid line (duplicate custom_id, bad method or url, a body the endpoint does not accept, another model) with its number and runs nothing; 'error' writes them to the error file, as OpenAI does, and answers the rest.")
    endpoint: Optional[str] = Field(None, description="openai-batch: every line's url must be this endpoint (as an OpenAI batch's endpoint).")
    column_types: Optional[dict[str, Literal["string", "int64", "float64", "bool", "date32"]]] = Field(None, description="CSV only: the output type of these columns, e.g. {Zip: string} to keep leading zeros. Others are inferred as Arrow's CSV reader does (int64, float64, bool, date32, else string); prompts always show the cell text as written.")


class ModelSpec(BaseConfig):
    """The model and engine: any processor config field may be given here."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    source: str = Field(..., description="model_source: an offline alias, folder, hub id, s3:// folder or .gguf file. For an endpoint (processor: http or serve): the model name sent with each request.")
    served_model_name: Optional[Union[str, list[str]]] = Field(None, description="openai-batch: the names a request's model may use besides the source (as vLLM's --served-model-name); the first is the name answers carry.")
    processor: str = Field("vLLMEngineProcessorConfig", description="Which processor config: vLLMEngineProcessorConfig (default, 'vllm'), SGLangEngineProcessorConfig ('sglang'), HttpRequestProcessorConfig ('http': an OpenAI-compatible endpoint, with url, api_key_env...) or ServeDeploymentProcessorConfig ('serve': a Ray Serve deployment).")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model_source" in data:
            data = dict(data)
            data.setdefault("source", data.pop("model_source"))
        return data

    @field_validator("processor")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in PROCESSOR_CONFIGS:
            raise ValueError(f"unknown processor {value!r}; use one of {', '.join(PROCESSOR_CONFIGS)}")
        return value

    def processor_fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class PromptSpec(BaseConfig):
    """What to ask per row: templates over the row's fields (Python ``{Column}`` syntax)."""

    system: Optional[str] = Field(None, description="System message template.")
    user: Optional[str] = Field(None, description="User message template, e.g. 'What industry is {Company} in?'. Use {{ and }} for literal braces. Taken as written: '${price}' is a '$' and the field {price}, never an environment variable.")
    messages_column: Optional[str] = Field(None, description="A column that already holds OpenAI chat messages.")
    prompt_column: Optional[str] = Field(None, description="A column holding raw prompt text (skips the chat template).")
    text_column: Optional[str] = Field(None, description="Pooling tasks (embed, classify): the column whose text is embedded or classified, as is.")
    image_column: Optional[str] = Field(None, description="A column holding an image per row (bytes, a path, a URL, or a {bytes, path} struct): it goes into the user message before the prompt.user text, and the multimodal stage is turned on.")
    audio_column: Optional[str] = Field(None, description="A column holding an audio clip per row (encoded bytes such as WAV, a path, a URL, a {bytes, path} struct, or a decoded {array, sampling_rate} one): it goes into the user message before the prompt.user text (after the image, if both), and the multimodal stage is turned on.")
    pair_columns: Optional[list[str]] = Field(None, min_length=2, max_length=2, description="task score: the two columns whose texts are scored against each other, e.g. [query, passage].")
    choices: Optional[list[str]] = Field(None, description="Constrain the answer to one of these strings.")
    json_schema: Optional[Any] = Field(None, description="Constrain the answer to JSON matching this schema.")
    regex: Optional[str] = Field(None, description="Constrain the answer to this regular expression.")

    @model_validator(mode="after")
    def _one_source(self) -> "PromptSpec":
        sources = [self.user is not None, self.messages_column is not None, self.prompt_column is not None,
                   self.text_column is not None, self.pair_columns is not None]
        if sum(sources) != 1:
            raise ValueError("give exactly one of prompt.user, prompt.messages_column, prompt.prompt_column, "
                             "prompt.text_column or prompt.pair_columns")
        constraints = [self.choices is not None, self.json_schema is not None, self.regex is not None]
        if sum(constraints) > 1:
            raise ValueError("give at most one of prompt.choices, prompt.json_schema or prompt.regex")
        for column, what in ((self.image_column, "image"), (self.audio_column, "audio")):
            if column is not None and self.user is None:
                raise ValueError(f"prompt.{what}_column needs a prompt.user text to ask about the {what}")
        for name in ("system", "user"):
            template = getattr(self, name)
            if template is not None:
                try:
                    template_fields(template)
                except ValueError as exc:
                    raise ValueError(f"prompt.{name} is not a valid template: {exc}") from exc
        return self

    def check_task(self, task: str) -> None:
        """Fail (ConfigError) where the prompt's source does not suit the job's ``task``."""
        if task == "generate":
            if self.text_column is not None or self.pair_columns is not None:
                raise ConfigError("prompt.text_column and prompt.pair_columns are for the pooling tasks (task: embed, "
                                  "classify or score); to generate from a column's text use prompt.prompt_column")
            return
        if self.system or self.messages_column or self.choices or self.json_schema or self.regex:
            raise ConfigError(f"task {task!r} takes a text (prompt.text_column, prompt.prompt_column or a prompt.user "
                              "template) or a pair (prompt.pair_columns), not chat messages or answer constraints")
        if (task == "score") != (self.pair_columns is not None) and not self.user and not self.prompt_column:
            raise ConfigError("task 'score' takes prompt.pair_columns: [first, second]; the other tasks take one text")

    def fields(self, columns: list[str] | None = None) -> list[str]:
        """Input columns the prompt reads (of ``columns``, the input's, where a template names a
        column with a dot or bracket in its name)."""
        names: list[str] = []
        for template in (self.system, self.user):
            if template:
                names.extend(template_fields(template, columns))
        names.extend(c for c in (self.messages_column, self.prompt_column, self.text_column, self.image_column,
                                 self.audio_column) if c)
        names.extend(self.pair_columns or [])
        return list(dict.fromkeys(names))


class OutputSpec(BaseConfig):
    """Where the answers go."""

    path: str = Field(..., description="Output file (local or fsspec URL).")
    format: Optional[Literal["parquet", "jsonl", "csv", "openai-batch"]] = Field(None, description="Output format; inferred from the path when omitted ('openai-batch' for an openai-batch input: OpenAI's output lines, and an error file).")
    errors_path: Optional[str] = Field(None, description="openai-batch output: the error file (default: beside the output, '<output>.errors.jsonl').")
    columns: Optional[list[str]] = Field(None, description="Keep only these columns (after rename). Default: input columns, then generated_text and the other engine columns.")
    rename: Optional[dict[str, str]] = Field(None, description="Rename output columns, e.g. {generated_text: industry}.")

    def resolved_format(self) -> str:
        if self.format:
            return self.format  # openai-batch: set from the input format (JobSpec._request_source)
        lower = self.path.lower()
        for fmt, suffixes in (("parquet", (".parquet", ".pq")), ("jsonl", (".jsonl", ".ndjson", ".json")), ("csv", (".csv",))):
            if lower.endswith(suffixes):
                return fmt
        raise ConfigError(f"cannot tell the output format of {self.path!r}; set output.format to parquet, jsonl or csv")


class JobSpec(BaseConfig):
    """A whole job."""

    input: InputSpec
    model: ModelSpec
    prompt: Optional[PromptSpec] = Field(None, description="Templates over row fields; or use preprocess.")
    preprocess: Optional[str] = Field(None, description="'module:function' that turns a row into the request (messages/prompt, sampling_params).")
    postprocess: Optional[str] = Field(None, description="'module:function' that turns an answered row into the output row.")
    task: Optional[Literal["generate", "embed", "classify", "score"]] = Field(None, description="What the model does: generate text (default), embed texts, classify them, or score pairs (the processor's task_type).")
    sampling_params: dict[str, Any] = Field(default_factory=dict, description="vLLM sampling params for every row (temperature, max_tokens, ...).")
    pooling_params: dict[str, Any] = Field(default_factory=dict, description="Pooling tasks: params for every row (dimensions, normalize / use_activation, truncate_prompt_tokens).")
    output: OutputSpec
    job_dir: Optional[str] = Field(None, description="Job directory (default: next to the output, '<output>.job').")
    python_path: list[str] = Field(default_factory=list, description="Folders to import preprocess/postprocess modules from (the job file's folder is added).")
    continue_on_error: bool = Field(True, description="Turn failing rows into error rows (errors.jsonl) and answer the rest. Off: the first bad row stops the job.")
    commit_rows: int = Field(1000, ge=1, description="Rows per committed output part (at most).")
    commit_seconds: float = Field(10.0, gt=0, description="Commit what has been answered at least this often.")

    #: the job as written (``${VAR}`` references unexpanded): what job.json keeps
    _raw: Optional[dict[str, Any]] = PrivateAttr(None)

    @field_validator("sampling_params")
    @classmethod
    def _known_sampling_params(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key not in SAMPLING_PARAM_NAMES:
                raise ValueError(f"unknown sampling param '{key}'{suggestion(key, sorted(SAMPLING_PARAM_NAMES), clause=True)}")
        checks = {
            "temperature": lambda v: v >= 0,
            "max_tokens": lambda v: v >= 1,
            "top_p": lambda v: 0 < v <= 1,
            "n": lambda v: v >= 1,
        }
        for key, ok in checks.items():
            if key in value and value[key] is not None:
                try:
                    good = ok(value[key])
                except TypeError:
                    good = False
                if not good:
                    raise ValueError(f"sampling_params.{key}={value[key]!r} is out of range")
        return value

    def resolved_task(self) -> str:
        """The task the job runs (``task``, else the model section's ``task_type``)."""
        return self.task or self.model.processor_fields().get("task_type") or "generate"

    @model_validator(mode="after")
    def _request_source(self) -> "JobSpec":
        batch = self.input.format == OPENAI_BATCH
        if self.prompt is None and self.preprocess is None and not batch:
            raise ValueError("give a prompt (prompt.user / messages_column / prompt_column) or a preprocess function")
        if self.prompt is not None and self.preprocess is not None:
            raise ValueError("give either prompt or preprocess, not both")
        for name in ("preprocess", "postprocess"):
            value = getattr(self, name)
            if value is not None and ":" not in value:
                raise ValueError(f"{name} must look like 'module:function', got {value!r}")
        if not batch and self.output.format == OPENAI_BATCH:
            raise ValueError("output.format openai-batch needs input.format openai-batch")
        if batch and (self.prompt is not None or self.preprocess is not None or self.postprocess is not None):
            raise ValueError("an openai-batch input carries its own requests: leave out prompt, preprocess and postprocess")
        if batch and (self.input.id_column or self.input.columns):
            raise ValueError("an openai-batch input has no id_column or columns: custom_id identifies each request")
        if batch and self.output.format is None:
            self.output.format = OPENAI_BATCH
        return self

    def resolved_job_dir(self) -> str:
        return self.job_dir or (self.output.path.rstrip("/") + ".job")

    def processor_config(self) -> ProcessorConfig:
        """The processor config named by the model section (validated now)."""
        cls = PROCESSOR_CONFIGS[self.model.processor]
        fields = self.model.processor_fields()
        fields["should_continue_on_error"] = self.continue_on_error
        if issubclass(cls, EndpointProcessorConfig) and self.task not in (None, "generate"):
            raise ConfigError(f"task: {self.task!r} runs on the in-process engine only; an endpoint "
                              f"(processor: {self.model.processor}) generates text: drop task or the endpoint")
        if self.task is not None and not issubclass(cls, EndpointProcessorConfig):
            if fields.get("task_type", self.task) != self.task:
                raise ConfigError(f"task: {self.task!r} and model.task_type: {fields['task_type']!r} disagree; keep one")
            fields["task_type"] = self.task
        if issubclass(cls, EndpointProcessorConfig):
            fields.setdefault("model", self.model.source)  # the model name the endpoint serves
        else:
            fields["model_source"] = self.model.source
        if self.prompt is not None and (self.prompt.image_column or self.prompt.audio_column) is not None:
            mm = fields.get("prepare_multimodal_stage")
            fields["prepare_multimodal_stage"] = {**mm, "enabled": True} if isinstance(mm, dict) else True
        if self.input.format == OPENAI_BATCH:  # rows of API clients (llmbatch serve)
            fields["prepare_multimodal_stage"] = public_media(fields.get("prepare_multimodal_stage"))
        try:
            return cls(**fields)
        except ConfigError as exc:
            raise ConfigError(f"model: {exc}") from None


def template_fields(template: str, columns: list[str] | None = None) -> list[str]:
    """The row fields a ``{Field}`` template reads (raises ValueError on bad syntax): for
    ``{meta.title}`` or ``{meta[title]}``, ``meta``, unless ``columns`` has one named so whole."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        if field == "" or field.isdigit():
            raise ValueError("positional fields like {} or {0} are not allowed; name a column, e.g. {Company}")
        names.append(field if columns is not None and field in columns else field.split(".", 1)[0].split("[", 1)[0])
    return names


def load_function(ref: str, python_path: list[str] | None = None):
    """Import ``module:function``; the module may be a file next to the job (it travels
    to the workers by value, so it need not be installed there). The job's folders are on
    ``sys.path`` only while the module is imported."""
    added = [folder for folder in python_path or [] if folder not in sys.path]
    sys.path[:0] = added
    module_name, _, func_name = ref.partition(":")
    _forget_other_jobs_module(module_name, python_path or [])
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import module {module_name!r} for {ref!r}: {exc}") from exc
    finally:
        for folder in added:
            if folder in sys.path:
                sys.path.remove(folder)
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(f"{ref!r}: module {module_name!r} has no function {func_name!r}")
    return fn


def _forget_other_jobs_module(module_name: str, folders: list[str]) -> None:
    """Where this process imported a module of that name from elsewhere (another job's
    ``hooks.py`` run earlier in a notebook or server), this job's own file is imported instead
    of reusing it; the other job's functions keep their own module."""
    top = module_name.split(".")[0]
    cached = sys.modules.get(top)
    origin = getattr(cached, "__file__", None)
    if cached is None or not origin:
        return
    for folder in folders:
        for candidate in (Path(folder) / f"{top}.py", Path(folder) / top / "__init__.py"):
            if candidate.exists() and candidate.resolve() != Path(origin).resolve():
                for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                    del sys.modules[name]
                importlib.invalidate_caches()
                return


def load_job(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
             data: dict[str, Any] | None = None) -> JobSpec:
    """Read a job file (and/or a dict), apply overrides, validate."""
    base = Path.cwd()
    doc: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"job file {str(p)!r} does not exist")
        try:
            doc = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"job file {str(p)!r} is not valid YAML: {exc}") from exc
        except (UnicodeDecodeError, IsADirectoryError) as exc:
            raise ConfigError(f"job file {str(p)!r} is not a YAML job file ({type(exc).__name__}); give a job "
                              f"file (examples/industry.yaml), a data file as --input {str(p)}, or, to resume, the "
                              "job directory") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"job file {str(p)!r} must be a mapping of sections (input, model, prompt, output); "
                              f"to run over a data file, give it as --input {str(p)}")
        base = p.resolve().parent
    if data:
        doc = merge(doc, data)
    doc = apply_overrides(doc, overrides or [])
    doc = fill_defaults(apply_openai_defaults(resolve_paths(doc, base, job_file_folder=path is not None)))
    check_required(doc)
    raw = copy.deepcopy(doc)
    spec = JobSpec(**expand_environment(doc))
    spec._raw = raw
    builder_for(spec.processor_config())  # model section mistakes and unsupported processors fail now
    return spec


def redacted_spec(spec: JobSpec) -> dict[str, Any]:
    """The job as job.json keeps it: ``${VAR}`` references kept, literal secrets redacted."""
    data = spec._raw if spec._raw is not None else json.loads(spec.model_dump_json())
    return redact(json.loads(json.dumps(data, default=str)))


