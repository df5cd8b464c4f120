"""The pooling tasks' requests and answers: embed, classify and score.

- **embed**: the pooled vector in ``embeddings`` (normalized unless the row asks otherwise).
- **classify**: the logits in ``embeddings`` (as Ray), and, which Ray lacks, ``probs`` (softmax;
  sigmoid for one label) and ``label`` (from the model's ``id2label``).
- **score**: a float ``score`` for a pair of texts. With a ``*ForSequenceClassification``
  model (a cross-encoder), the pair is one input (token type ids say which text is which) and
  the score is its activated output; with an embedding model (a bi-encoder), each text is
  embedded and the score is their cosine. ``embeddings`` holds the raw output, as Ray's.

Row ``pooling_params`` take vLLM's names (``dimensions``, ``use_activation``) and the older
ones users write (``normalize`` for embed, ``softmax``/``activation`` for classify).
"""

from __future__ import annotations

import math
from typing import Any

from llmbatch.errors import RowValidationError, suggestion
from llmbatch.rows import to_python

#: Pooling params a row may set, per task, and the older names they may go by.
USER_PARAMS = {"embed": ("dimensions", "use_activation"), "classify": ("use_activation",),
               "score": ("use_activation",)}
ALIASES = {"normalize": "use_activation", "softmax": "use_activation", "activation": "use_activation"}


def pooling_params(raw: Any, task: str, cross_encoder: bool = False):
    """(vLLM ``PoolingParams``, canonical dict) for a row's ``pooling_params``.

    Classification asks the engine for logits (probs are computed here); a cross-encoder score
    and embeddings use the model's activation unless the row says otherwise."""
    from vllm import PoolingParams

    raw = to_python(raw or {})
    if not isinstance(raw, dict):
        raise RowValidationError(f"pooling_params must be a dict, got {type(raw).__name__}")
    params: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "truncate_prompt_tokens":
            continue  # applied by the tokenize stage
        name = ALIASES.get(key, key)
        allowed = USER_PARAMS[task]
        if name not in allowed:
            raise RowValidationError(f"pooling param '{key}' is not one that task {task!r} takes"
                                     f"{suggestion(key, list(allowed) + list(ALIASES))}; it takes {', '.join(allowed)}")
        if name == "use_activation" and not isinstance(value, bool):
            raise RowValidationError(f"pooling param '{key}' must be true or false, got {value!r}")
        if name == "dimensions" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RowValidationError(f"pooling param 'dimensions' must be a positive integer, got {value!r}")
        params[name] = value
    if task == "classify":
        params.setdefault("use_activation", False)  # logits; probs are made here
    engine_task = "classify" if task == "classify" or (task == "score" and cross_encoder) else "embed"
    try:
        return PoolingParams(task=engine_task, **params), params
    except Exception as exc:  # noqa: BLE001 - vLLM's message names the field
        raise RowValidationError(f"invalid pooling_params: {exc}") from exc


def as_floats(data: Any) -> list[float]:
    """An engine's pooled output (a tensor or a list) as a list of floats."""
    if hasattr(data, "float"):
        data = data.float().cpu().tolist()
    return [float(x) for x in data]


def classification(logits: list[float], labels: dict[int, str], activated: bool) -> dict[str, Any]:
    """``probs`` and ``label`` for one row's classifier output."""
    if activated:
        probs = list(logits)
    elif len(logits) == 1:
        probs = [1.0 / (1.0 + math.exp(-logits[0]))]
    else:
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        probs = [e / total for e in exps]
    best = max(range(len(probs)), key=probs.__getitem__) if len(probs) > 1 else 0
    return {"probs": probs, "label": labels.get(best, f"LABEL_{best}")}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
