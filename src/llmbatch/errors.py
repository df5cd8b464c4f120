"""The llmbatch exception tree.

Every error a user can act on derives from :class:`LLMBatchError` and says what went wrong,
where (field, row, stage) and what to do about it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def did_you_mean(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known name closest to a mistyped ``name`` (None when nothing is close)."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def suggestion(name: str, known: Iterable[str], cutoff: float = 0.6, *, clause: bool = False) -> str:
    """The did-you-mean hint to append to an error message, the one way llmbatch words it:
    `` (did you mean 'x'?)``, or with ``clause`` (after a message that goes on)
    ``; did you mean 'x'?``; "" when no known name is close to ``name``."""
    close = did_you_mean(name, known, cutoff)
    if not close:
        return ""
    return f"; did you mean '{close}'?" if clause else f" (did you mean '{close}'?)"


class LLMBatchError(Exception):
    """Base class of every llmbatch error."""


class ConfigError(LLMBatchError, ValueError):
    """A configuration mistake, found before any work starts."""


class ModelNotFoundError(ConfigError):
    """``model_source`` names nothing llmbatch can load."""


class MissingDependencyError(LLMBatchError, ImportError):
    """An optional dependency is needed for what was asked; the message has the pip command."""

    def __init__(self, what: str, pip_name: str, command: str | None = None):
        super().__init__(f"{what} needs the package '{pip_name}': {command or 'pip install ' + pip_name}")


class ResourceError(LLMBatchError):
    """The cluster cannot satisfy what the config asks for (an accelerator type no node has)."""


class RowError(LLMBatchError):
    """One row failed in one stage. With ``should_continue_on_error`` off this fails the run.

    ``str(error)`` is the same text that goes into ``__inference_error__`` when errors are
    kept as error rows: ``"<stage>: <ErrorType>: <message>"``, followed here by the row id.
    """

    def __init__(self, stage: str, error_type: str, message: str, row_id: Any = None):
        self.stage = stage
        self.error_type = error_type
        self.message = message
        self.row_id = row_id
        text = f"{stage}: {error_type}: {message}"
        if row_id is not None:
            text += f" (row {row_id})"
        super().__init__(text)

    def __reduce__(self):
        return (RowError, (self.stage, self.error_type, self.message, self.row_id))


class RowValidationError(LLMBatchError, ValueError):
    """A row's request is invalid (bad sampling params, empty prompt, prompt too long...)."""


class PromptTooLongError(RowValidationError):
    """The prompt plus the tokens to generate do not fit in ``max_model_len``."""


class StructuredOutputError(LLMBatchError):
    """The generated text does not satisfy the structured-output spec it was asked for."""


class EngineStartError(LLMBatchError):
    """The engine could not start (bad model, not enough memory); the engine's reason follows."""


class EngineDiedError(LLMBatchError):
    """The engine died again and again while running a row; the row gave up."""


class EndpointError(LLMBatchError):
    """An endpoint (an OpenAI-compatible HTTP server, a Ray Serve deployment) gave no usable
    answer for a row: the message says what it answered (status, body excerpt) and after how
    many attempts."""


class HttpStatusError(EndpointError):
    """The endpoint answered with an error status (e.g. 400 for a bad request, or 429/5xx
    still after every retry); the message has the status and an excerpt of the body."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    def __reduce__(self):
        return (type(self), (str(self), self.status))


class EndpointTimeoutError(EndpointError):
    """No complete answer within the request timeout, on every attempt."""


class EndpointConnectionError(EndpointError):
    """The connection failed or dropped (refused, reset, closed mid-answer) on every attempt."""


class ResponseTooLargeError(EndpointError):
    """An endpoint's answer over the engine's size limit (not retried: it would answer the same)."""


class InvalidResponseError(EndpointError):
    """The endpoint answered 2xx with a body that is not the JSON expected (invalid, truncated)."""


class StallError(LLMBatchError):
    """A run made no progress for ``stall_timeout_s``: says what waits, for what, what holds
    it, and what to do."""


class JobError(LLMBatchError):
    """A job cannot run or resume as asked (changed input, locked job dir, bad job file)."""
