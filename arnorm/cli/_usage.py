"""The CLI's one error type, apart so that every command module can raise it without importing the others."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """A mistake in the command line that argparse cannot see (e.g. a device that is not there)."""
