"""Plugin discovery: pluggy over the ``arnorm.backends`` entry points.

Only descriptors are loaded here (cheap modules returning :class:`BackendSpec`); a backend's heavy
module is imported when it is probed. Each entry point's module is imported within
``ARNORM_PROBE_TIMEOUT`` (:mod:`arnorm.registry._imports`): one whose import never returns is listed as
broken ("import: no answer in 15 s, still running ...") instead of hanging every use of arnorm. A
plugin that raises anything (``SystemExit`` included; only ``KeyboardInterrupt`` propagates),
implements a hook arnorm does not define, returns something other than specs, or claims a built-in
backend's name is recorded as *broken* with the reason and a warning; it never breaks the core or
another plugin.
"""

from __future__ import annotations

import importlib.metadata
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import pluggy

from arnorm._errors import ArnormWarning
from arnorm.registry._failure import plugin_failure, printable
from arnorm.registry._imports import discovery_timeout, import_bounded, timed_out
from arnorm.registry._spec import BUILTIN_NAMES, PROJECT, BackendHookSpecs, BackendSpec, priority_order

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendInfo",
    "Registry",
    "get_registry",
    "reset_registry",
]

ENTRY_POINT_GROUP = "arnorm.backends"
#: The distribution whose plugins may use :data:`arnorm.registry._spec.BUILTIN_NAMES`.
CORE_DISTRIBUTION = "arnorm"


