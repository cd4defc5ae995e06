"""The ``triton`` backend of arnorm: torch.distributed + one fused Triton kernel, at any TP size.

Per call: ``all_reduce`` of this rank's partial (NCCL / RCCL / gloo; none at TP 1), then one Triton
kernel that adds the residual, normalizes (plain or Gemma RMSNorm) and quantizes (none,
fp8_static, fp8_per_token, nvfp4, mxfp8) in one pass over each row (nvfp4 at large T adds a second,
small kernel that swizzles the block scales the first wrote linearly). With ``ARNORM_TRITON_EXACT=1``
(or ``Config(settings={"triton": {"exact": True}})``) the partials are all-gathered instead and
summed in fp32 in rank order inside the kernel, bitwise equal to the reference at any TP size.

Install with ``pip install 'arnorm[triton]'``; registered as ``triton`` (priority 100) through the
``arnorm.backends`` entry point. Modules: ``_plugin`` (the cheap descriptor), ``_backend`` (the
``TritonBackend`` class), ``_kernels`` (the kernel and the norm/quant epilogue shared with
``triton_symm``), ``_swizzle`` (the second pass of a two-pass scale store), ``_launch`` (the
launcher), ``_direct`` (the direct launch both launchers use), ``_launch_table`` /
``_launch_measured`` (the warps per shape, and where scales take two passes), ``_casts``
(conversions that are exact on a GPU and in the Triton interpreter). This package imports nothing
heavy.
"""
