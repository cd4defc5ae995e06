"""Test support for arnorm and for backend authors: run code on several ranks, compare with the reference."""

from arnorm.testing._ranks import RankError, run_ranks

__all__ = ["RankError", "run_ranks"]