@dataclass(frozen=True)
class BackendInfo:
    """One registered backend as ``arnorm.backends()`` reports it.

    ``status``: ``"available"`` (its requirements are importable; not yet probed),
    ``"not_installed"`` (``reason`` holds the pip command that fixes it), ``"outdated"``
    (installed, older than the backend accepts; ``reason`` says which version it needs) or
    ``"broken"`` (its plugin raised or misbehaved; ``reason`` says how). ``spec`` is ``None``
    only for broken plugins.
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


def _too_old(version: str | None, floor: str | None) -> bool:
    if version is None or floor is None:
        return False
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) < Version(floor)
    except InvalidVersion:
        return False


def _info_for(spec: BackendSpec, plugin: str) -> BackendInfo:
    missing = spec.missing_requirements()
    if missing:
        reason = f"not installed: {', '.join(missing)} (needs {spec.fix_hint()})"
        return BackendInfo(spec.name, "not_installed", reason, spec.priority, None, plugin, spec)
    version = _version(spec.distribution)
    if _too_old(version, spec.min_version):
        upgrade = spec.install_hint or f"pip install -U '{spec.distribution}>={spec.min_version}'"
        reason = f"version: {spec.distribution} {version} (needs >= {spec.min_version}: {upgrade})"
        return BackendInfo(spec.name, "outdated", reason, spec.priority, version, plugin, spec)
    return BackendInfo(spec.name, "available", "", spec.priority, version, plugin, spec)


def _broken(name: str, plugin: str, detail: str) -> BackendInfo:
    warnings.warn(f"arnorm: backend plugin {plugin!r} is broken and was skipped: {detail}", ArnormWarning, 4)
    # A detail that already says what it needs ("... (needs another name)") is not told twice.
    reason = f"plugin: {detail}" if detail.endswith(")") and "(needs " in detail else (
        f"plugin: {detail} (needs a working plugin)")  # fmt: skip
    return BackendInfo(name, "broken", reason, None, None, plugin)


def _taken_entry_point(pm: pluggy.PluginManager, plugin: str, dist: str | None) -> str:
    """Why a foreign entry point may not load under its name (``""``: it may): the name of one of
    arnorm's built-in plugins, or of a plugin already loaded. pluggy would refuse the second
    registration, and the broken entry used to replace the built-in backend of that name."""
    if dist == CORE_DISTRIBUTION:
        return ""
    package = f"package {dist!r}" if dist else "a package of unknown name"
    if plugin in BUILTIN_NAMES:
        return (
            f"entry point {plugin!r} of {package} takes the name of arnorm's built-in plugin "
            "(needs another entry-point name)"
        )
    if pm.has_plugin(plugin):
        return (
            f"entry point {plugin!r} of {package} takes the name of a plugin already loaded "
            "(needs another entry-point name, or one of the two packages uninstalled)"
        )
    return ""


def _distribution(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return printable(name) if isinstance(name, str) else None


class Registry:
    """The backends known to this process, by name."""

    def __init__(self) -> None:
        self._infos: dict[str, BackendInfo] = {}
        self._core: set[str] = set()  # names registered by arnorm's own distribution
        self._contested: set[str] = set()  # names two plugins claimed: broken for good
        self._claims: dict[str, str] = {}  # name -> the plugins that claimed it, with their packages

    @classmethod
    def discover(cls) -> Registry:
        """Load every ``arnorm.backends`` entry point through pluggy and collect its specs.

        arnorm's own entry points load first, so a foreign plugin can never take a built-in name,
        whatever its entry point sorts as.
        """
        registry = cls()
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(BackendHookSpecs)
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        ordered = sorted(eps, key=lambda e: (_distribution(e) != CORE_DISTRIBUTION, e.name))
        timeout = discovery_timeout()
        for ep in ordered:
            # Printed by `arnorm backends`, in warnings and in every explanation: escaped.
            plugin, dist = printable(ep.name), _distribution(ep)
            taken = _taken_entry_point(pm, plugin, dist)
            if taken:
                registry._put(_broken(registry.free_name(plugin, dist), plugin, taken))
                continue
            try:
                status, got = import_bounded(ep.value.partition(":")[0].strip(), timeout)
                if status == "timeout":
                    registry._put(_broken(plugin, plugin, timed_out(timeout, "plugin module")))
                    continue
                if status == "raised":
                    raise got
                module = ep.load()  # imported above: only the attribute lookup is left
                pm.register(module, name=plugin)
                pm.check_pending()  # a marked hook arnorm does not define (arnorm_backend) is an error
                impls = [i for i in pm.hook.arnorm_backends.get_hookimpls() if i.plugin_name == plugin]
                if not impls:
                    msg = "defines no arnorm_backends() hook (needs @hookimpl def arnorm_backends())"
                    raise TypeError(msg)
            except BaseException as exc:  # a third-party plugin may raise anything
                detail = plugin_failure(exc)
                if pm.has_plugin(plugin):
                    pm.unregister(name=plugin)
                registry._put(_broken(registry.free_name(plugin, dist), plugin, detail))
                continue
            registry.add_from_hook(plugin, impls[0].function, dist)
        return registry

    def add_from_hook(self, plugin: str, hook: Any, distribution: str | None = None) -> None:
        """Call one plugin's ``arnorm_backends`` hook and register what it returns."""
        try:
            specs = hook()
            if not isinstance(specs, (list, tuple)) or not all(isinstance(s, BackendSpec) for s in specs):
                msg = f"arnorm_backends() returned {specs!r} (needs a list of arnorm.plugin.BackendSpec)"
                raise TypeError(msg)
        except BaseException as exc:  # see discover()
            self._put(_broken(plugin, plugin, plugin_failure(exc)))
            return
        for spec in specs:
            self.add(spec, plugin=plugin, distribution=distribution)

    def add(self, spec: BackendSpec, plugin: str = "<code>", distribution: str | None = None) -> None:
        """Register ``spec``. A built-in name claimed by a distribution other than arnorm is reported
        as broken under ``<name>@<plugin>``. A name two other plugins claim serves neither: which one
        loads first depends on how their entry points sort, so ``ARNORM_BACKEND=<name>`` could run
        the wrong package's code. The name is listed broken, with both plugins named."""
        known = self._infos.get(spec.name)
        if distribution is not None and distribution != CORE_DISTRIBUTION and spec.name in BUILTIN_NAMES:
            detail = f"name {spec.name!r} is reserved for arnorm's built-in backend (needs another name)"
            self._put(_broken(f"{spec.name}@{plugin}", plugin, detail))
            return
        if spec.name in self._core:
            owner = self._infos[spec.name].plugin
            detail = f"name {spec.name!r} is already registered by arnorm's own plugin {owner!r}"
            self._put(_broken(f"{spec.name}@{plugin}", plugin, detail))
            return
        who = repr(plugin) + (f" (package {distribution})" if distribution else "")
        if known is not None and (known.status != "broken" or spec.name in self._contested):
            plugins = self._claims.get(spec.name, repr(known.plugin)) + f" and {who}"
            self._claims[spec.name] = plugins
            self._contested.add(spec.name)
            reason = (
                f"name: {spec.name!r} claimed by plugins {plugins} (needs one plugin per name: uninstall one)"
            )
            warnings.warn(f"arnorm: backend {spec.name!r} is not used: {reason}", ArnormWarning, 3)
            self._put(BackendInfo(spec.name, "broken", reason, None, None, known.plugin))
            return
        if distribution == CORE_DISTRIBUTION:
            self._core.add(spec.name)
        self._claims[spec.name] = who
        self._put(_info_for(spec, plugin))

    def free_name(self, plugin: str, distribution: str | None) -> str:
        """The name a broken plugin is listed under: its entry point's, unless a backend (a
        built-in one, say) already holds that name, which a broken entry must never replace."""
        if plugin not in self._infos:
            return plugin
        return f"{plugin}@{distribution or 'unknown package'}"

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
    from arnorm.registry._probe import clear_probe_cache

    clear_probe_cache()
