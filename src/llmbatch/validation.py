"""A config's validation errors as one message: each field named, with the closest known field
for a misspelt one and what to do."""

from __future__ import annotations

from pydantic import ValidationError

from llmbatch.errors import ConfigError, suggestion


def format_validation_error(cls_name: str, exc: ValidationError, known: list[str]) -> str:
    """``exc`` as one line: ``<Config>: unknown field 'x'; did you mean ...`` and so on."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(config)"
        if err["type"] == "extra_forbidden":
            field = str(err["loc"][-1])
            hint = suggestion(field, known) or f". Known fields: {', '.join(known)}"
            lines.append(f"unknown field '{loc}'{hint}.")
        elif err["type"] == "missing":
            lines.append(f"field '{loc}' is required.")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            nested = isinstance((err.get("ctx") or {}).get("error"), ConfigError)  # a nested config's own message
            if not err["loc"] or nested:  # (or a rule over several fields): no field value to repeat
                lines.append(("" if not err["loc"] else f"field '{loc}': ") + msg.rstrip(".") + ".")
            else:
                lines.append(f"field '{loc}': {msg} (got {err.get('input')!r}).")
    return f"{cls_name}: " + " ".join(lines)
