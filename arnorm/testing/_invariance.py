"""The batch-invariance check one conformance case runs on each rank (docs/numerics.md, section 10).

An op is built strictly on the backend with ``Config(batch_invariant=True)`` over a pool of rows
(``max_tokens`` = the largest batch). Each row is computed alone (``T = 1``), then inside batches of
every size asked for, at a different offset into the pool each time (a row lands at different
positions among different neighbours); every output of every row must be bitwise the row's alone:
the residual, the normed output, the codes and the scales that belong to the row (fp8_per_token's
per-token scale, the block scales of every block format, read back in row order from any layout).
fp8_static's scale and nvfp4's global scale are inputs, the same for every call: nothing to compare.

The partials are random values of the dtype (not the exactly summable grid of the contract check):
a backend whose sum order changes with T gives a different sum for some row, and so does one whose
norm statistic is reduced in a T-dependent order.
"""

from __future__ import annotations

import dataclasses
import traceback
import zlib
from dataclasses import dataclass
from typing import Any

from arnorm._formats import FORMAT_SPECS
from arnorm._norm import NORM_OPTIONS
from arnorm.testing._cases import Case, _device, build, input_scale

__all__ = ["InvarianceResult", "run_invariance"]


@dataclass(frozen=True)
class InvarianceResult:
    """One case on one rank: ``outcome`` ``"ran"`` (``failures``: what differed, empty when the row
    outputs were all bitwise the same), ``"skipped"`` (``reasons``) or ``"error"`` (``error``)."""

    case: Case
    outcome: str
    status: str = ""
    reasons: tuple[str, ...] = ()
    error: str = ""
    failures: tuple[str, ...] = ()


def _inputs(case: Case, pool: int, world: int, device: Any) -> tuple[list[Any], Any, Any, Any]:
    import torch

    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(zlib.crc32(("invariance-" + case.id).encode()))
    partials = [torch.randn(pool, case.hidden, generator=g).to(dtype).to(device) for _ in range(world)]
    residual = (torch.randn(pool, case.hidden, generator=g) * 2).to(dtype).to(device)
    weight = (1 + torch.randn(case.hidden, generator=g) * 0.2).to(dtype).to(device)
    return partials, residual, weight, input_scale(case, device)


