"""What spawned ranks run for the compile pass's multi-rank tests: ``torch.ops.arnorm.vllm_seam``
called as a compiled vLLM graph calls it, on a TP group of gloo ranks standing in for vLLM's."""

from __future__ import annotations

import warnings
from typing import Any

import integ_fakes
import integ_vllm_pass_fakes as F
import pytest
import torch
import torch.distributed as dist

from arnorm.integrations import _vllm_pass_op as pass_op
from arnorm.integrations import vllm as av

HIDDEN, EPS = 64, 1e-6


class TpCoordinator(F.Coordinator):
    """vLLM's GroupCoordinator over every rank of this run (gloo), as the op reads it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.world_size = dist.get_world_size()
        self.device_group = self.cpu_group = dist.group.WORLD

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reductions += 1
        out = x.clone()
        dist.all_reduce(out)
        return out


def seam_calls(rank: int, world: int, tokens: list[int], broken_on: int | None = None) -> dict[str, Any]:
    """Call the seam op once per count in ``tokens``; what each rank saw: the warnings, where each
    call ran, and whether each result equals vLLM's unfused code bit for bit. On rank ``broken_on``
    the fused test backend fails to build (a JIT compile or an allocation failing on one rank)."""
    patch = pytest.MonkeyPatch()
    integ_fakes.install_registry()
    F.install(patch)
    if rank == broken_on:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"fused: cannot build on rank {rank}")

        patch.setattr(integ_fakes.FusedTestBackend, "create", broken)
    coordinator = F._coordinators[F.GROUP] = TpCoordinator(F.GROUP)
    import sys
    import weakref

    sys.modules["vllm.distributed.parallel_state"]._groups[F.GROUP] = weakref.ref(coordinator)  # type: ignore[attr-defined]
    pass_op.define()
    out: dict[str, Any] = {"equal": []}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for t in tokens:
            g = torch.Generator().manual_seed(t)
            # Multiples of 1/16: any order of the all-reduce sums them exactly.
            parts = [(torch.randint(-32, 33, (t, HIDDEN), generator=g) / 16).bfloat16() for _ in range(world)]
            res = torch.randn(t, HIDDEN, generator=g).bfloat16()
            w = (torch.randn(HIDDEN, generator=g) * 0.2).bfloat16()
            y, r, _, _ = torch.ops.arnorm.vllm_seam(parts[rank], res, w, None, F.GROUP, EPS, False, "", True,
                                                    16, False)  # fmt: skip
            want_y, want_r = F.fused_add_rms_norm(sum(p.float() for p in parts).bfloat16(), res, w, EPS)
            out["equal"].append(torch.equal(y, want_y) and torch.equal(r, want_r))
    out["warnings"] = [str(w.message) for w in record if "vLLM's unfused code" in str(w.message)]
    out["served"] = dict(av.served_calls()[pass_op.ENTRY])
    pass_op.reset()
    patch.undo()
    return out
