"""``Config``: every knob, settable in code or through ``ARNORM_*`` variables (one to one)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Config", "load_config", "parse_names"]


def parse_names(value: object) -> tuple[str, ...]:
    """``"a, b"`` / ``["a", "b"]`` -> ``("a", "b")``; blanks dropped, order kept."""
    if value is None:
        return ()
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)):
        items = [str(v) for v in value]
    else:
        msg = f"backend list: {value!r} (needs a comma-separated string or a list of names)"
        raise ValueError(msg)
    return tuple(i.strip() for i in items if i.strip())


Names = Annotated[tuple[str, ...], NoDecode, BeforeValidator(parse_names)]


class Config(BaseSettings):
    """arnorm's settings. Fields set in code win over the environment.

    ==========================  ======================================================  =========
    field                       environment variable                                    default
    ==========================  ======================================================  =========
    ``backend``                 ``ARNORM_BACKEND`` (a name or a comma list, preferred   auto
                                first; strict: only these)
    ``disable``                 ``ARNORM_DISABLE`` (names removed from auto mode)       none
    ``triton_exact``            ``ARNORM_TRITON_EXACT``                                 False
    ``flashinfer_mnnvl``        ``ARNORM_FLASHINFER_MNNVL``                             False
    ``flashinfer_max_size_mb``  ``ARNORM_FLASHINFER_MAX_SIZE_MB``                       table
    ``flashinfer_shared_gpu``   ``ARNORM_FLASHINFER_SHARED_GPU`` (testing: ranks may     False
                                share one GPU; checks correctness, not speed)
    ==========================  ======================================================  =========
    """

    model_config = SettingsConfigDict(env_prefix="ARNORM_", frozen=True, extra="forbid")

    backend: Names = Field(default=(), description="Backends to use, preferred first; empty: auto.")
    disable: Names = Field(default=(), description="Backends that auto mode must not pick.")
    triton_exact: bool = Field(
        default=False,
        description="triton: all-gather the partials and sum them in fp32 in rank order inside "
        "the kernel (bitwise equal to the reference at any TP size) instead of all-reducing.",
    )
    flashinfer_mnnvl: bool = Field(
        default=False, description="flashinfer: allow the MNNVL (multicast) workspace."
    )
    flashinfer_shared_gpu: bool = Field(
        default=False,
        description="flashinfer, for testing on one GPU: let ranks share a GPU (FlashInfer's IPC "
        "workspace works there; the timing means nothing).",
    )
    flashinfer_max_size_mb: float | None = Field(
        default=None,
        description="flashinfer: per-rank input budget in MiB; None uses the per-GPU table.",
    )


#: ARNORM_* variables that are not Config fields but are read elsewhere (tests' rank timeout).
_OTHER_VARIABLES = frozenset({"ARNORM_TEST_TIMEOUT"})


def load_config() -> Config:
    """``Config()`` from the environment, with a :class:`ConfigError` naming the variable on bad input.

    An ``ARNORM_*`` variable that matches no field is reported with a warning: a misspelt
    ``ARNORM_BACKENDS`` would otherwise be ignored in silence.
    """
    import os
    import warnings

    from pydantic import ValidationError

    from arnorm._errors import ConfigError

    known = {f"ARNORM_{name.upper()}" for name in Config.model_fields} | _OTHER_VARIABLES
    for key in sorted(k for k in os.environ if k.startswith("ARNORM_") and k not in known):
        warnings.warn(f"{key}: not an arnorm setting (needs one of {', '.join(sorted(known))})", stacklevel=3)
    try:
        return Config()
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else "?"
        var = f"ARNORM_{field.upper()}"
        msg = f"{var}: {os.environ.get(var)!r} ({first['msg'].lower()}; needs a valid Config.{field})"
        raise ConfigError(msg) from None
