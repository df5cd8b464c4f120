"""The engine protocol: start, turn a row into a request, run a request, close.

Engines: vLLM in the replica (``engines/vllm.py``), an OpenAI-compatible HTTP endpoint
(``engines/http.py``), a shared Ray Serve deployment (``engines/serve.py``).

The engine stage (``llmbatch.stages.engine``) owns everything around it: per-row errors,
bounded in-flight requests, deduplication, ordering, streaming rows out, and restarting a dead
engine. An engine only needs these methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

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


class Engine(Protocol):
    """What the engine stage needs from an engine."""

    #: How many requests the engine runs at once (its ``max_num_seqs``); known after start.
    capacity: int
    #: Optional: alternative key sets a row must carry (one key of each tuple); default
    #: ``(("tokenized_prompt", "prompt"),)``.
    required_any: tuple[tuple[str, ...], ...]

    def prepare(self) -> None:
        """Optional, in the driver when the processor runs (before the engine is shipped to its
        replicas): create what all replicas share, e.g. an endpoint's rate schedule."""

    def begin(self) -> None:
        """Optional, in the replica as it starts, before any stage's start: launch what
        :meth:`start` will use without waiting for it (vLLM: its engine process's fork server)."""

    async def start(self) -> None:
        """Start the engine; raise :class:`~llmbatch.errors.EngineStartError` with the reason."""

    def build_request(self, row: Row) -> Request:
        """Validate ``row`` and turn it into a request; raise ``RowValidationError`` if invalid."""

    async def run(self, request: Request) -> dict[str, Any]:
        """Run one request; return the output columns (``generated_text``, ...)."""

    def is_fatal(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the engine is dead (restart it and retry the row)."""

    async def restart(self) -> None:
        """Replace a dead engine with a fresh one."""

    async def close(self) -> None:
        """Stop the engine and its processes."""