def _row_outputs(out: Any, case: Case) -> dict[str, Any]:
    """Each output as ``[T, ...]`` tensors of bytes, one row per token (scales in row order)."""
    import torch

    from arnorm.quant._layout import from_layout

    t = out.residual.shape[0]
    rows = {"residual": out.residual}
    if out.normed is not None:
        rows["normed"] = out.normed
    q = out.quant
    if q is not None:
        rows["codes"] = q.data.view(torch.uint8).reshape(t, -1)
        spec = FORMAT_SPECS[q.format]
        if spec.block_size and spec.scale_dtype == "float32":  # per-group fp8: fp32 scales, own layouts
            from arnorm.quant._fp8_group import from_group_layout

            rows["scales"] = from_group_layout(q.scale, q.layout, t, case.hidden // spec.block_size)
        elif spec.block_size:
            k = case.hidden // spec.block_size
            rows["scales"] = from_layout(q.scale.view(torch.uint8), q.layout, t, k)
        elif spec.scale_dtype is not None:  # one computed scale per row
            rows["scales"] = q.scale.reshape(t, -1)
    return {name: _bits(v) for name, v in rows.items()}


def _bits(t: Any) -> Any:
    """Integer bit patterns (NaN payloads and signed zeros compare as the bits they are)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()]).cpu()


def _offset(size: int, pool: int) -> int:
    """Where a batch of ``size`` rows starts in the pool: different per size, so a row is seen at
    different positions (program ids, slots, two-shot owners) among different neighbours."""
    return (size * 37 + 11) % pool


def _compare(alone: dict[str, Any], got: dict[str, Any], rows: list[int], size: int) -> list[str]:
    import torch

    out = []
    for name, batch in got.items():
        ref = alone[name][rows]
        if torch.equal(ref, batch):
            continue
        diff = (ref != batch).reshape(len(rows), -1)
        bad = diff.any(dim=1).nonzero().flatten().tolist()
        j = bad[0]
        col = int(diff[j].nonzero()[0])
        mask = (1 << (8 * ref.element_size())) - 1
        a, b = (
            int(ref.reshape(len(rows), -1)[j, col]) & mask,
            int(batch.reshape(len(rows), -1)[j, col]) & mask,
        )
        out.append(
            f"T={size}: {name} of {len(bad)} of {size} rows differs from the row computed alone; first: "
            f"batch row {j} (pool row {rows[j]}), column {col}: {b:#x} in the batch, {a:#x} alone "
            "(needs bitwise the same: the backend declares batch_invariant)"
        )
    return out


def _build(backend: str, case: Case, device: Any, max_tokens: int) -> tuple[Any, InvarianceResult | None]:
    """The op of ``case`` built by the conformance cases' builder, with ``Config(batch_invariant=True)``."""
    import arnorm

    op, failed = build(backend, case, device, max_tokens, config=arnorm.Config(batch_invariant=True))
    if failed is None:
        return op, None
    return None, InvarianceResult(
        case, failed.outcome, status=failed.status, reasons=failed.reasons, error=failed.error
    )


def invariance_case(backend: str, case: Case, sizes: tuple[int, ...], rank: int, world: int,
                    device: Any) -> InvarianceResult:  # fmt: skip
    """Rows alone, then in batches of each of ``sizes``; see the module docstring."""
    import torch

    pool = max(sizes)
    op, failed = _build(backend, case, device, pool)
    if failed is not None:
        return failed
    try:
        partials, residual, weight, scale = _inputs(case, pool, world, device)
        x = partials[rank]
        res = residual if case.add_residual else None

        def call(rows: list[int]) -> dict[str, Any]:
            out = op(x[rows].clone(), None if res is None else res[rows].clone(), weight, scale)
            return _row_outputs(out, case)

        singles = [call([i]) for i in range(pool)]
        alone = {name: torch.cat([s[name] for s in singles]) for name in singles[0]}
        failures: list[str] = []
        for size in sizes:
            start = _offset(size, pool)
            rows = [(start + j) % pool for j in range(size)]
            failures += _compare(alone, call(rows), rows, size)
        return InvarianceResult(case, "ran", failures=tuple(failures))
    except Exception:
        return InvarianceResult(case, "error", error=f"a call raised:\n{traceback.format_exc()}")
    finally:
        op.close()


def run_invariance(rank: int, world: int, backend: str, cases: list[Case], sizes: tuple[int, ...],
                   device: str) -> list[InvarianceResult]:  # fmt: skip
    """Every case on this rank (the entry point ``run_ranks`` spawns)."""
    dev = _device(device)
    return [invariance_case(backend, c, sizes, rank, world, dev) for c in cases]


def invariance_cases(caps: Any, hidden: int) -> list[Case]:
    """One case per declared format at its default layout and one per other declared layout (at the
    first format that has it), for the first declared dtype, at ``hidden`` (raised to
    the hidden size the backend admits for the format); the norms rotate through plain and Gemma,
    with ``add_residual=False`` (the third case) and each declared norm option (the ``k``-th in
    the table's order alone in case ``2k + 1``) once each where declared."""
    from arnorm.registry._capabilities import admitted_hidden

    dtype = sorted(caps.dtypes)[0]
    declared = [n for n in NORM_OPTIONS if n in caps.norm_options]
    out: list[Case] = []
    seen_layouts: set[str] = set()
    for quant in sorted(caps.quant):
        q = None if quant == "none" else quant
        if quant in caps.quant_dtypes and dtype not in caps.quant_dtypes[quant]:
            continue
        h = admitted_hidden(caps, quant, hidden)
        if h is None:
            continue
        layouts = FORMAT_SPECS[q].layouts if q else ()
        for layout in layouts or (None,):
            if layout is not None and layout not in caps.scale_layouts:
                continue
            # A layout is where the scales go, not how a row's values are made: each format at its
            # default layout, and each other layout once, at the first format that has it.
            if layout is not None and layout != layouts[0] and layout in seen_layouts:
                continue
            seen_layouts.add(layout or "")
            i = len(out)
            offsets = sorted(caps.weight_offsets) if caps.weight_offsets is not None else [0.0, 1.0]
            case = Case(1, h, dtype, q, layout, float(offsets[i % len(offsets)]))
            if i == 2 and caps.residual_free:
                case = dataclasses.replace(case, add_residual=False)
            on = frozenset(n for k, n in enumerate(declared) if i == 2 * k + 1)
            out.append(dataclasses.replace(case, norm_options=on))
    return out
