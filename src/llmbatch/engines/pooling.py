"""The pooling tasks' requests and answers: embed, classify and score.

- **embed**: the pooled vector in ``embeddings`` (normalized unless the row asks otherwise).
- **classify**: the logits in ``embeddings`` (as Ray), and, which Ray lacks, ``probs`` (softmax;
  sigmoid for one label) and ``label`` (from the model's ``id2label``).
- **score**: a float ``score`` for a pair of texts. With a ``*ForSequenceClassification``
  model (a cross-encoder), the pair is one input (token type ids say which text is which) and
  the score is its activated output; with an embedding model (a bi-encoder), each text is
  embedded and the score is their cosine. ``embeddings`` holds the raw output, as Ray's.

A pooled vector stays one float32 numpy array from the engine to the output (:func:`as_vector`):
postprocess sees a 1-D ``numpy.ndarray``, as Ray Data hands it over, and the output column is
built from the arrays in one call (a fixed-size float32 list: :mod:`llmbatch.codec`), with no
Python float per element (384 of them per MiniLM row: ``bench/RESULTS.md``, issue 29, ninth
session). Such an answer is not JSON, so a job does not record it for a resume
(:mod:`llmbatch.stages.answers`): recomputing a lost embedding costs less than encoding every one.

Row ``pooling_params`` take vLLM's names (``dimensions``, ``use_activation``) and the older
ones users write (``normalize`` for embed, ``softmax``/``activation`` for classify).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from llmbatch.errors import RowValidationError, suggestion
from llmbatch.rows import to_python

#: Pooling params a row may set, per task, and the older names they may go by.
USER_PARAMS = {"embed": ("dimensions", "use_activation"), "classify": ("use_activation",),
               "score": ("use_activation",)}
ALIASES = {"normalize": "use_activation", "softmax": "use_activation", "activation": "use_activation"}


_POOLING_PARAMS: Any = None


def _pooling_params_class() -> Any:
    """vLLM's ``PoolingParams``, imported once: ``from vllm import`` in the function went through
    vLLM's lazy module ``__getattr__`` and importlib for every row."""
    global _POOLING_PARAMS
    if _POOLING_PARAMS is None:
        from vllm import PoolingParams

        _POOLING_PARAMS = PoolingParams
    return _POOLING_PARAMS


def pooling_params(raw: Any, task: str, cross_encoder: bool = False):
    """(vLLM ``PoolingParams``, canonical dict) for a row's ``pooling_params``.

    Classification asks the engine for logits (probs are computed here); a cross-encoder score
    and embeddings use the model's activation unless the row says otherwise."""
    PoolingParams = _pooling_params_class()

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


def as_vector(data: Any) -> np.ndarray:
    """An engine's pooled output (a tensor on any device, in any float dtype, or a list) as a
    1-D float32 numpy array of its own: one copy in C, never a view into the engine's batch."""
    if hasattr(data, "float"):  # a torch tensor
        data = data.detach().float().cpu().numpy()
    return np.array(data, dtype=np.float32).reshape(-1)


def classification(logits: Any, labels: dict[int, str], activated: bool) -> dict[str, Any]:
    """``probs`` and ``label`` for one row's classifier output (a list or a 1-D array)."""
    logits = [float(x) for x in logits]  # a handful of labels: plain floats for the math below
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


def cosine(a: Any, b: Any) -> float:
    """The cosine of two vectors (lists or arrays), computed in float64."""
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    norm = math.sqrt(float(a @ a)) * math.sqrt(float(b @ b))
    return float(a @ b) / norm if norm else 0.0
