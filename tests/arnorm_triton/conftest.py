"""The triton backend's tests run in the Triton interpreter where no CUDA GPU is present."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton reads it in each @triton.jit decorator: set before arnorm_triton._kernels is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
