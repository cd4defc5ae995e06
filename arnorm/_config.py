"""What can be configured: the core's :class:`Config` and the base of a backend's settings.

``Config`` is set in code or through ``ARNORM_*`` variables (one to one). Backends own their
settings (:class:`BackendSettings`, read from ``ARNORM_<BACKEND>_*``); ``Config.settings``
overrides them in code. The timeouts' defaults and bound are written here, once: discovery, the
probe and the agreement between ranks read them from here. (:mod:`arnorm._environment` reads
the variables; :mod:`arnorm.registry._load` reads settings against the registered backends.)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from arnorm._environment import PREFIX, config_error, read_environment
from arnorm._errors import ArnormError

if TYPE_CHECKING:
    from arnorm._problem import Problem

__all__ = [
    "DEFAULT_PEER_TIMEOUT",
    "DEFAULT_PROBE_TIMEOUT",
    "MAX_TIMEOUT",
    "BackendSettings",
    "Config",
    "parse_names",
    "peer_timeout",
]

#: Seconds a plugin's import, or a backend's probe, may take (``Config.probe_timeout``'s default).
DEFAULT_PROBE_TIMEOUT = 15.0
#: Seconds construction and a CPU (gloo) call wait for the peers (``Config.peer_timeout``'s default).
DEFAULT_PEER_TIMEOUT = 600.0
#: The largest timeout accepted: a day, far inside what ``Thread.join`` takes (``threading.TIMEOUT_MAX``).
MAX_TIMEOUT = 86400.0


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

#: Fields with no variable (set in code only).
_CODE_ONLY = frozenset({"settings"})
#: The shortest ``peer_timeout`` (seconds).
MIN_PEER_TIMEOUT = 1.0


class _ExactEnvironment(PydanticBaseSettingsSource):
    """``ARNORM_<FIELD>`` exactly as written (upper case); pydantic-settings would also honour
    ``arnorm_backend``, which arnorm reports and ignores instead."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ reads every field at once

    def __call__(self) -> dict[str, Any]:
        return read_environment(PREFIX, (f for f in self.settings_cls.model_fields if f not in _CODE_ONLY))


