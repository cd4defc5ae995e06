"""The exception hierarchy.

Every arnorm error derives from :class:`ArnormError` and from the built-in exception a caller would
naturally catch, so ``except ValueError`` keeps working for bad input::

    ArnormError
    ├── InvalidInputError          (ValueError)    bad arguments to a call or a constructor
    ├── ConfigError                (ValueError)    a Config field or ARNORM_* variable is malformed
    ├── InferenceOnlyError         (RuntimeError)  a backward pass reached the op
    ├── PeerError                  (RuntimeError)  another rank failed, stalled or diverged: the op
    │   │                                          is unusable on every rank (build a new one)
    │   └── StoreLostError                         the process group's c10d store is gone (its host
    │                                              died): no op can be built or agree on that group
    └── SelectionError                             no backend could be chosen; carries .explanation
        ├── BackendNotInstalledError (ImportError)   a named backend is missing, unknown or too old
        ├── BackendBrokenError       (ImportError)   a named backend's plugin raised or misbehaved
        ├── BackendSetupError        (RuntimeError)  a backend failed while building its workspace
        └── NoEligibleBackendError   (RuntimeError)  no backend can serve the problem on every rank

Selection errors are raised identically on every rank, and their ``explanation`` is the
:class:`arnorm.Explanation` whose verdicts say, as data, why each backend was not used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from arnorm.registry._explain import Explanation

__all__ = [
    "ArnormError",
    "ArnormWarning",
    "BackendBrokenError",
    "BackendNotInstalledError",
    "BackendSetupError",
    "ConfigError",
    "InferenceOnlyError",
    "InvalidInputError",
    "NoEligibleBackendError",
    "PeerError",
    "SelectionError",
    "StoreLostError",
]


class ArnormError(Exception):
    """Base class of every error arnorm raises on purpose."""


class InvalidInputError(ArnormError, ValueError):
    """An argument has the wrong shape, dtype, device, layout or value."""


class ConfigError(ArnormError, ValueError):
    """A configuration value (a ``Config`` field or an ``ARNORM_*`` variable) is malformed."""


class InferenceOnlyError(ArnormError, RuntimeError):
    """A backward pass reached an arnorm op, which computes no gradients."""


class PeerError(ArnormError, RuntimeError):
    """Another rank of the op's group failed part-way through a call, stalled past
    ``Config.peer_timeout``, forked, or built ops in a different order. Like an aborted NCCL
    communicator, the op is unusable afterwards on every rank: close it and build a new one
    (docs/troubleshooting.md, "When a rank fails")."""


class StoreLostError(PeerError):
    """The process group's c10d store stopped answering: the process hosting it (rank 0 of the
    job, unless the engine passed a store of its own) died or closed it. Ops agree through that
    store, so none can be built on a group over it, nor called in ``ARNORM_CHECK_CALLS`` mode:
    restart the job, or ``destroy_process_group()`` and ``init_process_group()`` again on every
    rank (docs/troubleshooting.md, "When a rank fails")."""


class SelectionError(ArnormError):
    """No backend could be chosen; ``explanation`` holds every backend's verdict."""

    def __init__(self, message: str, explanation: Explanation | None = None) -> None:
        super().__init__(message)
        self.explanation = explanation

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the explanation when the error crosses a process boundary (spawned test ranks).
        return (type(self), (str(self), self.explanation))


class BackendNotInstalledError(SelectionError, ImportError):
    """A backend named by the user is not installed, not registered, or installed too old."""


class BackendBrokenError(SelectionError, ImportError):
    """A backend named by the user has a plugin that raised or broke the protocol."""


class BackendSetupError(SelectionError, RuntimeError):
    """A backend passed its checks but failed while building its workspace."""


class NoEligibleBackendError(SelectionError, RuntimeError):
    """No backend can serve the problem on every rank; the message lists each one's reasons."""


class ArnormWarning(UserWarning):
    """Something is wrong with a plugin or a setting; arnorm carries on without it."""
