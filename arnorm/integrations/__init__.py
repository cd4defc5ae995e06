"""Drop-ins that put arnorm inside real clients, without hand-written wrappers.

- :mod:`arnorm.integrations.vllm`: the entry points of vLLM's fused all-reduce + Gemma RMSNorm
  helpers, with their own signatures and return contracts, so a vLLM model file switches by
  changing an import.
- :mod:`arnorm.integrations.transformers`: ``fuse(model, tp_group, max_tokens=...)`` rewires a
  tensor-parallel Hugging Face decoder (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2, Gemma3) so
  every row-parallel all-reduce, residual add and following norm is one arnorm call.

Importing this package imports nothing heavy; each submodule imports torch (and its client
library, when it needs it) on first use. docs/integrations.md has the details.
"""

from __future__ import annotations

__all__: list[str] = []
