"""A backend module that fails the way a stale binary build does: on import."""

raise ImportError("arnorm_conformance_fixtures: compiled for another torch")
