"""Rank side of the bad-input attacks: every bad call argument on every rank, or on one rank only.

Modes (the scenario name is ``<mode>:<kind>``):

- ``all``: every rank passes the bad argument; no check mode.
- ``one_checked``: the last rank alone passes it, every rank calls, ``ARNORM_CHECK_CALLS`` is on.
- ``one_unchecked``: the last rank alone calls, with the bad argument; the others do not call.
  The rejection fills the slot of the collective it would have made (what tells ranks that did
  make the call, ``shift_without_check``), so the next good call raises PeerError everywhere.

Each scenario returns ``(call outcome, inputs unchanged, next good call paired)``; the last says
whether the op's next collective pairs the same call on every rank (``True``), or how it failed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

import arnorm
from arnorm._reference import add_rmsnorm, rank_order_sum

from ranks_fixtures import attempt
from relia_harness import Ctx

H, T, MAX_TOKENS = 32, 4, 8
EPS = 1e-6


def _data(ctx: Ctx, seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every rank's partial, and the residual and weight all ranks share (the same seed everywhere)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(T, H, generator=g) for _ in range(ctx.world)]
    return parts, torch.randn(T, H, generator=g), torch.randn(H, generator=g) * 0.1 + 1


def _op(ctx: Ctx, quant: str | None, checked: bool) -> arnorm.AllReduceNorm:
    if checked:
        os.environ["ARNORM_CHECK_CALLS"] = "1"  # the harness restores the environment afterwards
    return arnorm.AllReduceNorm(
        ctx.group,
        hidden_size=H,
        dtype=torch.float32,
        norm=arnorm.RMSNorm(EPS),
        quant=quant,
        max_tokens=MAX_TOKENS,
        backend="reference",
        device="cpu",
    )


def _scale(quant: str | None) -> torch.Tensor | None:
    return torch.tensor([0.02]) if quant == "fp8_static" else None


def _overlapping(x, r, w, s):
    buf = torch.zeros(2 * T, H)
    buf[:T] = x
    return (buf[:T], buf.view(-1)[H // 2 : H // 2 + T * H].view(T, H), w, s)


def _leaf(x, r, w, s):
    return (x.requires_grad_(), r, w, s)


def _swap(x, r, w, s):
    w.data = torch.randn(H // 2)  # after a first good call that made the op trust w
    return (x, r, w, s)


#: kind -> (the op's quant, bad arguments from the good ones, what the rejection names first).
KINDS: dict[str, tuple[str | None, Callable[..., tuple], str]] = {
    "hs_dtype": (None, lambda x, r, w, s: (x.double(), r, w, s), "hidden_states: dtype torch.float64"),
    "res_dtype": (None, lambda x, r, w, s: (x, r.half(), w, s), "residual: dtype torch.float16"),
    "hs_shape": (None, lambda x, r, w, s: (x[:, :16], r, w, s), "hidden_states: shape [4, 16]"),
    "res_shape": (None, lambda x, r, w, s: (x, r[:2], w, s), "residual: shape [2, 32]"),
    "too_many_tokens": (
        None,
        lambda x, r, w, s: (torch.randn(9, H), torch.randn(9, H), w, s),
        "hidden_states: 9 tokens",
    ),
    "zero_tokens": (None, lambda x, r, w, s: (x[:0], r[:0], w, s), "hidden_states: 0 tokens"),
    "transposed": (None, lambda x, r, w, s: (x.t().contiguous().t(), r, w, s), "hidden_states: strides"),
    "res_is_hs": (None, lambda x, r, w, s: (x, x, w, s), "residual: overlaps hidden_states' memory"),
    "res_view_of_hs": (
        None,
        lambda x, r, w, s: (x, x.view(T, H), w, s),
        "residual: overlaps hidden_states' memory",
    ),
    "res_half_overlap": (None, _overlapping, "residual: overlaps hidden_states' memory"),
    "w_none": (None, lambda x, r, w, s: (x, r, None, s), "weight: NoneType"),
    "w_shape": (None, lambda x, r, w, s: (x, r, w[:16], s), "weight: shape [16]"),
    "w_in_hs": (None, lambda x, r, w, s: (x, r, x[1], s), "weight: overlaps hidden_states' memory"),
    "w_swapped": (None, _swap, "weight: shape [16]"),
    "scale_extra": (None, lambda x, r, w, s: (x, r, w, torch.ones(1)), "scale: Tensor (needs None"),
    "scale_missing": ("fp8_static", lambda x, r, w, s: (x, r, w, None), "scale: missing"),
    "scale_dtype": ("fp8_static", lambda x, r, w, s: (x, r, w, s.double()), "scale: dtype torch.float64"),
    "scale_shape": ("fp8_static", lambda x, r, w, s: (x, r, w, s.expand(2)), "scale: shape [2]"),
    "scale_in_hs": (
        "fp8_static",
        lambda x, r, w, s: (x, r, w, x.view(-1)[:1]),
        "scale: overlaps hidden_states' memory",
    ),
    "meta": (
        None,
        lambda x, r, w, s: (torch.empty(T, H, device="meta"), r, w, s),
        "hidden_states: device meta",
    ),
    "leaf_grad": (None, _leaf, "hidden_states: a leaf tensor that requires grad"),
    "not_tensor": (None, lambda x, r, w, s: (x.tolist(), r, w, s), "hidden_states: list"),
    "sparse_coo": (None, lambda x, r, w, s: (x.to_sparse(), r, w, s), "hidden_states: "),
    "sparse_csr": (None, lambda x, r, w, s: (x.to_sparse_csr(), r, w, s), "hidden_states: "),
    "mkldnn": (None, lambda x, r, w, s: (x.to_mkldnn(), r, w, s), "hidden_states: "),
    "nested": (
        None,
        lambda x, r, w, s: (torch.nested.nested_tensor(list(x)), r, w, s),
        "hidden_states: ",
    ),
    # Valid on its own: only a rank-divergent call (check mode catches it).
    "tokens_differ": (None, lambda x, r, w, s: (x[:3].clone(), r[:3].clone(), w, s), ""),
}


class _Snapshot:
    """Bitwise copies of every dense CPU tensor a call could write (its arguments and their bases)."""

    def __init__(self, tensors: list[Any]) -> None:
        seen: dict[int, torch.Tensor] = {}
        for t in tensors:
            for u in (t, getattr(t, "_base", None)):
                if _dense(u):
                    seen.setdefault(id(u), u)
        self.pairs = [(t, _bytes(t).clone()) for t in seen.values()]

    def unchanged(self) -> bool:
        return all(torch.equal(_bytes(t), b) for t, b in self.pairs)


def _dense(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and not t.is_nested
        and t.layout == torch.strided
        and t.device.type == "cpu"
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _summary(outcome: tuple) -> tuple:
    # An Output does not compare across ranks; that the call returned is what matters.
    return ("ok",) if outcome[0] == "ok" else outcome


def paired(ctx: Ctx, op: arnorm.AllReduceNorm, quant: str | None, seed: int = 99) -> Any:
    """A good call on every rank: True when its residual and normed are the contract's, bitwise."""
    parts, res, w = _data(ctx, seed)
    try:
        out = op(parts[ctx.rank].clone(), res, w, _scale(quant))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    h, y = add_rmsnorm(rank_order_sum(parts), res, w, EPS, 0.0)
    return torch.equal(out.residual, h) and torch.equal(out.normed, y)


