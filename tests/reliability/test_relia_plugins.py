"""Misbehaving plugins on 2 and 4 gloo ranks (one rank or all): a probe that exits, returns garbage or
does not answer, an import that exits, create / check_tokens / close that raise. Each ends with the
same outcome on every rank: the plugin is rejected with its reason and the next backend serves, or
(when named strictly) the same error everywhere."""

from __future__ import annotations

import pytest

import relia_harness as harness

pytestmark = pytest.mark.slow

WORLDS = (2, 4)

#: Auto mode: scenario -> (verdict status, reason start, whose reason: "one" is prefixed with the
#: misbehaving rank, "all" and "none" are not).
AUTO: dict[str, tuple[str, str, str]] = {
    "probe_exit_one": ("broken", "probe: raised SystemExit: 3 ", "one"),
    "probe_exit_all": ("broken", "probe: raised SystemExit: 3 ", "all"),
    "probe_none_one": ("broken", "probe: raised TypeError: 'NoneType' object is not iterable", "one"),
    "probe_str_one": ("broken", "probe: raised TypeError: probe returned 'topology: no NVLink", "one"),
    "probe_ints_one": ("broken", "probe: raised TypeError: probe returned [1, 2] ", "one"),
    "probe_generator_one": ("incompatible", "topology: no NVLink (needs P2P access", "one"),
    "probe_slow_one": ("broken", "probe: no answer in 0.3 s (needs a probe that returns within", "one"),
    "probe_slow_all": ("broken", "probe: no answer in 0.3 s (needs a probe that returns within", "all"),
    "import_exit_one": ("broken", "import: SystemExit: no driver on this rank (needs a working", "one"),
    "create_exit_one": ("setup_failed", "setup: SystemExit: workspace (needs a successful", "one"),
    "create_none_one": ("setup_failed", "setup: create() returned None (needs the backend instance)", "one"),
    "create_none_all": ("setup_failed", "setup: create() returned None (needs the backend instance)", "all"),
    "tokens_exit_one": ("setup_failed", "check_tokens: raised SystemExit: budget (needs", "one"),
    "tokens_and_close_raise": ("setup_failed", "check_tokens: raised SystemExit: budget (needs", "one"),
}
#: Strict mode: scenario -> (error type, message start).
STRICT: dict[str, tuple[str, str]] = {
    "probe_exit_strict": ("BackendBrokenError", "backend 'exitprobe' (from argument) cannot serve"),
    "create_exit_strict": ("BackendSetupError", "backend 'exitcreate' (from argument) cannot serve"),
    "tokens_exit_strict": ("BackendSetupError", "backend 'exittokens' (from argument) cannot serve"),
}
XFAILS: dict[str, str] = {}


def _params(names) -> list:
    return [
        pytest.param(n, id=n, marks=[pytest.mark.xfail(strict=True, reason=XFAILS[n])] if n in XFAILS else [])
        for n in names
    ]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", _params(AUTO))
def test_a_misbehaving_plugin_is_rejected_the_same_way_on_every_rank(world, name):
    """Auto mode: the plugin gets one verdict with the misbehaving rank's reason; 'fast' serves everywhere."""
    status, reason, who = AUTO[name]
    outcome = harness.same_everywhere(harness.outcomes(world, "relia_plugins", name))
    assert outcome[0] == "ok", outcome
    chain, (got_status, reasons), paired = outcome[1]
    assert chain == ("fast",) and paired is True, outcome
    assert got_status == status, (got_status, reasons)
    prefix = {"one": f"rank {world - 1}: ", "all": "", "none": ""}[who]
    assert len(reasons) == 1 and reasons[0].startswith(prefix + reason), reasons


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", _params(STRICT))
def test_a_strictly_named_misbehaving_plugin_is_the_same_error_everywhere(world, name):
    """Named by the user, a plugin misbehaving on one rank raises the same selection error on all ranks."""
    error, start = STRICT[name]
    outcome = harness.same_everywhere(harness.outcomes(world, "relia_plugins", name))
    assert outcome[:2] == ("error", error), outcome
    assert outcome[2].startswith(start) and f"rank {world - 1}: " in outcome[2], outcome[2]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("name", "warned_ranks"), [("close_raises_one", "last"), ("close_exits_all", "all")])
def test_close_raising_warns_and_closes_the_op_on_every_rank(world, name, warned_ranks):
    """close() raising (SystemExit too) warns where it raised; the op is closed everywhere, ranks in step."""
    results = harness.outcomes(world, "relia_plugins", name)
    for rank, (closed, warned, after, paired) in enumerate(results):
        assert closed == ("ok", None), closed
        assert warned == (warned_ranks == "all" or rank == world - 1), (rank, warned)
        assert after == ("error", "InvalidInputError", "op: closed (needs a new arnorm.AllReduceNorm)")
        assert paired is True
