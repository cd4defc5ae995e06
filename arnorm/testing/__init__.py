"""Test support for arnorm and for backend authors: run code on several ranks, compare with the reference.

- :func:`run_ranks` runs a function on N fresh processes joined in one torch.distributed group
  (gloo on CPU); a rank that fails ends the run within seconds with its traceback.
- :func:`ulps` / :func:`ulp_distance`: elementwise / largest distance in units in the last place.
- :func:`registered` registers backends given as ``BackendSpec`` for one ``with`` block, in this
  process, beside the installed ones: a backend runs through selection and the op uninstalled.
- :class:`ConformanceSuite` (needs pytest: ``pip install 'arnorm[test]'``) checks a backend
  against the numerics contract; subclass it and set ``backend``.

Timeouts are arguments (``run_ranks(..., timeout=)``, ``ConformanceSuite.timeout``); no
environment variable changes them.
"""

from arnorm.testing._compare import ulp_distance, ulps
from arnorm.testing._ranks import RankError, run_ranks
from arnorm.testing._registered import registered

__all__ = ["ConformanceSuite", "RankError", "registered", "run_ranks", "ulp_distance", "ulps"]


def __getattr__(name: str) -> object:
    # The suite imports pytest; load it only for test code that asks for it.
    if name == "ConformanceSuite":
        try:
            from arnorm.testing.conformance import ConformanceSuite
        except ModuleNotFoundError as exc:
            if exc.name != "pytest":
                raise
            msg = (
                "arnorm.testing.ConformanceSuite: pytest is not installed (needs pip install 'arnorm[test]')"
            )
            raise ImportError(msg) from exc
        return ConformanceSuite
    raise AttributeError(f"module 'arnorm.testing' has no attribute {name!r}")
