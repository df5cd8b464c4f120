"""The user's preprocess and postprocess functions, as stages.

Preprocess gets the input row and returns the request fields (``messages`` or ``prompt``,
``sampling_params``...), which are merged into the row, as in Ray. Postprocess gets every
public field (input columns, preprocess outputs, engine outputs) and returns the output row.
Error rows skip postprocess and keep the default output shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmbatch.codec import ByValue
from llmbatch.rows import ERROR_COLUMN, PRIVATE_PREFIX, REQUEST_COLUMNS, Row
from llmbatch.stages.base import Stage

UserFn = Callable[[dict[str, Any]], dict[str, Any]]


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


class UserFnStage(Stage):
    """A user function ``row -> dict`` over the public view of each row; subclasses say what
    becomes of its result (:meth:`apply`)."""

    def __init__(self, fn: UserFn):
        super().__init__()
        self.fn = ByValue(fn)  # its module travels to the workers with it (see ByValue)

    def process_row(self, row: Row) -> None:
        out = self.fn(public_view(row))
        if not isinstance(out, dict):
            raise TypeError(f"{self.name} must return a dict, it returned {type(out).__name__}")
        self.apply(row, out)

    def apply(self, row: Row, out: dict[str, Any]) -> None:
        raise NotImplementedError


class PreprocessStage(UserFnStage):
    """Runs the user's ``preprocess(row) -> dict`` and merges its result into the row."""

    name = "preprocess"

    def apply(self, row: Row, out: dict[str, Any]) -> None:
        row.update(out)


class PostprocessStage(UserFnStage):
    """Runs the user's ``postprocess(row) -> dict``; its result becomes the output row."""

    name = "postprocess"

    def apply(self, row: Row, out: dict[str, Any]) -> None:
        private = {k: v for k, v in row.items() if k.startswith(PRIVATE_PREFIX)}
        row.clear()
        row.update(out)
        row.update(private)
        row.setdefault(ERROR_COLUMN, "")