class Config(BaseSettings):
    """arnorm's core settings. Fields set in code win over the environment.

    ===================  ==========================  ================================================
    field                variable                    meaning (default)
    ===================  ==========================  ================================================
    ``backend``          ``ARNORM_BACKEND``          a name or comma list, preferred first; strict:
                                                     only these (auto)
    ``disable``          ``ARNORM_DISABLE``          names auto mode must not pick (none)
    ``check_calls``      ``ARNORM_CHECK_CALLS``      compare every call's fingerprint across ranks
                                                     before its collective; slow, for debugging (off)
    ``probe_timeout``    ``ARNORM_PROBE_TIMEOUT``    seconds a plugin's import, and a backend's
                                                     probe, may each take (15; at most 86400)
    ``peer_timeout``     ``ARNORM_PEER_TIMEOUT``     seconds construction and a CPU (gloo) call wait
                                                     for the other ranks before raising
                                                     :class:`arnorm.PeerError` (600; at least 1)
    ``batch_invariant``  ``ARNORM_BATCH_INVARIANT``  a row's outputs bitwise independent of the token
                                                     count and of the path serving it: only backends
                                                     declaring it are selected (off)
    ``vllm``             ``ARNORM_VLLM``             arnorm's vLLM plugin routes vLLM's fused
                                                     all-reduce + norm helpers to arnorm in every
                                                     vLLM process (on; ``0``: vLLM's own helpers)
    ``vllm_pass``        ``ARNORM_VLLM_PASS``        arnorm's fusion pass in vLLM's compile
                                                     pipeline: ``after`` vLLM's FlashInfer pass
                                                     (default), ``take`` (vLLM's off), or ``off``
    ``settings``         (code only)                 per-backend settings overrides,
                                                     ``{"triton": {"exact": True}}``
    ===================  ==========================  ================================================

    Raises :class:`arnorm.ConfigError` (naming the variable or field) for a malformed value.
    """

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    backend: Names = Field(default=(), description="Backends to use, preferred first; empty: auto.")
    disable: Names = Field(default=(), description="Backends that auto mode must not pick.")
    check_calls: bool = Field(
        default=False,
        description="Gather a fingerprint of every call through the store before its collective and "
        "raise the same error on every rank when they differ (a few store round trips per call).",
    )
    probe_timeout: float = Field(
        default=DEFAULT_PROBE_TIMEOUT,
        gt=0,
        # A wait the threading module can take (1e10 s overflows Thread.join), told up front.
        le=MAX_TIMEOUT,
        allow_inf_nan=False,
        description="Seconds a backend's module import, and then its probe, may each take before the "
        "backend is rejected (FlashInfer's import alone took 5 s on an H200; JIT builds belong in "
        "create()); at most 86400.",
    )
    peer_timeout: float = Field(
        default=DEFAULT_PEER_TIMEOUT,
        # Below a second, one rank's store round trip or gloo connect outlasts the bound and the
        # ranks raise different errors at different times: refused up front, alike on every rank.
        ge=MIN_PEER_TIMEOUT,
        le=MAX_TIMEOUT,
        allow_inf_nan=False,
        description="Seconds construction (and a call on a gloo group, or its ARNORM_CHECK_CALLS "
        "agreement) waits for the other ranks before raising PeerError naming the missing ones: long "
        "enough for a first-use JIT build on a peer (FlashInfer's takes ~6 minutes on a fresh machine), "
        "far below the process group's 30 minutes.",
    )
    batch_invariant: bool = Field(
        default=False,
        description="Select only backends that declare Capabilities.batch_invariant, for every token "
        "count the op serves, and have them run their invariant path: a row's residual, normed output, "
        "codes and scales are then bitwise independent of the token count, of the other rows and of "
        "the kernel or protocol serving the call (docs/numerics.md, 'Batch invariance').",
    )
    vllm: bool = Field(
        default=True,
        description="Where arnorm is installed in a vLLM environment, its vllm.general_plugins entry point "
        "routes vLLM's fused all-reduce + norm helpers to arnorm.integrations.vllm in every vLLM process; "
        "False (ARNORM_VLLM=0) leaves vLLM's own helpers in place (docs/integrations.md).",
    )
    vllm_pass: Literal["after", "take", "off"] = Field(
        default="after",
        description="With the vLLM plugin on, arnorm's all-reduce + norm fusion pass in vLLM's compile "
        "pipeline: 'after' runs it after vLLM's own passes and fuses the seams vLLM's FlashInfer pass "
        "leaves; 'take' also turns vLLM's fuse_allreduce_rms off so that arnorm serves every seam; "
        "'off' installs no pass (docs/integrations.md).",
    )
    settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-backend settings set in code: {backend: {field: value}}."
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            from_env = read_environment(PREFIX, [f for f in self._env_fields() if f not in values])
            raise config_error(exc, PREFIX, from_env, "Config", type(self).model_fields) from None

    @classmethod
    def _env_fields(cls) -> list[str]:
        return [f for f in cls.model_fields if f not in _CODE_ONLY]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _ExactEnvironment(settings_cls))

    def __hash__(self) -> int:
        return hash(repr(self.model_dump()))

    def configured(self, problem: Problem) -> Problem:
        """``problem`` as this Config asks for it: the one place a Config field becomes a Problem
        field (``batch_invariant``), for ops, ``arnorm explain`` and ``arnorm bench`` alike."""
        return dataclasses.replace(problem, batch_invariant=self.batch_invariant)


def peer_timeout(config: object) -> float:
    """``config.peer_timeout``; the environment's when ``config`` is not a Config yet (a malformed one
    is reported through the agreement itself), and the default when the environment's is malformed."""
    if isinstance(config, Config):
        return config.peer_timeout
    try:
        return float(Config().peer_timeout)
    except ArnormError:
        return DEFAULT_PEER_TIMEOUT


class BackendSettings(BaseModel):
    """Base class of a backend's own settings: frozen, unknown fields rejected.

    Subclass it with typed, documented fields and name the class in ``BackendSpec(settings=...)``;
    arnorm reads each field from ``ARNORM_<BACKEND>_<FIELD>`` (upper case), lets ``Config(settings=
    {"<backend>": {...}})`` override it in code, checks that every rank has the same values, shows
    them in ``explain`` and hands the instance to the backend's ``create()``. Numbers that must be
    positive should say so (``Field(gt=0, allow_inf_nan=False)``): a value that cannot agree
    across ranks is better rejected where it is read.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
