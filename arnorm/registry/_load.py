"""Settings read against the registry: the core's ``Config`` and every backend's own settings.

Both need to know the registered backends: which ``ARNORM_<NAME>_*`` variables some setting reads
(the rest are warned about), and which names ``Config.settings`` may override.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from arnorm._config import BackendSettings, Config
from arnorm._environment import config_error, env_prefix, read_environment, warn_unknown_variables
from arnorm._errors import ConfigError
from arnorm.registry._capabilities import join_or
from arnorm.registry._discovery import Registry, get_registry
from arnorm.registry._spec import BackendSpec

__all__ = ["backend_settings", "load_config", "load_settings"]


def load_config() -> Config:
    """``Config()`` from the environment, after warning about ``ARNORM_*`` names no setting reads."""
    registry = get_registry()
    backends = {
        i.name: tuple(i.spec.settings.model_fields) if i.spec and i.spec.settings else ()
        for i in registry.infos()
    }
    warn_unknown_variables(Config._env_fields(), backends)
    return Config()


def backend_settings(spec: BackendSpec, overrides: Mapping[str, Any] | None) -> BackendSettings:
    """The backend's settings from its variables, with ``Config(settings=...)`` overrides on top."""
    cls = spec.settings or BackendSettings
    prefix = env_prefix(spec.name)
    from_env = read_environment(prefix, cls.model_fields)
    values: dict[str, Any] = {**from_env, **(overrides or {})}
    for key in overrides or {}:
        from_env.pop(key, None)
    try:
        return cls(**values)
    except ValidationError as exc:
        raise config_error(
            exc, prefix, from_env, f"Config.settings[{spec.name!r}]", cls.model_fields
        ) from None


def load_settings(registry: Registry, config: Config) -> dict[str, BackendSettings]:
    """Every registered backend's settings (env + ``Config.settings``); raises :class:`ConfigError`."""
    known = {i.name for i in registry.infos() if i.spec is not None}
    unknown = sorted(set(config.settings) - known)
    if unknown:
        msg = (
            f"Config.settings: {', '.join(map(repr, unknown))} (needs registered backends: {join_or(known)})"
        )
        raise ConfigError(msg)
    out = {}
    for info in registry.infos():
        if info.spec is not None:
            out[info.name] = backend_settings(info.spec, config.settings.get(info.name))
    return out
