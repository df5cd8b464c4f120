"""The row contract: names of the columns stages read and write, and error rows.

Preprocess returns (names exactly as Ray's ``ray.data.llm``):

- ``messages``: OpenAI chat messages, or ``prompt``: text that skips the chat template
- ``sampling_params``: vLLM ``SamplingParams`` fields for this row (generate)
- ``pooling_params``: vLLM ``PoolingParams`` fields for this row (embed/classify/score)
- ``model``: a LoRA adapter name/path for this row
- ``chat_template_kwargs``: extra variables for this row's chat template

The engine adds :data:`ENGINE_OUTPUT_COLUMNS`; ``__inference_error__`` is ``""`` on success and
``"<stage>: <ErrorType>: <message>"`` on a failed row, which then skips the later stages and
the user's postprocess.
"""

from __future__ import annotations

import array
import math
from dataclasses import dataclass
from typing import Any

from llmbatch.errors import RowValidationError

Row = dict[str, Any]

ERROR_COLUMN = "__inference_error__"

_POOLING = ("embed", "classify", "score")
_EVERY = ("generate", *_POOLING, "endpoint")


@dataclass(frozen=True)
class OutputColumn:
    """One engine output column, declared once (:data:`OUTPUT_COLUMNS`): the task lists, the
    Arrow types (:data:`llmbatch.codec.OUTPUT_TYPES`) and an error row's values
    (:func:`llmbatch.codec.empty_engine_output`) all come from it."""

    name: str
    #: the tasks that write it on every row ("endpoint": HTTP and Ray Serve rows that carried
    #: their own request)
    tasks: tuple[str, ...]
    #: its Arrow type ("" where none is fixed: an endpoint's response as it came)
    arrow: str
    #: its value on a row that got no answer
    empty: Any = None
    #: a vector per row (stored as a fixed-size list where a block's rows agree on its length)
    vector: bool = False


#: The engine's output columns, in the order each task writes them. Classify adds ``probs``
#: and ``label``, which Ray lacks; score adds the float ``score``. An endpoint row that carried
#: its own request (``payload`` / ``request_kwargs``, Ray's contract) gets the response as it
#: came (``http_response``; a Serve deployment's response fields are merged into the row
#: instead, as in Ray) and the token usage it reported; endpoint rows with
#: ``messages``/``prompt`` get the generate columns as well.
OUTPUT_COLUMNS = (
    OutputColumn("embeddings", _POOLING, "list<float32>", vector=True),
    OutputColumn("http_response", ("endpoint",), ""),
    OutputColumn("generated_text", ("generate",), "string", ""),
    OutputColumn("generated_tokens", ("generate",), "list<int64>", ()),
    OutputColumn("num_input_tokens", _EVERY, "int64", 0),
    OutputColumn("num_generated_tokens", ("generate", "endpoint"), "int64", 0),
    OutputColumn("prompt", ("generate", *_POOLING), "string", ""),
    OutputColumn("finish_reason", ("generate",), "string", "error"),
    OutputColumn("time_taken_llm", _EVERY, "float64", 0.0),
    OutputColumn("request_id", _EVERY, "int64", -1),
    OutputColumn("batch_uuid", _EVERY, "string", ""),
    OutputColumn("probs", ("classify",), "list<float32>", vector=True),
    OutputColumn("label", ("classify",), "string"),
    OutputColumn("score", ("score",), "float64"),
)


def columns_of(task: str) -> tuple[str, ...]:
    """The columns ``task`` writes on every row, in order."""
    return tuple(c.name for c in OUTPUT_COLUMNS if task in c.tasks)


#: Columns the engine stage writes on every generate row.
GENERATE_OUTPUT_COLUMNS = columns_of("generate")
#: Columns the engine stage writes on every embed row.
POOLING_OUTPUT_COLUMNS = columns_of("embed")
#: Columns an endpoint engine writes on a row that carried its own request.
HTTP_OUTPUT_COLUMNS = columns_of("endpoint")
#: Columns each task writes on every row.
TASK_OUTPUT_COLUMNS = {task: columns_of(task) for task in ("generate", *_POOLING)}
ENGINE_OUTPUT_COLUMNS = tuple(c.name for c in OUTPUT_COLUMNS)
#: Keys a scoring row may hold its pair in (Ray's ``text_1``/``text_2``, or ``query``/``document``).
PAIR_KEYS = (("text_1", "text_2"), ("query", "document"))


def text_pair(row: Row) -> tuple[str, str] | None:
    """A scoring row's two texts, or None when the row has no pair."""
    for first, second in PAIR_KEYS:
        if row.get(first) is not None or row.get(second) is not None:
            a, b = row.get(first), row.get(second)
            if not isinstance(a, str) or not isinstance(b, str) or not a.strip() or not b.strip():
                raise RowValidationError(f"a scoring pair needs two non-empty texts in {first!r} and {second!r}, "
                                         f"got {a!r} and {b!r}")
            return a, b
    return None

#: Request fields that preprocess produces and the stages consume; they are not part of the
#: output row (as in Ray, where the engine stage pops them).
REQUEST_COLUMNS = (
    "sampling_params",
    "pooling_params",
    "tokenized_prompt",
    "tokenized_prompt_2",
    "token_type_ids",
    "chat_template_kwargs",
    "multimodal_data",
    "mm_processor_kwargs",
    "multimodal_uuids",
    "tokenization_kwargs",
    "payload",
    "request_kwargs",
    "method",
    "dtype",
)

