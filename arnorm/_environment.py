"""The ``ARNORM_*`` variables: read by exact name, their errors in arnorm's grammar, and the
warnings for the rest.

Two kinds of settings (:mod:`arnorm._config`) read the environment the same way:

- the core's :class:`arnorm.Config` (``ARNORM_<FIELD>``), and
- a backend's own :class:`arnorm.plugin.BackendSettings` model, declared on its descriptor
  (``ARNORM_<BACKEND>_<FIELD>``, e.g. ``ARNORM_TRITON_EXACT``), built by
  :func:`arnorm.registry._load.backend_settings`.

Only upper-case names are read: a lower-case ``arnorm_backend`` is ignored with a warning instead
of being honoured under a name the error messages would not show. An ``ARNORM_*`` variable that no
setting reads is reported once per process, naming the settings it could have meant.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from arnorm._errors import ArnormWarning, ConfigError

__all__ = [
    "PREFIX",
    "config_error",
    "env_prefix",
    "read_environment",
    "warn_unknown_variables",
]

PREFIX = "ARNORM_"


def env_prefix(backend: str) -> str:
    """``"triton_symm"`` -> ``"ARNORM_TRITON_SYMM_"``."""
    return f"{PREFIX}{backend.upper()}_"


def read_environment(prefix: str, fields: Iterable[str]) -> dict[str, str]:
    """``{field: value}`` for every ``<prefix><FIELD>`` variable that is set (exact, upper-case names)."""
    out = {}
    for field in fields:
        value = os.environ.get(prefix + field.upper())
        if value is not None:
            out[field] = value
    return out


#: pydantic error type -> what arnorm's message says is needed.
_NEEDS = {
    "bool_parsing": "a boolean: 1/0, true/false, yes/no or on/off",
    "bool_type": "a boolean: 1/0, true/false, yes/no or on/off",
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
}
#: pydantic bound error type -> (its ``ctx`` key, the comparison).
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
           "less_than_equal": ("le", "<=")}  # fmt: skip


def pydantic_needs(error: Mapping[str, Any]) -> str:
    """What one pydantic error says is needed, in arnorm's words (``needs an integer``, ``needs > 0``);
    pydantic's own message, lower-cased, for a type without a wording here."""
    kind, ctx = error.get("type", ""), error.get("ctx") or {}
    if kind in _NEEDS:
        return f"needs {_NEEDS[kind]}"
    if kind in _BOUNDS and _BOUNDS[kind][0] in ctx:
        key, op = _BOUNDS[kind]
        limit = ctx[key]
        return f"needs {op} {limit:g}" if isinstance(limit, float) else f"needs {op} {limit}"
    msg = str(error.get("msg", "")).removeprefix("Value error, ")
    return msg[:1].lower() + msg[1:]


def config_error(
    exc: ValidationError, prefix: str, from_env: Mapping[str, str], owner: str, fields: Iterable[str] = ()
) -> ConfigError:
    """A :class:`ConfigError` naming the variable (or the field set in code) of the first error, in
    arnorm's grammar ``<where>: <found> (needs <required>)``; ``fields``: the valid names, for a
    misspelt one."""
    first = exc.errors()[0]
    field = str(first["loc"][0]) if first.get("loc") else "?"
    found = from_env.get(field, first.get("input"))
    where = prefix + field.upper() if field in from_env else f"{owner}.{field}"
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        names = sorted(fields)
        needs = f"one of: {', '.join(names)}" if names else "no settings: this backend has none"
        return ConfigError(f"{where}: not a setting (needs {needs})")
    needs = pydantic_needs(first)
    if kind == "value_error" and needs.endswith(")") and "(needs " in needs:
        # A validator's own message in arnorm's grammar ("x: y (needs z)") gives its "needs" part.
        needs = needs[needs.index("(needs ") + 1 : -1]
    return ConfigError(f"{where}: {found!r} ({needs})")


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, ArnormWarning, stacklevel=4)


def warn_unknown_variables(core_fields: Iterable[str], backends: Mapping[str, Iterable[str]]) -> None:
    """Warn once per variable about ``ARNORM_*`` names no setting reads, and lower-case spellings.

    ``backends`` maps each registered backend name to its settings' field names. A variable under a
    backend's prefix (the longest matching name wins: ``ARNORM_TRITON_SYMM_X`` belongs to
    ``triton_symm``, not ``triton``) is reported with that backend's valid variables.
    """
    core = {PREFIX + f.upper() for f in core_fields}
    by_prefix = sorted(
        ((env_prefix(n), n, tuple(fs)) for n, fs in backends.items()), key=lambda p: -len(p[0])
    )
    known = set(core)
    for prefix, _, fields in by_prefix:
        known.update(prefix + f.upper() for f in fields)
    for key in sorted(os.environ):
        upper = key.upper()
        if not upper.startswith(PREFIX):
            continue
        if key != upper:
            hint = f"{upper} is read" if upper in known else "arnorm reads upper-case names only"
            _warn_once(key, f"{key}: ignored ({hint}; needs the upper-case name)")
            continue
        if key in known:
            continue
        owner = next(((p, n, fs) for p, n, fs in by_prefix if key.startswith(p)), None)
        if owner is not None:
            prefix, name, fields = owner
            valid = ", ".join(prefix + f.upper() for f in fields) or "none"
            _warn_once(key, f"{key}: not a setting of backend {name!r} (needs one of: {valid})")
        else:
            # The likeliest meant first: difflib orders every name by similarity to the one found.
            ordered = difflib.get_close_matches(key, sorted(core), n=len(core), cutoff=0.0)
            _warn_once(key, f"{key}: not an arnorm setting (needs one of {', '.join(ordered)})")
