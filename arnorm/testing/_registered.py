"""Backends registered in code, for one ``with`` block: a backend under test or a benchmark's stub
runs through discovery, selection and the op like an installed plugin, without being installed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from arnorm.registry._discovery import Registry, get_registry, reset_registry
from arnorm.registry._spec import BackendSpec


@contextlib.contextmanager
def registered(*specs: BackendSpec) -> Iterator[None]:
    """Register ``specs`` beside the installed backends for the block, in this process only
    (processes it spawns discover the installed ones); the registry before it comes back after,
    exception or not. Each spec's ``loader`` must be importable, as an entry point's would be."""
    before = get_registry()
    registry = Registry.discover()
    for spec in specs:
        if not isinstance(spec, BackendSpec):
            raise TypeError(f"specs: {type(spec).__name__} (needs arnorm.plugin.BackendSpec)")
        registry.add(spec, plugin="<code>")
    reset_registry(registry)
    try:
        yield
    finally:
        reset_registry(before)
