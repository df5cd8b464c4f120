"""The user's preprocess and postprocess functions, as stages.

Preprocess gets the input row and returns the request fields (``messages`` or ``prompt``,
``sampling_params``...), which are merged into the row, as in Ray. Postprocess gets every
public field (input columns, preprocess outputs, engine outputs) and returns the output row.
Error rows skip postprocess and keep the default output shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmbatch.rows import ERROR_COLUMN, PRIVATE_PREFIX, REQUEST_COLUMNS, Row
from llmbatch.stages.base import Stage

UserFn = Callable[[dict[str, Any]], dict[str, Any]]


def ship_by_value(fn: Any) -> None:
    """Make Ray send ``fn``'s module to the workers by value when it is not an installed
    package (a script's helper module, a test file): workers need not be able to import it."""
    import sys

    name = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", None)
    module = sys.modules.get(name or "")
    if module is None or name == "__main__" or name.startswith("llmbatch"):
        return
    origin = getattr(module, "__file__", "") or ""
    if not origin or "site-packages" in origin or "dist-packages" in origin:
        return
    try:  # Ray serializes with its own copy of cloudpickle
        from ray import cloudpickle
    except ImportError:  # pragma: no cover - ray is a dependency
        import cloudpickle
    cloudpickle.register_pickle_by_value(module)


def public_view(row: Row) -> dict[str, Any]:
    """The row as user functions see it: no private bookkeeping keys."""
    return {k: v for k, v in row.items() if not k.startswith(PRIVATE_PREFIX)}


def default_output(row: Row) -> dict[str, Any]:
    """The output row when there is no postprocess: input columns, preprocess outputs and
    engine outputs, without the request fields the engine consumed."""
    return {
        k: v for k, v in row.items()
        if not k.startswith(PRIVATE_PREFIX) and k not in REQUEST_COLUMNS
    }


class PreprocessStage(Stage):
    """Runs the user's ``preprocess(row) -> dict`` and merges its result into the row."""

    name = "preprocess"

    def __init__(self, fn: UserFn, continue_on_error: bool = False):
        super().__init__(continue_on_error)
        self.fn = fn
        ship_by_value(fn)

    def process_row(self, row: Row) -> None:
        out = self.fn(public_view(row))
        if not isinstance(out, dict):
            raise TypeError(f"preprocess must return a dict, it returned {type(out).__name__}")
        row.update(out)


class PostprocessStage(Stage):
    """Runs the user's ``postprocess(row) -> dict``; its result becomes the output row."""

    name = "postprocess"

    def __init__(self, fn: UserFn, continue_on_error: bool = False):
        super().__init__(continue_on_error)
        self.fn = fn
        ship_by_value(fn)

    def process_row(self, row: Row) -> None:
        out = self.fn(public_view(row))
        if not isinstance(out, dict):
            raise TypeError(f"postprocess must return a dict, it returned {type(out).__name__}")
        private = {k: v for k, v in row.items() if k.startswith(PRIVATE_PREFIX)}
        row.clear()
        row.update(out)
        row.update(private)
        row.setdefault(ERROR_COLUMN, "")
