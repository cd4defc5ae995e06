"""``BackendSpec``: the cheap descriptor a plugin registers, and the pluggy markers."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from arnorm._capabilities import Capabilities

if TYPE_CHECKING:
    from arnorm._protocol import FusedAllReduceNorm

__all__ = ["PROJECT", "BackendSpec", "hookimpl", "hookspec", "priority_order"]

#: The pluggy project name; the entry-point group is ``arnorm.backends``.
PROJECT = "arnorm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


def priority_order(priority: int | None, name: str) -> tuple[bool, int, str]:
    """The one order of backends: higher priority first, then name; unknown priority (broken) last."""
    return (priority is None, -(priority or 0), name)


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin tells arnorm about one backend, without importing anything heavy.

    ``loader`` names the backend class as ``"package.module:ClassName"``; it is imported only when
    the backend is probed. ``requires`` lists top-level modules that must be importable (checked
    with ``importlib.util.find_spec``, which does not import them); when one is missing the backend
    is *not installed* and the fix is ``pip install 'arnorm[<extra>]'`` (or ``install_hint``).
    ``distribution`` names the package whose version ``arnorm backends`` shows.
    """

    name: str
    priority: int
    capabilities: Capabilities
    loader: str
    requires: tuple[str, ...] = ()
    extra: str | None = None
    distribution: str | None = None
    install_hint: str | None = None
    description: str = ""
    _cls: list[Any] = field(default_factory=list, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            msg = f"name: {self.name!r} (needs letters, digits, '_' or '-')"
            raise ValueError(msg)
        if ":" not in self.loader:
            msg = f"loader: {self.loader!r} (needs 'package.module:ClassName')"
            raise ValueError(msg)

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
        """Import and return the backend class (cached); may raise whatever the module raises."""
        if not self._cls:
            module_name, _, attr = self.loader.partition(":")
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
            self._cls.append(obj)
        return self._cls[0]


class BackendHookSpecs:
    """The hooks a plugin may implement."""

    @hookspec
    def arnorm_backends(self) -> list[BackendSpec]:  # type: ignore[empty-body]
        """Return the backends this plugin provides (cheap: no heavy imports here)."""
