"""The check of an answer against its structured-output spec (the ``check_output`` step of the
engine stage): a choice, a regex, a JSON object or schema; and an answer cut by ``max_tokens``
before it was complete says so."""

from __future__ import annotations

import json
import re
from typing import Any

from llmbatch.errors import StructuredOutputError


def check_structured(spec: dict[str, Any], text: str, finish_reason: str) -> None:
    """Raise :class:`StructuredOutputError` when ``text`` does not satisfy ``spec``.

    An answer that satisfies its spec is fine even when the end-of-sequence token did not fit
    in ``max_tokens``; one that does not and was cut by ``max_tokens`` says so."""
    try:
        _check_structured(spec, text)
    except StructuredOutputError as exc:
        if finish_reason == "length":
            raise StructuredOutputError(
                f"generation stopped at max_tokens before the structured output was complete ({exc}); "
                "raise max_tokens") from exc
        raise


def _check_structured(spec: dict[str, Any], text: str) -> None:
    if "choice" in spec:
        if text not in spec["choice"]:
            raise StructuredOutputError(f"the answer {text[:80]!r} is not one of the choices")
    elif "regex" in spec:
        if re.fullmatch(spec["regex"], text) is None:
            raise StructuredOutputError(f"the answer {text[:80]!r} does not match the regex")
    elif "json" in spec or "json_object" in spec:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise StructuredOutputError(f"the answer is not valid JSON ({exc})") from exc
        schema = spec.get("json")
        if isinstance(schema, dict):
            import jsonschema

            try:
                jsonschema.validate(value, schema)
            except jsonschema.ValidationError as exc:
                raise StructuredOutputError(f"the answer does not match the JSON schema: {exc.message}") from exc
