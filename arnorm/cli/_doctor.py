"""``arnorm doctor``: what this machine has, and what each backend makes of it."""

from __future__ import annotations

import platform
import sys

__all__ = ["report"]


def _gpu_lines() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return ["GPUs: none visible (torch.cuda.is_available() is False)"]
    n = torch.cuda.device_count()
    lines = [f"GPUs: {n}"]
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        arch = getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"
        lines.append(f"  [{i}] {p.name}  {arch}  {p.total_memory / 2**30:.0f} GiB")
    if n > 1:
        lines.append("peer access (row can read column):")
        lines.append("      " + " ".join(f"{j:>3}" for j in range(n)))
        for i in range(n):
            cells = [
                "  -" if i == j else ("yes" if torch.cuda.can_device_access_peer(i, j) else " no")
                for j in range(n)
            ]
            lines.append(f"  {i:>3} " + " ".join(cells))
    return lines


def report() -> str:
    """A plain-text report: python, torch, CUDA/ROCm, GPUs and peer access, the call check, backends."""
    import torch
    import torch.distributed as dist

    import arnorm

    lines = [
        f"arnorm {arnorm.__version__}",
        f"python {sys.version.split()[0]} ({platform.platform()})",
        f"torch {torch.__version__}  CUDA {torch.version.cuda or '-'}"
        f"  ROCm {getattr(torch.version, 'hip', None) or '-'}",
        "torch.distributed: "
        + ", ".join(
            f"{b}={'yes' if ok() else 'no'}"
            for b, ok in (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available))
        ),
    ]
    lines += _gpu_lines()
    from arnorm.registry._load import load_config

    if load_config().check_calls:
        lines.append("call check: every call compared across ranks first (ARNORM_CHECK_CALLS=1; slow, "
                     "for debugging)")  # fmt: skip
    lines.append("backends:")
    for info in arnorm.backends():
        version = f" {info.version}" if info.version else ""
        detail = f": {info.reason}" if info.reason else ""
        lines.append(f"  {info.name}{version} [{info.status}]{detail}")
    lines.append(
        "next: `arnorm explain --tp N --hidden H --quant Q` shows which backend a problem gets, and why"
    )
    return "\n".join(lines)
