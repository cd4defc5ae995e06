"""``BackendSpec``: the cheap descriptor a plugin registers, and the pluggy markers."""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from arnorm._config import BackendSettings
from arnorm.registry._capabilities import Capabilities

if TYPE_CHECKING:
    from arnorm._protocol import FusedAllReduceNorm

__all__ = [
    "BUILTIN_NAMES",
    "NAME_PATTERN",
    "PROJECT",
    "BackendSpec",
    "check_protocol",
    "hookimpl",
    "hookspec",
    "priority_order",
]

#: The pluggy project name; the entry-point group is ``arnorm.backends``.
PROJECT = "arnorm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Backend names: a lower-case letter, then lower-case letters, digits or ``_``; at most 32.
#: (They become ``ARNORM_<NAME>_*`` variable prefixes and ``ARNORM_BACKEND`` values.)
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,31}")
#: Names only the ``arnorm`` distribution may register: a plugin claiming one is broken.
BUILTIN_NAMES = frozenset({"reference", "triton", "triton_symm", "flashinfer", "aiter"})
#: What every backend class must have, and whether it is called on the class (a classmethod).
_PROTOCOL: dict[str, bool] = {
    "probe": True,
    "create": True,
    "check_tokens": False,
    "__call__": False,
    "close": False,
}


def priority_order(priority: int | None, name: str) -> tuple[bool, int, str]:
    """The one order of backends: higher priority first, then name; unknown priority (broken) last."""
    return (priority is None, -(priority or 0), name)


def check_protocol(cls: object, name: str) -> list[str]:
    """How ``cls`` falls short of :class:`arnorm.FusedAllReduceNorm`, as reasons (empty: it conforms)."""
    if not isinstance(cls, type):
        return [f"loader: {type(cls).__name__} (needs a class)"]
    missing = [m for m in _PROTOCOL if not callable(getattr(cls, m, None))]
    reasons = [
        f"protocol: no {m}() (needs every method of arnorm.plugin.FusedAllReduceNorm)" for m in missing
    ]
    for method, on_class in _PROTOCOL.items():
        if (
            on_class
            and method not in missing
            and not any(isinstance(k.__dict__.get(method), classmethod) for k in cls.__mro__)
        ):
            reasons.append(f"protocol: {method}() is not a classmethod (needs @classmethod)")
    declared = getattr(cls, "name", None)
    if declared != name:
        reasons.append(f"protocol: class attribute name = {declared!r} (needs {name!r}, the registered name)")
    return reasons


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin tells arnorm about one backend, without importing anything heavy.

    - ``name``: matches :data:`NAME_PATTERN`; ``priority``: an int (higher is tried first).
    - ``capabilities``: the static check (:class:`arnorm.plugin.Capabilities`).
    - ``loader``: the backend class as ``"package.module:ClassName"``, imported only when probed.
    - ``requires``: top-level modules that must be importable (checked with
      ``importlib.util.find_spec``, nothing imported); when one is missing the backend is *not
      installed* and the fix is ``pip install 'arnorm[<extra>]'`` (or ``install_hint``).
    - ``distribution`` / ``min_version``: the package whose version ``arnorm backends`` shows, and
      the oldest version the backend accepts (older: status *outdated*, with the reason).
    - ``settings``: the backend's :class:`arnorm.plugin.BackendSettings` model (``ARNORM_<NAME>_*``).
    """

    name: str
    priority: int
    capabilities: Capabilities
    loader: str
    requires: tuple[str, ...] = ()
    extra: str | None = None
    distribution: str | None = None
    min_version: str | None = None
    install_hint: str | None = None
    description: str = ""
    settings: type[BackendSettings] | None = None
    _cls: list[Any] = field(default_factory=list, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        errors = []
        if not isinstance(self.name, str) or not NAME_PATTERN.fullmatch(self.name):
            errors.append(f"name: {self.name!r} (needs a lower-case letter, then a-z, 0-9 or _, 32 at most)")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            errors.append(f"priority: {self.priority!r} (needs an int)")
        if not isinstance(self.capabilities, Capabilities):
            errors.append(
                f"capabilities: {type(self.capabilities).__name__} (needs arnorm.plugin.Capabilities)"
            )
        if not isinstance(self.loader, str) or ":" not in self.loader:
            errors.append(f"loader: {self.loader!r} (needs 'package.module:ClassName')")
        if not isinstance(self.requires, tuple) or not all(isinstance(r, str) for r in self.requires):
            errors.append(f"requires: {self.requires!r} (needs a tuple of module names)")
        if self.settings is not None and not (
            isinstance(self.settings, type) and issubclass(self.settings, BackendSettings)
        ):
            errors.append(f"settings: {self.settings!r} (needs a subclass of arnorm.plugin.BackendSettings)")
        if errors:
            raise ValueError("; ".join(errors))

    def missing_requirements(self) -> tuple[str, ...]:
        """Top-level modules in ``requires`` that cannot be found (nothing is imported)."""
        return tuple(m for m in self.requires if importlib.util.find_spec(m) is None)

    def fix_hint(self) -> str:
        """The command that installs what is missing."""
        if self.install_hint:
            return self.install_hint
        if self.extra:
            return f"pip install 'arnorm[{self.extra}]'"
        return "pip install " + " ".join(self.requires)

    def load(self) -> type[FusedAllReduceNorm]:
        """Import and return the backend class (cached); may raise whatever the module raises.

        Raises ``TypeError`` when the class does not satisfy the protocol (a missing method is a
        broken plugin now, not an ``AttributeError`` at the first call).
        """
        if not self._cls:
            module_name, _, attr = self.loader.partition(":")
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
            reasons = check_protocol(obj, self.name)
            if reasons:
                raise TypeError("; ".join(reasons))
            self._cls.append(obj)
        return self._cls[0]


class BackendHookSpecs:
    """The hooks a plugin may implement."""

    @hookspec
    def arnorm_backends(self) -> list[BackendSpec]:  # type: ignore[empty-body]
        """Return the backends this plugin provides (cheap: no heavy imports here)."""