def _run(ctx: Ctx, mode: str, kind: str) -> tuple:
    quant, build, _ = KINDS[kind]
    op = _op(ctx, quant, checked=mode == "one_checked")
    parts, res, w = _data(ctx, 1)
    x, s = parts[ctx.rank].clone(), _scale(quant)
    if kind == "w_swapped":
        op(x.clone(), res, w, s)  # every rank: the op now trusts w
    bad_here = mode == "all" or ctx.rank == ctx.last
    args = build(x, res, w, s) if bad_here else (x, res, w, s)
    snap = _Snapshot([*args, x, res, w, s])
    if mode == "one_unchecked" and not bad_here:
        outcome: tuple = ("skipped",)
    else:
        outcome = _summary(attempt(lambda: op(*args)))
    unchanged = snap.unchanged()
    try:
        return outcome, unchanged, paired(ctx, op, quant)
    finally:
        op.close()


MODES = ("all", "one_checked", "one_unchecked")


def _shift_without_check(ctx: Ctx) -> tuple:
    """No check mode: the last rank's first call is rejected, the others' is not; then every rank
    goes on with two more good calls.

    Returns each call's outcome on this rank: ``("ok", correct)`` or ``("error", type, message)``.
    The others' first call used to pair with the last rank's next call (another step's data, no
    error); the last rank's rejection now fills that collective's slot, so they raise.
    """
    op = _op(ctx, None, checked=False)
    got = []
    for i, seed in enumerate((10, 11, 12)):
        parts, res, w = _data(ctx, seed)
        x = parts[ctx.rank].clone()
        if i == 0 and ctx.rank == ctx.last:
            x = x.double()
        outcome = attempt(lambda x=x, r=res, w=w: op(x, r, w))
        if outcome[0] == "ok":
            h = add_rmsnorm(rank_order_sum(parts), res, w, EPS, 0.0)[0]
            outcome = ("ok", torch.equal(outcome[1].residual, h))
        got.append(outcome)
    op.close()
    return tuple(got)


#: Kinds whose check raises a RuntimeError today instead of InvalidInputError (no strides, no sizes).
NO_STORAGE = ("sparse_csr", "nested")
#: With check mode on one rank such a kind leaves the other ranks waiting until their group times out;
#: one of them stands for both there (each costs that timeout until the core is fixed).
CHECKED_NO_STORAGE = ("sparse_csr",)


def _applies(mode: str, kind: str) -> bool:
    if kind == "tokens_differ":
        return mode == "one_checked"
    return mode != "one_checked" or kind not in NO_STORAGE or kind in CHECKED_NO_STORAGE


SCENARIOS: dict[str, Callable[[Ctx], Any]] = {
    f"{mode}:{kind}": (lambda ctx, m=mode, k=kind: _run(ctx, m, k))
    for mode in MODES
    for kind in KINDS
    if _applies(mode, kind)
}
SCENARIOS["shift_without_check"] = _shift_without_check

#: Scenarios that leave ranks waiting today (their group times out quickly).
SHORT: tuple[str, ...] = ()  # none known to hang since the core fixes of 2026-12-03
