"""Test support for arnorm and for backend authors: run code on several ranks, compare with the reference."""

from arnorm.testing._ranks import RankError, run_ranks

__all__ = ["ConformanceSuite", "RankError", "run_ranks"]


def __getattr__(name: str) -> object:
    # The suite imports pytest; load it only for test code that asks for it.
    if name == "ConformanceSuite":
        from arnorm.testing.conformance import ConformanceSuite

        return ConformanceSuite
    raise AttributeError(name)
