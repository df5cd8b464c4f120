"""The engine base class: start, turn a row into a request, run a request, close.

Engines: vLLM in the replica (``engines/vllm.py``), SGLang in the replica
(``engines/sglang.py``), an OpenAI-compatible HTTP endpoint (``engines/http.py``), a shared Ray
Serve deployment (``engines/serve.py``).

The engine stage (``llmbatch.stages.engine``) owns everything around it: per-row errors,
bounded in-flight requests, deduplication, ordering, streaming rows out, and restarting a dead
engine. An engine inherits :class:`Engine` and implements its methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmbatch.rows import Row


@dataclass
class Request:
    """One engine request built from one row."""

    prompt: Any                      # engine-specific prompt object
    params: Any                      # SamplingParams / PoolingParams / payload
    key: Any = None                  # identical requests share a key (None: never shared)
    sort_key: Any = None             # rows are submitted in this order (shared prefixes together)
    lora: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    """What the engine stage needs from an engine: every engine inherits this class.

    Subclasses implement :meth:`start`, :meth:`build_request`, :meth:`run`, :meth:`is_fatal`,
    :meth:`restart` and :meth:`close`; the other hooks have defaults that do nothing.
    """

    #: How many requests the engine runs at once (its ``max_num_seqs``); known after start.
    capacity: int = 1
    #: Alternative key sets a row must carry (one key of each tuple).
    required_any: tuple[tuple[str, ...], ...] = (("tokenized_prompt", "prompt"),)
    #: Whether base-model rows and adapter rows must take turns in the engine
    #: (:mod:`llmbatch.stages.turns`); known after start.
    base_rows_apart: bool = False

    def prepare(self) -> None:
        """In the driver when the processor runs (before the engine is shipped to its
        replicas): create what all replicas share, e.g. an endpoint's rate schedule."""

    def begin(self) -> None:
        """In the replica as it starts, before any stage's start: launch what :meth:`start`
        will use without waiting for it (vLLM: its engine process's fork server)."""

    def warm_key(self, gpu: bool = False) -> str:
        """What makes two of these engines interchangeable (a warm engine host serves every run
        whose engine has the same key: :mod:`llmbatch.stages.warm`); ``gpu``: the host holds a
        GPU (else it runs on a CPU)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be kept warm: it has no warm_key")

    async def start(self) -> None:
        """Start the engine; raise :class:`~llmbatch.errors.EngineStartError` with the reason."""
        raise NotImplementedError

    def build_request(self, row: Row) -> Request:
        """Validate ``row`` and turn it into a request; raise ``RowValidationError`` if invalid."""
        raise NotImplementedError

    async def run(self, request: Request) -> dict[str, Any]:
        """Run one request; return the output columns (``generated_text``, ...)."""
        raise NotImplementedError

    def is_fatal(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the engine is dead (restart it and retry the row)."""
        return False

    async def restart(self) -> None:
        """Replace a dead engine with a fresh one."""
        raise NotImplementedError

    async def close(self) -> None:
        """Stop the engine and its processes."""
