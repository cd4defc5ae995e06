"""Rank side of the fuzz: run a list of drawn cases in one spawn and check each against the oracle.

A case is a small dict (drawn by hypothesis in the test process); every rank rebuilds the same
tensors from its seed, so only the dicts travel. For each case every rank builds an op on WORLD,
calls it with its partial, and compares the outputs with :mod:`relia_oracle`: the residual bit for
bit, the normed values inside the oracle's interval, the quantized output bit for bit against the
oracle's quantizers applied to the op's own normed output (the contract: ``q = Q(out.normed)``).
With ``normed_output=False`` a twin op with ``normed_output=True`` supplies the normed values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import arnorm

import relia_oracle as oracle

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def tensors(case: dict, world: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every rank's partial, the residual and the weight of a case (identical on every rank)."""
    g = torch.Generator().manual_seed(case["seed"])
    t, h, dtype, mag = case["tokens"], case["hidden"], DTYPES[case["dtype"]], case["magnitude"]
    parts = [(torch.randn(t, h, generator=g) * mag).to(dtype) for _ in range(world)]
    residual = (torch.randn(t, h, generator=g) * mag).to(dtype)
    weight = (torch.randn(h, generator=g) * 0.1 + case["weight_mean"]).to(dtype)
    if case["zero_row"]:  # an all-zero row: rms = sqrt(eps), normed and every scale at their floor
        for p in [*parts, residual]:
            p[-1] = 0
    return parts, residual, weight


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.uint8).numpy()


def input_scale(case: dict, expected: oracle.Expected) -> float | None:
    """fp8_static's dequant scale / nvfp4's global encode scale, from the normed amax, times a factor
    (0.25 saturates, 8 uses a fraction of the range)."""
    amax = float(np.abs(expected.hi).max()) or 1.0
    scale = {"fp8_static": amax / 448, "nvfp4": 448 * 6 / amax}.get(case["quant"])
    return None if scale is None else float(np.float32(scale * case["scale_factor"]))


def _op(case: dict, world_group: Any, backend: str, normed_output: bool) -> arnorm.AllReduceNorm:
    return arnorm.AllReduceNorm(
        world_group,
        hidden_size=case["hidden"],
        dtype=DTYPES[case["dtype"]],
        norm=arnorm.RMSNorm(case["eps"], case["offset"], case["round_before_weight"]),
        quant=case["quant"],
        scale_layout=case["layout"],
        max_tokens=case["tokens"] + case["spare_tokens"],
        backend=backend,
        normed_output=normed_output,
        inplace=case["inplace"],
        device="cpu",  # the interpreter for triton; CPU tensors also on a GPU host
    )


def _call(op: arnorm.AllReduceNorm, case: dict, part: torch.Tensor, residual, weight, scale):
    hs = part.clone()
    if case["strided"]:  # rows of a wider buffer: the reference takes strided rows
        wide = torch.zeros(part.shape[0], part.shape[1] + 3, dtype=part.dtype)
        wide[:, : part.shape[1]] = part
        hs = wide[:, : part.shape[1]]
    res = residual.clone()
    out = op(hs, res, weight, None if scale is None else torch.tensor([scale]))
    return hs, res, out


def _check_normed(y: torch.Tensor | None, expected: oracle.Expected) -> str:
    if y is None:
        return "normed: None with normed_output=True"
    got = _np(y)
    bad = ~((expected.lo <= got) & (got <= expected.hi))
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        return (
            f"normed: {int(bad.sum())} of {bad.size} outside the oracle interval, e.g. at {i}: "
            f"{got[i]!r} not in [{expected.lo[i]!r}, {expected.hi[i]!r}]"
        )
    return ""


def _check_quant(q: Any, case: dict, y: np.ndarray, scale: float | None) -> str:
    layout = case["layout"] or {"nvfp4": "swizzled_128x4", "mxfp8": "linear"}.get(case["quant"])
    data, scales = oracle.quantize(y, case["quant"], scale, layout)
    if q is None or (q.format, q.layout) != (case["quant"], layout):  # layout: None for the fp8 formats
        return f"quant: {None if q is None else (q.format, q.layout)} (needs {case['quant']}, {layout})"
    got = _bytes(q.data)
    if got.shape != data.shape or not np.array_equal(got, data):
        diff = int((got != data).sum()) if got.shape == data.shape else "shape"
        return f"quant data: {diff} codes differ from the oracle's ({got.shape} vs {data.shape})"
    if case["quant"] == "fp8_per_token":
        ok = np.array_equal(_np(q.scale), scales)
    elif case["quant"] == "fp8_static":
        ok = float(q.scale) == scale
    else:
        ok = _bytes(q.scale).shape == scales.shape and np.array_equal(_bytes(q.scale), scales)
        ok = ok and (case["quant"] != "nvfp4" or float(q.global_scale) == scale)
    return "" if ok else "quant scale: differs from the oracle's"


def check_case(rank: int, world: int, case: dict, backend: str) -> str:
    """``""`` when the op meets the contract on this rank for ``case``, else what differs.

    Every collective (the op, and the twin op of a ``normed_output=False`` case) runs before any
    check, so a rank that finds a difference never leaves the others waiting.
    """
    import torch.distributed as dist

    parts, residual, weight = tensors(case, world)
    expected = oracle.add_rmsnorm(
        [_np(p) for p in parts], _np(residual), _np(weight), dtype=case["dtype"], eps=case["eps"],
        offset=case["offset"], round_before_weight=case["round_before_weight"],
    )  # fmt: skip
    scale = input_scale(case, expected)
    with _op(case, dist.group.WORLD, backend, case["normed_output"]) as op:
        hs, res, out = _call(op, case, parts[rank], residual, weight, scale)
    y = out.normed
    if not case["normed_output"]:
        with _op(case, dist.group.WORLD, backend, True) as twin:  # the same math, normed returned
            y = _call(twin, case, parts[rank], residual, weight, scale)[2].normed
    return _compare(case, parts[rank], residual, expected, scale, hs, res, out, y)


def _compare(case, part, residual, expected, scale, hs, res, out, y) -> str:
    got = _np(out.residual)
    if not torch.equal(res, residual):
        return "residual input: modified"
    if not np.array_equal(got, expected.residual) or (np.signbit(got) != np.signbit(expected.residual)).any():
        n = int((got != expected.residual).sum())
        return f"residual: {n} of {got.size} differ from the rank-order sum plus residual"
    if case["inplace"] != (out.residual.data_ptr() == hs.data_ptr()):
        return f"residual: written into hidden_states is {not case['inplace']} with inplace={case['inplace']}"
    if not case["inplace"] and not torch.equal(hs, part):
        return "hidden_states: modified by an op built with inplace=False"
    if not case["normed_output"] and out.normed is not None:
        return "normed: returned with normed_output=False"
    why = _check_normed(y, expected)
    if why or case["quant"] is None:
        return why or ("" if out.quant is None else "quant: returned with quant=None")
    return _check_quant(out.quant, case, _np(y), scale)


def run_cases(rank: int, world: int, cases: list[dict], backend: str) -> list[tuple[int, str, str]]:
    """Every failing case on this rank: ``(index, what differs)``."""
    failures = []
    for i, case in enumerate(cases):
        try:
            why = check_case(rank, world, case, backend)
        except Exception as exc:  # a case that raises is a finding too; the ranks stay in step
            why = f"raised {type(exc).__name__}: {exc}"
        if why:
            failures.append((i, why))
    return failures
