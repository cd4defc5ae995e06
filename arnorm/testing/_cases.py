"""What one conformance case runs on each rank, as plain functions spawned ranks can import."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from arnorm.testing._compare import ulp_distance

__all__ = ["Case", "CaseResult", "run_cases"]


@dataclass(frozen=True)
class Case:
    """One problem: shape, dtype, format (with layout) and norm kind."""

    tokens: int
    hidden: int
    dtype: str
    quant: str | None
    layout: str | None
    weight_offset: float

    @property
    def id(self) -> str:
        q = self.quant or "none"
        if self.layout:
            q += f"/{self.layout}"
        return f"{self.dtype}-{q}-T{self.tokens}-H{self.hidden}-b{self.weight_offset:g}"


@dataclass(frozen=True)
class CaseResult:
    """How the backend did on one case, on one rank (``skipped`` holds the reasons it was ineligible)."""

    case: Case
    skipped: tuple[str, ...] = ()
    error: str = ""
    residual_equal: bool = False
    normed_ulps: int = 0
    quant_mismatch: float = 0.0
    quant_max_code_diff: int = 0
    quant_scales_equal: bool = True


def exact_inputs(case: Case, world: int, device: Any) -> tuple[list[Any], Any, Any, Any]:
    """Partials whose fp32 sum is exact in any order (multiples of 2**-8 in [-4, 4]), so every
    correct backend reduces to the same ``s`` and the residual can be compared bit for bit."""
    import torch

    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))  # str hash differs per process

    def grid(*shape: int) -> Any:
        return (torch.randint(-1024, 1025, shape, generator=g).float() / 256).to(dtype).to(device)

    partials = [grid(case.tokens, case.hidden) for _ in range(world)]
    residual = grid(case.tokens, case.hidden)
    weight = (torch.randn(case.hidden, generator=g) * 0.2).to(dtype).to(device)
    scale = None
    if case.quant == "fp8_static":
        scale = torch.tensor([0.01], device=device)
    elif case.quant == "nvfp4":
        scale = torch.tensor([448 * 6 / 8.0], device=device)
    return partials, residual, weight, scale


def run_case(backend: str, case: Case, rank: int, world: int, device: Any) -> CaseResult:
    """Build the backend strictly for ``case``, run it once, compare with the reference math."""
    import torch

    import arnorm
    from arnorm._reference import add_rmsnorm, rank_order_sum
    from arnorm.quant import quantize

    partials, residual, weight, scale = exact_inputs(case, world, device)
    try:
        op = arnorm.AllReduceNorm(
            hidden_size=case.hidden,
            dtype=getattr(torch, case.dtype),
            norm=arnorm.RMSNorm(1e-6, case.weight_offset),
            quant=case.quant,
            scale_layout=case.layout,
            max_tokens=max(64, case.tokens),
            backend=backend,
            device=device,
        )
    except arnorm.NoEligibleBackendError as exc:
        return CaseResult(case, skipped=(str(exc).splitlines()[-2] if "\n" in str(exc) else str(exc),))
    except arnorm.ArnormError as exc:
        return CaseResult(case, error=f"{type(exc).__name__}: {exc}")
    try:
        out = op(partials[rank].clone(), residual, weight, scale)
    except Exception as exc:  # a conformance run reports whatever the backend raised
        op.close()
        return CaseResult(case, error=f"call raised {type(exc).__name__}: {exc}")
    h, y = add_rmsnorm(rank_order_sum(partials), residual, weight, 1e-6, case.weight_offset)
    result = CaseResult(
        case,
        residual_equal=bool(torch.equal(out.residual, h)),
        normed_ulps=ulp_distance(out.normed, y) if out.normed is not None else 0,
    )
    if case.quant is not None:
        assert out.quant is not None and out.normed is not None
        expect = quantize(out.normed, case.quant, scale=scale, layout=op.problem.scale_layout)
        got, want = out.quant.data.view(torch.uint8), expect.data.view(torch.uint8)
        differ = got != want
        codes = (got.int() - want.int()).abs()
        scales_equal = torch.equal(out.quant.scale.view(torch.uint8), expect.scale.view(torch.uint8))
        result = CaseResult(
            case,
            residual_equal=result.residual_equal,
            normed_ulps=result.normed_ulps,
            quant_mismatch=float(differ.float().mean()),
            quant_max_code_diff=int(codes.max()) if codes.numel() else 0,
            quant_scales_equal=scales_equal,
        )
    op.close()
    return result


def run_cases(rank: int, world: int, backend: str, cases: list[Case], device: str) -> list[CaseResult]:
    """Every case on this rank (the entry point ``run_ranks`` spawns)."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return [run_case(backend, c, rank, world, dev) for c in cases]


def bad_inputs_then_good(rank: int, world: int, backend: str, device: str) -> tuple[list[str], bool]:
    """Each bad call raises InvalidInputError on this rank; a good call afterwards still matches."""
    import torch

    import arnorm
    from arnorm._reference import add_rmsnorm, rank_order_sum

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    case = Case(4, 256, "bfloat16", None, None, 0.0)
    partials, residual, weight, _ = exact_inputs(case, world, dev)
    x = partials[rank]
    bad_calls = [
        (x[:, :128].contiguous(), residual, weight),
        (x.float(), residual, weight),
        (x, residual[:, ::2], weight),
        (x, residual, weight[:128]),
        (
            torch.empty(65, 256, dtype=x.dtype, device=dev),
            torch.empty(65, 256, dtype=x.dtype, device=dev),
            weight,
        ),
    ]
    messages = []
    with arnorm.AllReduceNorm(
        hidden_size=256, dtype=torch.bfloat16, max_tokens=64, backend=backend, device=dev
    ) as op:
        for args in bad_calls:
            try:
                op(*args)
                messages.append("no error")
            except arnorm.InvalidInputError as exc:
                messages.append(str(exc).split(" (")[0])
        out = op(x.clone(), residual, weight)
        h, _ = add_rmsnorm(rank_order_sum(partials), residual, weight, 1e-6, 0.0)
        return messages, bool(torch.equal(out.residual, h))
