"""arnorm's FlashInfer backend: ``flashinfer.comm``'s fused all-reduce + residual + RMSNorm (+ quant) kernels.

The backend registers as ``flashinfer`` (priority 300) through the ``arnorm.backends`` entry point
``arnorm_flashinfer._plugin`` and needs the ``flashinfer`` extra (``pip install 'arnorm[flashinfer]'``,
i.e. ``flashinfer-python``). Importing this package imports neither torch nor FlashInfer; the
backend class lives in :mod:`arnorm_flashinfer._backend` and is loaded when arnorm probes it.

What it serves: CUDA SM90+ (SM100+ for nvfp4), 2, 4, 8 or 16 ranks on one host with peer access,
bf16 / fp16 / fp32, quant none / fp8_static / fp8_per_token / nvfp4 / mxfp8 (FlashInfer >= 0.7.4),
through the TRT-LLM IPC (Lamport) workspace; the MNNVL workspace only when
``ARNORM_FLASHINFER_MNNVL=1`` and every rank supports multicast.
"""
