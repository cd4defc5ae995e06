"""Faults at the edges of the store and of subgroups (issue 41, items 5, 10 and 13): the store
host going away, timeouts on a subgroup naming global ranks, and the store's key count over
many ops. Each test runs 2-4 gloo ranks under ``run_ranks``'s timeout."""

from __future__ import annotations

import faults_edges as fe
import pytest

from arnorm.testing import run_ranks

pytestmark = pytest.mark.slow

ENV = {"ARNORM_PEER_TIMEOUT": "3"}


def test_the_store_keeps_no_keys_of_ops_every_rank_closed_or_dropped():
    """1,000 ops built and closed (or dropped) used to leave 4 keys each in the c10d store."""
    results = run_ranks(2, fe.store_keys_over_ops, 1000, 100, env=ENV, timeout=300)
    for outcomes, before, after in results:
        assert outcomes == [("ok", True)], outcomes
        assert after <= before + 2, (before, after)
