"""Tiny random-weight Hugging Face decoders from config objects (no downloads), saved for tp_plan loading."""

from __future__ import annotations

import os

import torch

#: Family -> (config class, model class) names in transformers.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}

# Four query and four KV heads shard over 2 and 4 ranks; head_dim 16 keeps every family at H = 64.
SIZES = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=64,
    initializer_range=0.1,
)


def make(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny random ``family`` causal LM in eval mode, its norm weights moved off their init."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    extra = {"sliding_window": 8} if family in ("gemma2", "gemma3") else {}
    config = config_cls(**SIZES, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # Norm weights away from their init (ones / zeros), so the weight multiply is exercised.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model.to(dtype)


def build(family: str, path: str, seed: int = 0) -> str:
    """Save a tiny random ``family`` model (float32) under ``path``/``family``; returns the folder."""
    folder = os.path.join(path, family)
    make(family, seed).save_pretrained(folder)
    return folder


def load(folder: str, dtype: torch.dtype, tp: int | None = None) -> torch.nn.Module:
    """The saved model in ``dtype``: sharded by transformers' tensor parallelism over ``tp`` ranks, or not."""
    from transformers import AutoModelForCausalLM

    if tp is None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_plan="auto", tp_size=tp)
    return AutoModelForCausalLM.from_pretrained(folder, distributed_config=config, dtype=dtype).eval()
