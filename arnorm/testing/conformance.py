"""The conformance suite: any registered backend against the reference, through the public API.

Subclass it in a backend's own tests and name the backend; pytest collects the methods::

    from arnorm.testing import ConformanceSuite

    class TestMyBackend(ConformanceSuite):
        backend = "mine"
        world_sizes = (1, 2, 4)

For every dtype and format the backend *declares*, at several shapes (odd token counts included),
on 1, 2 and 4 ranks (gloo on CPU; CUDA tensors over gloo or NCCL on GPUs), it checks the numerics
contract (docs/numerics.md): the residual bit for bit (inputs are chosen so every correct reduction
order gives the same sum), the normed output within ``normed_ulps``, the quantized output equal to
``arnorm.quant`` applied to the backend's own normed output (``quant_mismatch`` allows a fraction
of codes off by one, for fast-math kernels). A declared case that the backend's probe rejects on
this machine is skipped with the probe's reasons; one that passes its checks and then fails is an
error. Bad inputs must raise ``InvalidInputError`` on every rank and leave the op usable.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from arnorm.testing._cases import Case, CaseResult, bad_inputs_then_good, run_cases
from arnorm.testing._ranks import run_ranks

__all__ = ["ConformanceSuite"]

LAYOUTS = {"nvfp4": ("swizzled_128x4", "linear"), "mxfp8": ("linear", "swizzled_128x4")}


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ConformanceSuite:
    """Base class: set ``backend``; override the class attributes to narrow or widen the sweep."""

    backend: ClassVar[str] = ""
    world_sizes: ClassVar[tuple[int, ...]] = (1, 2)
    shapes: ClassVar[tuple[tuple[int, int], ...]] = ((1, 256), (7, 512), (33, 256))
    normed_ulps: ClassVar[int] = 1  # bf16 / fp16 outputs
    # fp32 outputs: the reference's own mean, rsqrt and two products each round in fp32, so any
    # kernel lands a few fp32 ulps from it (3-4 measured); the contract's 1 ulp is for bf16/fp16.
    normed_ulps_fp32: ClassVar[int] = 8
    quant_mismatch: ClassVar[float] = 0.0
    quant_max_code_diff: ClassVar[int] = 0  # set to 1 with quant_mismatch for fast-math kernels
    # Scales computed by the kernel (per-token fp8, block scales) bit for bit; fast-math kernels
    # that divide approximately set this False and are held to their codes only.
    quant_scales_exact: ClassVar[bool] = True

    _results: ClassVar[dict[tuple[str, int], list[CaseResult]]] = {}

    # -- the sweep ----------------------------------------------------------------------------

    @classmethod
    def spec(cls) -> Any:
        import arnorm

        infos = {i.name: i for i in arnorm.backends()}
        if cls.backend not in infos:
            pytest.fail(f"backend: {cls.backend!r} is not registered (needs one of {sorted(infos)})")
        info = infos[cls.backend]
        if info.status == "not installed":
            pytest.skip(info.reason)
        if info.status != "available":
            pytest.fail(f"backend {cls.backend!r} is {info.status}: {info.reason}")
        return info.spec

    @classmethod
    def cases(cls) -> list[Case]:
        """Every declared (dtype, format, layout), at each shape, alternating plain and Gemma norms."""
        caps = cls.spec().capabilities
        out = []
        for dtype in sorted(caps.dtypes):
            for quant in sorted(caps.quant):
                layouts = [
                    lay for lay in LAYOUTS.get(quant, (None,)) if lay is None or lay in caps.scale_layouts
                ]
                for layout in layouts:
                    for i, (t, h) in enumerate(cls.shapes):
                        h = max(h, caps.min_hidden)
                        h += -h % caps.hidden_multiple
                        out.append(
                            Case(t, h, dtype, None if quant == "none" else quant, layout, float(i % 2))
                        )
        return out

    @classmethod
    def results(cls, world: int) -> list[CaseResult]:
        """Every case on ``world`` ranks, run once per class and world size; rank 0's view."""
        key = (cls.backend, world)
        if key not in cls._results:
            cases = cls.cases()
            if world == 1:
                per_rank = [run_cases(0, 1, cls.backend, cases, _device())]
            else:
                per_rank = run_ranks(world, run_cases, cls.backend, cases, _device())
            for r, rows in enumerate(per_rank[1:], start=1):
                for a, b in zip(per_rank[0], rows, strict=True):
                    assert (a.skipped, bool(a.error)) == (b.skipped, bool(b.error)), (
                        f"rank {r} diverged on {a.case.id}"
                    )
            cls._results[key] = per_rank[0]
        return cls._results[key]

    # -- the tests ----------------------------------------------------------------------------

    def test_declares_valid_capabilities(self) -> None:
        """The backend's descriptor loads and declares at least one dtype and format."""
        caps = self.spec().capabilities
        assert caps.dtypes and caps.quant and caps.platforms

    @pytest.mark.parametrize("world", [1, 2, 4])
    def test_matches_reference(self, world: int) -> None:
        """Residual bitwise, normed within tolerance, quant bitwise (or within the declared slack)."""
        if world not in self.world_sizes:
            pytest.skip(f"world size {world} not in {self.world_sizes}")
        rows = self.results(world)
        ran = [r for r in rows if not r.skipped]
        if not ran:
            pytest.skip(f"{self.backend} is not eligible here: {rows[0].skipped[0] if rows else 'no case'}")
        failures = []
        for r in ran:
            if r.error:
                failures.append(f"{r.case.id}: {r.error}")
                continue
            if not r.residual_equal:
                failures.append(f"{r.case.id}: residual differs from the contract")
            allowed = self.normed_ulps_fp32 if r.case.dtype == "float32" else self.normed_ulps
            if r.normed_ulps > allowed:
                failures.append(f"{r.case.id}: normed {r.normed_ulps} ulp off (allowed {allowed})")
            if self.quant_scales_exact and not r.quant_scales_equal:
                failures.append(f"{r.case.id}: quant scales differ from arnorm.quant's")
            if r.quant_mismatch > self.quant_mismatch:
                failures.append(
                    f"{r.case.id}: quant differs in {100 * r.quant_mismatch:.4f}% of codes "
                    f"(allowed {100 * self.quant_mismatch:.4f}%)"
                )
            if r.quant_max_code_diff > self.quant_max_code_diff:
                failures.append(
                    f"{r.case.id}: a quant code is {r.quant_max_code_diff} codes off "
                    f"(allowed {self.quant_max_code_diff})"
                )
        assert not failures, "\n".join(failures)

    def test_declared_formats_are_served(self) -> None:
        """Every declared format is either served or rejected by the probe with reasons, never broken."""
        rows = self.results(min(self.world_sizes))
        errors = [f"{r.case.id}: {r.error}" for r in rows if r.error]
        assert not errors, "\n".join(errors)

    def test_bad_inputs_raise_everywhere_and_leave_op_usable(self) -> None:
        """Bad calls raise InvalidInputError on every rank before any collective; a good call still works."""
        world = max(self.world_sizes)
        if all(r.skipped for r in self.results(min(self.world_sizes))):
            pytest.skip(f"{self.backend} is not eligible here")
        if world == 1:
            per_rank = [bad_inputs_then_good(0, 1, self.backend, _device())]
        else:
            per_rank = run_ranks(world, bad_inputs_then_good, self.backend, _device())
        assert all(p == per_rank[0] for p in per_rank)
        messages, ok = per_rank[0]
        assert "no error" not in messages and ok
