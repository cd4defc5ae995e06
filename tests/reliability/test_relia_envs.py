"""Ranks that disagree (ARNORM_* settings, installed plugins, constructor arguments) on 2 and 4 gloo
ranks: every rank ends with the same choice or raises the same error, none is left waiting."""

from __future__ import annotations

import re

import pytest

import relia_harness as harness

pytestmark = pytest.mark.slow

WORLDS = (2, 4)
AGREE = "(needs the same arguments, ARNORM_* settings and Config on every rank)"


#: scenario -> (outcome kind, expected): "chain" wants the same chain everywhere and the regex in the
#: explanation; "error" wants the same (type, message regex) everywhere. {last} is the last rank.
EXPECT: dict[str, tuple[str, tuple]] = {
    "disable_on_last": ("chain", (("fast",), r"small +60 +disabled +rank {last}: disabled: listed in")),
    "disable_on_two": ("chain", (("reference",), r"fast +50 +disabled +rank 0: disabled")),
    "backend_same": ("chain", (("fast",), r"choice: ARNORM_BACKEND")),
    "backend_on_last": ("error", ("InvalidInputError", r"^ranks disagree on backend preference")),
    "backend_differs": ("error", ("InvalidInputError", r"^ranks disagree on backend preference")),
    "backend_order_differs": ("error", ("InvalidInputError", r"^ranks disagree on backend preference")),
    "probe_timeout_abc_on_0": ("error", ("ConfigError", r"^rank 0: ARNORM_PROBE_TIMEOUT: 'abc'")),
    "probe_timeout_nan_on_last": ("error", ("ConfigError", r"^rank {last}: ARNORM_PROBE_TIMEOUT: 'nan'")),
    "probe_timeout_differs": ("error", ("InvalidInputError", r"^ranks disagree on Config.probe_timeout")),
    "check_calls_on_last": ("error", ("InvalidInputError", r"^ranks disagree on Config.check_calls")),
    "check_calls_malformed": ("error", ("ConfigError", r"^rank {last}: ARNORM_CHECK_CALLS: 'maybe'")),
    "setting_differs": (
        "error",
        ("InvalidInputError", r"^ranks disagree on (installed backends, )?settings of fast"),
    ),
    "setting_malformed": ("error", ("ConfigError", r"^rank {last}: ARNORM_FAST_EXACT: 'perhaps'")),
    # A plugin installed on rank 0 only: auto mode leaves it out on every rank (its merged verdict
    # names the ranks without it) and agrees on the rest; a strict request for it fails everywhere.
    "plugin_on_0_auto": (
        "chain",
        (("reference",), r"fast +50 +unknown +rank 1: registry: not registered on this rank"),
    ),
    "plugin_on_0_strict": (
        "error",
        ("BackendNotInstalledError", r"rank 1: registry: no backend named 'fast' \(needs one of reference\)"),
    ),
    "hidden_zero_on_last": ("error", ("InvalidInputError", r"^rank {last}: hidden_size: 0 \(needs")),
    "norm_wrong_on_last": ("error", ("InvalidInputError", r"^rank {last}: norm: str \(needs")),
    "backend_arg_wrong_on_last": ("error", ("InvalidInputError", r"^rank {last}: backend: 123 \(needs")),
    "config_dict_on_last": ("error", ("InvalidInputError", r"^rank {last}: config: dict \(needs")),
    "max_tokens_differ": ("error", ("InvalidInputError", r"^ranks disagree on max_tokens")),
    "quant_differs": ("error", ("InvalidInputError", r"^ranks disagree on quant")),
    "layout_wrong_on_last": ("error", ("InvalidInputError", r"^rank {last}: layout: 'tiled' \(needs")),
    "device_meta_on_last": ("error", ("InvalidInputError", r"device: meta \(needs cpu or cuda\)")),
}


def _params() -> list:
    out = []
    for name in EXPECT:
        out.append(pytest.param(name, id=name))
    return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", _params())
def test_disagreeing_ranks_end_the_same_way(world, name):
    """One outcome on every rank: the same agreed choice, or the same error naming what differs."""
    kind, expected = EXPECT[name]
    outcome = harness.same_everywhere(harness.outcomes(world, "relia_envs", name))
    if kind == "chain":
        chain, pattern = expected
        assert outcome[0] == "ok", outcome
        got_chain, text, paired = outcome[1]
        assert got_chain == chain and paired is True, outcome
        assert re.search(pattern.format(last=world - 1), text), text
    else:
        error, pattern = expected
        assert outcome[:2] == ("error", error), outcome
        assert re.search(pattern.format(last=world - 1), outcome[2]), outcome[2]
        if "disagree" in pattern:
            assert outcome[2].endswith(AGREE), outcome[2]
