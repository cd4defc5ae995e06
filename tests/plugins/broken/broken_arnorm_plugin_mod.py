"""A plugin module that fails the way a stale binary build does: on import."""

raise ImportError("compiled for another torch")
