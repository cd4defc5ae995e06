"""The exception hierarchy.

Every arnorm error derives from :class:`ArnormError` and from the built-in exception a caller would
naturally catch, so ``except ValueError`` keeps working for bad input::

    ArnormError
    ├── InvalidInputError          (ValueError)    bad arguments to a call or a constructor
    ├── ConfigError                (ValueError)    a Config field or ARNORM_* variable is malformed
    ├── BackendNotInstalledError   (ImportError)   a named backend's extra is not installed
    ├── BackendBrokenError         (ImportError)   a plugin raised while loading
    └── NoEligibleBackendError     (RuntimeError)  no backend can serve the problem on every rank
        └── (raised identically on every rank, with every rank's reasons)
    └── BackendSetupError          (RuntimeError)  a backend failed while building its workspace
"""

from __future__ import annotations

__all__ = [
    "ArnormError",
    "BackendBrokenError",
    "BackendNotInstalledError",
    "BackendSetupError",
    "ConfigError",
    "InvalidInputError",
    "NoEligibleBackendError",
]


class ArnormError(Exception):
    """Base class of every error arnorm raises on purpose."""


class InvalidInputError(ArnormError, ValueError):
    """An argument has the wrong shape, dtype, device, layout or value."""


class ConfigError(ArnormError, ValueError):
    """A configuration value (a ``Config`` field or an ``ARNORM_*`` variable) is malformed."""


class BackendNotInstalledError(ArnormError, ImportError):
    """A backend was requested by name but its extra is not installed."""


class BackendBrokenError(ArnormError, ImportError):
    """A backend plugin raised while its descriptor or its module was loaded."""


class NoEligibleBackendError(ArnormError, RuntimeError):
    """No backend can serve the problem on every rank; the message lists each one's reasons."""


class BackendSetupError(ArnormError, RuntimeError):
    """A backend passed its checks but failed while building its workspace."""