#: vLLM ``SamplingParams`` fields (vLLM 0.26-0.32) plus older names still accepted by some
#: versions; job files are checked against it when loaded (the engine checks each row again).
SAMPLING_PARAM_NAMES = frozenset("""
n presence_penalty frequency_penalty repetition_penalty temperature watermarking top_p top_k min_p seed
stop stop_token_ids ignore_eos max_tokens min_tokens logprobs prompt_logprobs prompt_logprob_token_ids
prompt_logprob_start logprob_token_ids flat_logprobs detokenize skip_special_tokens
spaces_between_special_tokens include_stop_str_in_output stream_interval output_text_buffer_length
structured_outputs logit_bias allowed_token_ids extra_args bad_words skip_reading_prefix_cache
thinking_token_budget repetition_detection truncate_prompt_tokens guided_decoding
""".split())

#: vLLM's max_tokens when a row does not say.
DEFAULT_MAX_TOKENS = 16

#: Private bookkeeping keys carried between stages; never shown to users.
PRIVATE_PREFIX = "__llmbatch_"
ROW_ID = "__llmbatch_id"              # the job's row id (or None outside jobs)
ADD_SPECIAL_TOKENS = "__llmbatch_add_special_tokens"
STATS = "__llmbatch_stats"            # per-row engine facts the job layer aggregates
#: A job row's request digest and, on the row whose request reached the engine, its answer (JSON
#: text): committed with the row, so a resumed job copies answers it already has
#: (:mod:`llmbatch.stages.answers`).
ANSWER = "__llmbatch_answer"
#: OpenAI request details the engine honours for this row: every one of ``n`` answers with its
#: stop reason and logprobs (the ``completions`` column), ``max_tokens_auto`` (generate up to
#: the context length, as OpenAI's chat endpoint does when max_tokens is not given)
OPENAI = "__llmbatch_openai"
#: Set by the multimodal stage: ``messages`` is vLLM's parsed conversation (placeholders in
#: place), for the chat template stage to render with vLLM's own template call.
MM_PARSED = "__llmbatch_mm_parsed"
#: A digest of the row's media (images' pixels or their uuids): part of the dedup key.
MEDIA_DIGEST = "__llmbatch_media_digest"


def is_error(row: Row) -> bool:
    """Whether ``row`` is an error row."""
    return bool(row.get(ERROR_COLUMN))


def error_text(stage: str, exc: BaseException) -> str:
    """The ``__inference_error__`` text for ``exc`` raised in ``stage``."""
    message = str(exc).strip() or repr(exc)
    return f"{stage}: {type(exc).__name__}: {message}"


def parse_error(text: str) -> tuple[str, str, str]:
    """Split an ``__inference_error__`` text into (stage, error type, message)."""
    parts = text.split(": ", 2)
    while len(parts) < 3:
        parts.insert(0, "")
    return parts[0], parts[1], parts[2]


def describe_row(row: Row, limit: int = 120) -> str:
    """A short way to name a row in an error message: its job id, else its first values."""
    if row.get(ROW_ID) is not None:
        return str(row[ROW_ID])
    shown = {k: v for k, v in row.items() if not k.startswith("__")}
    text = repr(dict(list(shown.items())[:4]))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_missing(value: Any) -> bool:
    """None or NaN (how missing cells arrive from CSV/Parquet/pandas)."""
    if value is None:
        return True
    try:
        return isinstance(value, float) and math.isnan(value)
    except TypeError:
        return False


def int_list(value: Any) -> list[int]:
    """Token ids as a list of Python ints, from a list or a numpy array (as Ray Data hands
    list columns over): one C-level conversion for an array, no walk per element."""
    tolist = getattr(value, "tolist", None)
    if tolist is not None and type(value).__module__ == "numpy" and getattr(value, "ndim", 0) == 1 \
            and value.dtype.kind in "iu":
        return tolist()
    if isinstance(value, (list, tuple)):
        try:  # one C-level pass (Python or numpy ints alike); a bool or a float is refused
            return array.array("q", value).tolist()
        except TypeError:
            return [int(t) for t in value]
    return [int(t) for t in to_python(value)]


def to_python(value: Any) -> Any:
    """Turn numpy arrays/scalars (as Ray Data hands lists over) back into plain Python."""
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    tolist = getattr(value, "tolist", None)
    if tolist is not None and type(value).__module__ == "numpy":
        return to_python(tolist())
    return value


ROLES = ("system", "user", "assistant", "tool", "developer", "function")
TEXT_PART_TYPES = ("text", "input_text")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the shape of OpenAI-style ``messages`` and flatten text-only part lists.

    Raises :class:`RowValidationError` naming the message and the problem.
    """
    if isinstance(messages, dict):
        raise RowValidationError("'messages' must be a list of {'role', 'content'} dicts, not one dict; wrap it in a list")
    if not isinstance(messages, (list, tuple)):
        raise RowValidationError(f"'messages' must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise RowValidationError("'messages' is empty; give at least one message")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RowValidationError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise RowValidationError(f"messages[{i}] has role {role!r}; use one of {', '.join(ROLES)}")
        if "content" not in msg:
            raise RowValidationError(f"messages[{i}] has no 'content'")
        content = msg["content"]
        if isinstance(content, (list, tuple)):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or "type" not in part:
                    raise RowValidationError(f"messages[{i}].content[{j}] must be a dict with a 'type'")
                parts.append(part)
            if all(p["type"] in TEXT_PART_TYPES for p in parts):
                content = "\n".join(str(p.get("text", "")) for p in parts)
            else:
                content = parts
        elif content is None:
            if role != "assistant":
                raise RowValidationError(f"messages[{i}] ({role}) has no content")
        elif not isinstance(content, str):
            raise RowValidationError(f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}")
        out.append({**msg, "content": content})
    return out
