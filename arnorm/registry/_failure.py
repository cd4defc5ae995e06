"""A plugin's exception as one line of arnorm's grammar, for the registry and the probe alike, and
the escaping that keeps any text a plugin or a variable supplies to one printable line."""

from __future__ import annotations

from typing import Any

__all__ = ["plugin_failure", "printable"]


def plugin_failure(exc: BaseException) -> str:
    """``"TypeError: ..."`` for anything a plugin raised, on one line; re-raises ``KeyboardInterrupt``.

    A pydantic ``ValidationError`` (a bad ``Capabilities`` or ``BackendSpec`` field) becomes
    ``"Capabilities.<field>: <found> (<what it needs>)"`` per error, instead of pydantic's
    multi-line text.
    """
    if isinstance(exc, KeyboardInterrupt):
        raise exc
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return printable("; ".join(_validation_line(exc.title, e) for e in exc.errors()))
    return printable(f"{type(exc).__name__}: {exc}".strip().rstrip(":"))


def printable(text: str) -> str:
    """``text`` unchanged when every character is printable, else with each one that is not
    escaped (``\\n``, ``\\x1b``): a name or message from a plugin or an ``ARNORM_*`` variable may
    neither forge a line of a table nor send a terminal its control sequences."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _validation_line(model: str, error: Any) -> str:
    from arnorm.registry._capabilities import Capabilities

    loc = ".".join(str(part) for part in error.get("loc", ()))
    where = f"{model}.{loc}" if loc else model
    if error.get("type") == "extra_forbidden":
        fields = list(Capabilities.model_fields) if model == "Capabilities" else []
        valid = f"one of: {', '.join(fields)}" if fields else "a declared field"
        return f"{where}: not a field (needs {valid})"
    from arnorm._environment import pydantic_needs

    needs = pydantic_needs(error)
    if error.get("type") == "value_error":
        return f"{where}: {needs}"  # arnorm's own validators already speak the grammar
    return f"{where}: {error.get('input')!r} ({needs})"
