"""Limits told up front (issue 41, item 7): an absurd ``hidden_size``, a ``peer_timeout`` too short
to agree within, and an ``out=`` buffer resized in place after its first use are refused with a
reason in arnorm's grammar naming the argument, not left to fail later with a raw error."""

from __future__ import annotations

import faults_edges as fe
import pytest
import torch

import arnorm
from arnorm.testing import run_ranks

H = 16


def _op(**kw) -> arnorm.AllReduceNorm:
    args = dict(hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=8, device="cpu")
    return arnorm.AllReduceNorm(arnorm.LOCAL, **{**args, "backend": "reference", **kw})


@pytest.mark.parametrize("hidden", [2**40, 2**21])
def test_an_absurd_hidden_size_is_refused_at_construction(hidden):
    with pytest.raises(arnorm.InvalidInputError, match=rf"^hidden_size: {hidden} \(needs an int from 1 to "):
        _op(hidden_size=hidden)


def test_the_widest_real_hidden_sizes_are_accepted():
    for hidden in (16384, 28672, 2**20):
        _op(hidden_size=hidden, max_tokens=1).close()


@pytest.mark.parametrize("value", ["0.0005", "0", "0.999"])
def test_a_peer_timeout_below_a_second_is_a_config_error(clean_env, value):
    clean_env.setenv("ARNORM_PEER_TIMEOUT", value)
    with pytest.raises(arnorm.ConfigError, match=rf"^ARNORM_PEER_TIMEOUT: '{value}' \(needs >= 1\)"):
        arnorm.Config()
    with pytest.raises(arnorm.ConfigError, match=r"^Config.peer_timeout: 0.5 \(needs >= 1\)"):
        arnorm.Config(peer_timeout=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("on", ["every rank", "rank 1"])
def test_a_too_short_peer_timeout_is_the_same_clear_error_on_every_rank_at_once(on):
    """ARNORM_PEER_TIMEOUT=0.0005 used to give one rank a raw DistStoreError while the other waited
    25-30 s in construction."""
    env = {"ARNORM_PEER_TIMEOUT": "0.0005"}
    envs = [env, env] if on == "every rank" else [{}, env]
    results = run_ranks(2, fe.build_twice, env=envs, timeout=60)
    for got in results:
        for outcome, waited in got:
            assert outcome[:2] == ("error", "ConfigError"), outcome
            assert "ARNORM_PEER_TIMEOUT: '0.0005' (needs >= 1)" in outcome[2], outcome
            assert waited < 10, got
    assert [o for o, _ in results[0]] == [o for o, _ in results[1]]


@pytest.mark.parametrize("shape", [(2, H), (4 * H,), (4, H // 2)], ids=["fewer-rows", "flat", "narrower"])
def test_an_out_buffer_resized_in_place_after_its_first_use_is_refused_naming_it(shape):
    op = _op(inplace=False)
    x, r, w = torch.randn(4, H), torch.randn(4, H), torch.rand(H)
    out = op.empty_output(4)
    op(x, r, w, out=out)
    out.normed.resize_(*shape)
    with pytest.raises(arnorm.InvalidInputError, match=r"^out.normed: shape "):
        op(x, r, w, out=out)
    # The op is not poisoned: a right-sized buffer works again.
    good = op.empty_output(4)
    got = op(x, r, w, out=good)
    assert got.normed is good.normed
    op.close()


def test_a_resized_out_is_refused_before_a_fast_path_writes_into_it(fastpath):
    """A backend writing through ``out``'s pointers (a fast path) never sees a
    buffer shrunk in place: it would write rows the caller no longer reads."""
    import fake_backends as fb

    op = arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=8,
        device="cpu", backend="fastpath", inplace=False,
    )  # fmt: skip
    x, r, w = torch.randn(4, H), torch.randn(4, H), torch.rand(H)
    out = op.empty_output(4)
    op(x, r, w, out=out)
    op(x, r, w, out=out)  # trusted now
    calls = len(fb.FastPathBackend.fast_calls)
    out.residual.resize_(2, H)
    with pytest.raises(arnorm.InvalidInputError, match=r"^out.residual: shape \[2, 16\] \(needs \[4, 16\]"):
        op(x, r, w, out=out)
    assert len(fb.FastPathBackend.fast_calls) == calls
    op.close()
