"""Plugin discovery: pluggy over the ``arnorm.backends`` entry points.

Only descriptors are loaded here (cheap modules returning :class:`BackendSpec`); a backend's heavy
module is imported when it is probed. A plugin that raises is recorded as *broken* with its
exception and a warning; it never breaks the core.
"""

from __future__ import annotations

import importlib.metadata
import threading
import warnings
from dataclasses import dataclass

import pluggy

from arnorm._spec import PROJECT, BackendHookSpecs, BackendSpec, priority_order

__all__ = ["ENTRY_POINT_GROUP", "ArnormWarning", "BackendInfo", "Registry", "get_registry", "reset_registry"]

ENTRY_POINT_GROUP = "arnorm.backends"


class ArnormWarning(UserWarning):
    """Something is wrong with an installed plugin; arnorm carries on without it."""


@dataclass(frozen=True)
class BackendInfo:
    """One registered backend as ``arnorm.backends()`` reports it.

    ``status`` is ``"available"`` (its requirements are importable; not yet probed),
    ``"not installed"`` (``reason`` holds the pip command that fixes it) or ``"broken"`` (its plugin
    raised; ``reason`` holds the exception). ``spec`` is ``None`` only for broken plugins.
    """

    name: str
    status: str
    reason: str
    priority: int | None
    version: str | None
    plugin: str
    spec: BackendSpec | None = None

    @property
    def is_available(self) -> bool:
        return self.status == "available"


def _version(distribution: str | None) -> str | None:
    if not distribution:
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _info_for(spec: BackendSpec, plugin: str) -> BackendInfo:
    missing = spec.missing_requirements()
    if missing:
        reason = f"not installed: {', '.join(missing)} (needs {spec.fix_hint()})"
        return BackendInfo(spec.name, "not installed", reason, spec.priority, None, plugin, spec)
    return BackendInfo(spec.name, "available", "", spec.priority, _version(spec.distribution), plugin, spec)


def _broken(name: str, plugin: str, exc: BaseException) -> BackendInfo:
    detail = f"{type(exc).__name__}: {exc}".strip()
    warnings.warn(f"arnorm: backend plugin {plugin!r} is broken and was skipped: {detail}", ArnormWarning, 3)
    return BackendInfo(name, "broken", f"plugin: {detail} (needs a working install)", None, None, plugin)


class Registry:
    """The backends known to this process, by name, in the order of discovery."""

    def __init__(self) -> None:
        self._infos: dict[str, BackendInfo] = {}

    @classmethod
    def discover(cls) -> Registry:
        """Load every ``arnorm.backends`` entry point through pluggy and collect its specs."""
        registry = cls()
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(BackendHookSpecs)
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            plugin = ep.name
            try:
                pm.register(ep.load(), name=plugin)
            except Exception as exc:  # a third-party plugin may raise anything; the core carries on
                registry._put(_broken(plugin, plugin, exc))
        for impl in pm.hook.arnorm_backends.get_hookimpls():
            registry.add_from_hook(impl.plugin_name, impl.function)
        return registry

    def add_from_hook(self, plugin: str, hook: object) -> None:
        """Call one plugin's ``arnorm_backends`` hook and register what it returns."""
        try:
            specs = hook()  # type: ignore[operator]
            if not isinstance(specs, (list, tuple)) or not all(isinstance(s, BackendSpec) for s in specs):
                msg = f"arnorm_backends() returned {specs!r} (needs a list of arnorm.plugin.BackendSpec)"
                raise TypeError(msg)
        except Exception as exc:  # see discover()
            self._put(_broken(plugin, plugin, exc))
            return
        for spec in specs:
            self.add(spec, plugin=plugin)

    def add(self, spec: BackendSpec, plugin: str = "<code>") -> None:
        """Register ``spec``; a second backend of the same name is reported as broken."""
        known = self._infos.get(spec.name)
        if known is not None and known.status != "broken":
            dup = ValueError(f"name {spec.name!r} is already registered by plugin {known.plugin!r}")
            self._put(_broken(f"{spec.name}@{plugin}", plugin, dup))
            return
        self._put(_info_for(spec, plugin))

    def _put(self, info: BackendInfo) -> None:
        self._infos[info.name] = info

    def get(self, name: str) -> BackendInfo | None:
        return self._infos.get(name)

    def infos(self) -> list[BackendInfo]:
        """Every backend, highest priority first, then by name; broken plugins last."""
        return sorted(self._infos.values(), key=lambda i: priority_order(i.priority, i.name))


_lock = threading.Lock()
_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, discovered on first use (never at ``import arnorm``)."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = Registry.discover()
        return _registry


def reset_registry(registry: Registry | None = None) -> None:
    """Forget the discovered registry (tests), or install ``registry`` in its place."""
    global _registry
    with _lock:
        _registry = registry
