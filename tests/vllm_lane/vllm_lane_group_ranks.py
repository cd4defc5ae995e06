"""What each rank runs for the group formats' proof at TP 1 and 2: vLLM's own chain (its TP all-reduce
over gloo, its GemmaRMSNorm, its ``per_token_group_quant_fp8`` / ``mxfp4_quantize``) against arnorm's
quant entry point, codes and scales bit for bit.

vLLM's quantizers run their Triton kernels under the interpreter, mended as
test_lane_group_formats.py says (its fp32 -> e4m3 cast, ``tensor.floor``): each rank mends its own
interpreter first. Module-level functions (spawned ranks import them by name).
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: Token counts: within the drop-ins' budget (arnorm's fused kernel) and above it (None back: the
#: caller's own path; nothing to compare).
TOKENS = (1, 7, 32)
HIDDEN = 512
EPS = 1e-6
KEYS = ("kFp8Dynamic128Sym", "kFp8Dynamic64Sym", "kMxfp4Dynamic")


def mend_interpreter() -> None:
    """Triton 3.8's interpreter as a GPU runs vLLM's kernels (for the rest of this process)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data: Any, src: Any, dst: Any, rounding_mode: Any) -> Any:
        if src == tl.float32 and dst == tl.float8e4nv:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)
        return original(data, src, dst, rounding_mode)

    interpreter._convert_float = convert
    tl.core.tensor.floor = lambda self: tl.math.floor(self)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _vllm_quantize(key_name: str, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
    from vllm.model_executor.layers.quantization.utils.mxfp4_utils import mxfp4_quantize

    if key_name == "kMxfp4Dynamic":
        q, s = mxfp4_quantize(y)
        return q, s
    group = 128 if key_name == "kFp8Dynamic128Sym" else 64
    q, s = per_token_group_quant_fp8(y, group, use_ue8m0=False)
    return q, s


def group_chain(rank: int, world: int) -> dict[str, Any]:
    """Each key, dtype and token count: arnorm's entry point against vLLM's unfused chain."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    mend_interpreter()
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.model_executor.layers.fusion.quant_activation import QuantizedActivation
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu
    from vllm_lane_ranks import _inputs, _norms, vllm_parallel_state

    from arnorm.integrations import vllm as av

    rows = []
    with vllm_parallel_state(rank, world):
        av.configure(max_tokens=max(TOKENS) - 1, backend=["triton", "reference"])
        for dtype in (torch.bfloat16, torch.float16):
            for tokens in TOKENS:
                x, residual, weight = _inputs(rank, world, tokens, HIDDEN, dtype, 5)
                x[0, :64] = 0  # a zero group (after the sum, on every rank)
                gemma, _ = _norms(HIDDEN, dtype, weight)
                reduced = tensor_model_parallel_all_reduce(x.clone())
                want_y, want_h = gemma.forward_native(reduced, residual.clone())
                for key_name in KEYS:
                    key = getattr(qu, key_name)
                    want_q, want_s = _vllm_quantize(key_name, want_y)
                    av.served_calls(reset=True)
                    got = av.fused_allreduce_gemma_rms_norm_quant(
                        x.clone(), residual.clone(), gemma.weight.data, EPS, None, key, norm=gemma
                    )
                    row: dict[str, Any] = {
                        "key": key_name, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                        "returned": got is not None, "served": av.served_calls(reset=True),
                    }  # fmt: skip
                    if got is not None:
                        q, normed, new_residual = got
                        # vLLM's quantizer on arnorm's own normed output: the codec alone.
                        own_q, own_s = _vllm_quantize(key_name, normed)
                        row.update(
                            type_is_vllms=isinstance(q, QuantizedActivation) and q.quant_key is key,
                            residual_bitwise=_same(new_residual, want_h),
                            normed_bitwise=_same(normed, want_y),
                            codes_bitwise=_same(q.data, want_q),
                            scales_bitwise=_same(q.scale, want_s),
                            codes_vs_vllm_quant_of_normed=_same(q.data, own_q),
                            scales_vs_vllm_quant_of_normed=_same(q.scale, own_s),
                            scale=[list(q.scale.shape), str(q.scale.dtype).removeprefix("torch.")],
                        )
                    rows.append(row)
        av.close()
        av.configure()
    return {"world": world, "hidden": HIDDEN, "rows": rows}
