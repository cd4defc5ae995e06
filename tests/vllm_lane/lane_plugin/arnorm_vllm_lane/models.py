"""The lane's test models: tiny Llama-shaped decoders whose layers call vLLM's fused all-reduce +
norm helpers exactly as vLLM 0.33's DeepSeek-V3.2 (plain ``RMSNorm``, ``fused_allreduce_rms_norm``)
and MiniMax-M3 (Gemma norm, ``fused_allreduce_gemma_rms_norm``) decoder layers do.

The helpers are imported by name at module load, as those models import them: a plugin that
routes them must replace the names in this module too. ``o_proj`` and ``down_proj`` leave their
outputs un-reduced (``reduce_results=False``); the all-reduce happens inside the helper, which also
adds the residual and applies the next norm: the layer's ``post_attention_layernorm``, the next
layer's ``input_layernorm``, or, after the last layer, the model's final norm.
"""

from __future__ import annotations

from typing import Any

import torch

# The layers call the helpers through this module's globals (by name, at each call), as vLLM's model
# files do: a plugin that routes them must replace these names.
from vllm.model_executor.layers.fused_allreduce_gemma_rms_norm import (  # noqa: F401
    fused_allreduce_gemma_rms_norm,
)
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from vllm.models.common.ops.fused_allreduce_rms_norm import fused_allreduce_rms_norm  # noqa: F401

__all__ = ["ARCHITECTURES", "ArnormLaneGemmaForCausalLM", "ArnormLanePlainForCausalLM"]

ARCHITECTURES = ("ArnormLanePlainForCausalLM", "ArnormLaneGemmaForCausalLM")


def _unreduced(layer: LlamaDecoderLayer) -> None:
    # The row-parallel outputs stay per-rank partial sums: the helper all-reduces them.
    layer.self_attn.o_proj.reduce_results = False
    layer.mlp.down_proj.reduce_results = False


def _norm_dtype(module: torch.nn.Module, config: Any) -> None:
    """``arnorm_lane_norm_dtype: "float32"`` in the config keeps the norms' weights in fp32 while the
    activations are the model's dtype (a module may hold fp32 weights: issue 44, item 5)."""
    name = getattr(config, "arnorm_lane_norm_dtype", None)
    if name:
        for sub in module.modules():
            if isinstance(sub, (GemmaRMSNorm, RMSNorm)):
                sub.to(getattr(torch, name))


class PlainLayer(LlamaDecoderLayer):
    """DeepSeek-V3.2's decoder layer shape: plain ``RMSNorm``, ``fused_allreduce_rms_norm``."""

    #: The helper, by its name in this module: looked up at each call, as a model file's global is.
    helper = "fused_allreduce_rms_norm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _unreduced(self)
        if self.helper == "fused_allreduce_gemma_rms_norm":
            eps = self.input_layernorm.variance_epsilon
            self.input_layernorm = GemmaRMSNorm(self.hidden_size, eps=eps)
            self.post_attention_layernorm = GemmaRMSNorm(self.hidden_size, eps=eps)
        _norm_dtype(self, kwargs["vllm_config"].model_config.hf_config)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused_allreduce_norm = globals()[self.helper]
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            # The previous layer's MLP output is left un-reduced; fuse its all-reduce here.
            hidden_states, residual = fused_allreduce_norm(hidden_states, residual, self.input_layernorm)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = fused_allreduce_norm(hidden_states, residual, self.post_attention_layernorm)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class GemmaLayer(PlainLayer):
    """MiniMax-M3's decoder layer shape: Gemma norms (``1 + weight``), ``fused_allreduce_gemma_rms_norm``."""

    helper = "fused_allreduce_gemma_rms_norm"


class _Model(LlamaModel):
    """The decoder stack; the last layer's un-reduced MLP output meets the final norm in a helper."""

    gemma = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.gemma:
            self.norm = GemmaRMSNorm(self.config.hidden_size, eps=self.norm.variance_epsilon)
        _norm_dtype(self.norm, self.config)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        helper = "fused_allreduce_gemma_rms_norm" if self.gemma else "fused_allreduce_rms_norm"
        hidden_states, _ = globals()[helper](hidden_states, residual, self.norm)
        return hidden_states


class _PlainModel(_Model):
    gemma = False


class _GemmaModel(_Model):
    gemma = True


class ArnormLanePlainForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=PlainLayer)

    def _init_model(self, vllm_config: Any, prefix: str = "", layer_type: Any = PlainLayer) -> Any:
        return _PlainModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class ArnormLaneGemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=GemmaLayer)

    def _init_model(self, vllm_config: Any, prefix: str = "", layer_type: Any = GemmaLayer) -> Any:
        return _GemmaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
