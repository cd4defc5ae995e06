"""Rank side of the disagreement attacks: ARNORM_* settings, plugins and constructor arguments that
differ between ranks. Every scenario builds one op on its group and returns ``("ok", (chain,
explanation text, next call paired))`` or ``("error", type, message)``; the tests want one outcome
on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

import arnorm

import fake_backends
from ranks_fixtures import attempt
from relia_harness import Ctx

H, T, MAX_TOKENS = 32, 4, 8
#: The op every scenario builds unless it says otherwise (CPU tensors, also on a GPU host).
OP_ARGS: dict[str, Any] = dict(
    hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=MAX_TOKENS, device="cpu"
)


def _paired(ctx: Ctx, op: arnorm.AllReduceNorm) -> bool:
    """One call on every rank with rank-dependent partials: the residual is their sum plus residual."""
    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(T, H, generator=g) for _ in range(ctx.world)]
    res, w = torch.randn(T, H, generator=g), torch.ones(H)
    scale = torch.tensor([0.05]) if op.problem.quant in ("fp8_static", "nvfp4") else None
    out = op(parts[ctx.rank].clone(), res, w, scale)
    return torch.allclose(out.residual, sum(parts) + res, atol=1e-5)


def build(ctx: Ctx, env: dict[int, dict[str, str]] | None = None, **kw: Any) -> tuple:
    """Set this rank's part of ``env``, build an op on the scenario's group, call it once, close it."""
    os.environ.update((env or {}).get(ctx.rank, {}))
    args = {**OP_ARGS, **kw}

    def run() -> tuple:
        with arnorm.AllReduceNorm(ctx.group, **args) as op:
            expl = op.explain()
            return expl.chain, str(expl), _paired(ctx, op)

    return attempt(run)


def on_last(ctx: Ctx, **env: str) -> dict[int, dict[str, str]]:
    return {ctx.last: env}


def _default(ctx: Ctx, env: dict[int, dict[str, str]] | None = None, **kw: Any) -> tuple:
    """reference + fast (50, every count) + small (60, at most 4 tokens)."""
    fake_backends.install_default()
    return build(ctx, env, **kw)


def _with_settings(ctx: Ctx, env: dict[int, dict[str, str]]) -> tuple:
    fake_backends.install(
        fake_backends.spec("fast", 50, "AllReduceBackend", settings=fake_backends.FastSettings)
    )
    return build(ctx, env)


def _fast_on_rank_0(ctx: Ctx, **kw: Any) -> tuple:
    """Plugins differ by rank: 'fast' is installed on rank 0 only."""
    if ctx.rank == 0:
        fake_backends.install(fake_backends.spec("fast", 50, "AllReduceBackend"))
    else:
        fake_backends.install()
    return build(ctx, **kw)


def _arg_on_last(ctx: Ctx, common: dict[str, Any] | None = None, **bad: Any) -> tuple:
    fake_backends.install_default()
    return build(ctx, **{**(common or {}), **(bad if ctx.rank == ctx.last else {})})


SCENARIOS: dict[str, Callable[[Ctx], Any]] = {
    # ARNORM_DISABLE may differ: the eligibility AND absorbs it.
    "disable_on_last": lambda c: _default(c, on_last(c, ARNORM_DISABLE="small")),
    "disable_on_two": lambda c: _default(
        c, {0: {"ARNORM_DISABLE": "fast"}, c.last: {"ARNORM_DISABLE": "small"}}
    ),
    # ARNORM_BACKEND must agree.
    "backend_same": lambda c: _default(c, {r: {"ARNORM_BACKEND": "fast"} for r in range(c.world)}),
    "backend_on_last": lambda c: _default(c, on_last(c, ARNORM_BACKEND="reference")),
    "backend_differs": lambda c: _default(
        c, {r: {"ARNORM_BACKEND": "fast" if r == 0 else "reference"} for r in range(c.world)}
    ),
    "backend_order_differs": lambda c: _default(
        c, {r: {"ARNORM_BACKEND": "fast,reference" if r else "reference,fast"} for r in range(c.world)}
    ),
    # Core settings: malformed on one rank, or valid but different.
    "probe_timeout_abc_on_0": lambda c: _default(c, {0: {"ARNORM_PROBE_TIMEOUT": "abc"}}),
    "probe_timeout_nan_on_last": lambda c: _default(c, on_last(c, ARNORM_PROBE_TIMEOUT="nan")),
    "probe_timeout_differs": lambda c: _default(c, on_last(c, ARNORM_PROBE_TIMEOUT="5")),
    "check_calls_on_last": lambda c: _default(c, on_last(c, ARNORM_CHECK_CALLS="1")),
    "check_calls_malformed": lambda c: _default(c, on_last(c, ARNORM_CHECK_CALLS="maybe")),
    # A backend's own setting.
    "setting_differs": lambda c: _with_settings(c, on_last(c, ARNORM_FAST_EXACT="1")),
    "setting_malformed": lambda c: _with_settings(c, on_last(c, ARNORM_FAST_EXACT="perhaps")),
    # Installed plugins differ.
    "plugin_on_0_auto": lambda c: _fast_on_rank_0(c),
    "plugin_on_0_strict": lambda c: _fast_on_rank_0(c, backend="fast"),
    # Constructor arguments wrong or different on one rank.
    "hidden_zero_on_last": lambda c: _arg_on_last(c, hidden_size=0),
    "norm_wrong_on_last": lambda c: _arg_on_last(c, norm="rms"),
    "backend_arg_wrong_on_last": lambda c: _arg_on_last(c, backend=123),
    "config_dict_on_last": lambda c: _arg_on_last(c, config={"backend": "fast"}),
    "max_tokens_differ": lambda c: _arg_on_last(c, max_tokens=16),
    "quant_differs": lambda c: _arg_on_last(c, quant="fp8_per_token"),
    "layout_wrong_on_last": lambda c: _arg_on_last(c, {"quant": "mxfp8"}, scale_layout="tiled"),
    "device_meta_on_last": lambda c: _arg_on_last(c, device="meta"),
}

#: Scenarios that leave ranks waiting today (their group times out quickly).
SHORT: tuple[str, ...] = ()  # none known to hang since the core fixes of 2026-12-03
