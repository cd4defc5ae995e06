"""The fault rows that do not depend on a gloo data path, on 2 GPUs with NCCL: construction's
agreement goes through the store whatever the device group, so these end the same way there."""

from __future__ import annotations

import faults_fixtures as ff
import pytest
from test_faults_ranks import CHECKED, ENV, RUN_S

from arnorm.testing import run_ranks

pytestmark = [pytest.mark.multigpu, pytest.mark.slow]
GPU = {**ENV, "FAULTS_DEVICE": "cuda"}


@pytest.mark.parametrize("where", ["probe", "_build"])
def test_a_keyboard_interrupt_in_construction_on_nccl(where):
    results = run_ranks(2, ff.interrupted_construction, where, backend="nccl", env=GPU, timeout=RUN_S)
    assert results[1][0] == ("interrupted",)
    assert results[0][0][:2] == ("error", "PeerError") and "KeyboardInterrupt" in results[0][0][2]
    for got in results:
        assert got[1:] == [("ok", True), ("ok", True)], got


def test_a_rank_stalled_before_construction_on_nccl():
    results = run_ranks(2, ff.stall_in_construction, 7.0, backend="nccl", env=GPU, timeout=RUN_S)
    got, waited = results[0]
    assert got[:2] == ("error", "PeerError") and "rank 1" in got[2], got
    assert waited < 6.5


def test_different_group_objects_on_nccl():
    results = run_ranks(2, ff.different_group_objects, backend="nccl", env=GPU, timeout=RUN_S)
    (got0, _), (got1, _) = results
    assert got0 == got1 and got0[:2] == ("error", "InvalidInputError") and "tp_group" in got0[2]


def test_two_ops_two_threads_on_nccl():
    results = run_ranks(2, ff.two_ops_two_threads, 5, backend="nccl", env=GPU, timeout=RUN_S)
    errors = [o for r in results for calls in r for o in calls]
    assert errors and all(o[1] == "InvalidInputError" and "thread" in o[2] for o in errors), errors


def test_fused_over_budget_with_check_calls_on_nccl():
    env = {**CHECKED, "FAULTS_DEVICE": "cuda"}
    results = run_ranks(2, ff.fused_over_budget_on_one_rank, backend="nccl", env=env, timeout=RUN_S)
    for got in results:
        assert got[0] == ("ok", True)
        assert got[1][:2] == ("error", "InvalidInputError") and "calls: differ across ranks" in got[1][2]
        assert got[2:] == [("ok", True), ("ok", True)], got
