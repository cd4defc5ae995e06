"""arnorm's fusion pass in vLLM's compile pipeline: a vLLM ``InductorPass``.

vLLM's ``VllmBackend.configure_post_pass`` appends the pass found in
``CompilationConfig.inductor_compile_config["post_grad_custom_post_pass"]`` to its
``PostGradPassManager``, after vLLM's own passes and before the IR lowering: the pass sees vLLM's
``vllm.all_reduce`` feeding ``vllm_ir.rms_norm`` / ``vllm_ir.fused_add_rms_norm`` (the seams vLLM's
FlashInfer pass left, or every seam when that pass is off) and replaces each by
``torch.ops.arnorm.vllm_seam`` (:mod:`arnorm.integrations._vllm_pass_op`). A pass a user had put
in that slot runs first, unchanged. The pass is part of vLLM's compile-cache key (its
:meth:`ArnormFusionPass.uuid`) and travels to the workers inside the pickled ``VllmConfig``.

This module imports vLLM: only the plugin's installer and a worker unpickling the config import it.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from torch import fx
from vllm.compilation.passes.inductor_pass import InductorPass

__all__ = ["ArnormFusionPass", "reports"]

logger = logging.getLogger("vllm.arnorm")

#: What the pass did to each graph in this process: ``{"fused": [kinds], "left": [...], "unexpected": ...}``
#: (kept for the lane and for debugging; the last 64 graphs).
_reports: list[dict[str, Any]] = []


def reports(reset: bool = False) -> list[dict[str, Any]]:
    """What the pass did to the graphs it saw in this process, oldest first."""
    out = list(_reports)
    if reset:
        _reports.clear()
    return out


def _sources_digest() -> str:
    """The pass's own code: a change to what it matches or emits changes the cache key."""
    import inspect

    from arnorm.integrations import _vllm_pass_op, _vllm_pass_rewrite, _vllm_pass_table

    h = hashlib.sha256()
    for module in (_vllm_pass_table, _vllm_pass_rewrite, _vllm_pass_op):
        h.update(inspect.getsource(module).encode())
    h.update(_vllm_pass_table.table_text().encode())
    return h.hexdigest()


class ArnormFusionPass(InductorPass):
    """Replace vLLM's TP all-reduce -> RMSNorm (-> quant) seams by arnorm's fused op.

    Args:
        policy: ``"after"`` (vLLM's own all-reduce fusion, if on, ran first) or ``"take"`` (vLLM's
            is off: every seam is arnorm's). Part of the cache key only.
        max_tokens: the fused op's token budget (vLLM's ``max_num_batched_tokens``); larger
            batches run vLLM's unfused code.
        batch_invariant: vLLM runs batch invariant (``VLLM_BATCH_INVARIANT=1``): only a backend
            declaring batch invariance serves a seam.
        chained: the pass that held the slot before arnorm's (run first), or None.
    """

    def __init__(self, policy: str, max_tokens: int, batch_invariant: bool, chained: Any = None) -> None:
        self.policy = policy
        self.max_tokens = int(max_tokens)
        self.batch_invariant = bool(batch_invariant)
        self.chained = chained

    def __call__(self, graph: fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        from arnorm.integrations._vllm_pass_op import define
        from arnorm.integrations._vllm_pass_rewrite import plan, rewrite

        the_plan = plan(graph)
        report: dict[str, Any] = {"fused": [s.kind() for s in the_plan.seams], "left": the_plan.left,
                                  "unexpected": the_plan.unexpected}  # fmt: skip
        if the_plan.unexpected is not None:
            report["fused"] = []
            logger.warning("arnorm: compile pass left a graph alone: unexpected seam: %s",
                           the_plan.unexpected)  # fmt: skip
        else:
            rewrite(graph, the_plan, define(), self.max_tokens, self.batch_invariant)
            after = plan(graph)
            report["remaining"] = len(after.seams) + len(after.left)  # all-reduces still before a norm
            for why in the_plan.left:
                logger.info("arnorm: compile pass left a seam to vLLM: %s", why)
        _reports.append(report)
        del _reports[:-64]

    def uuid(self) -> Any:
        import arnorm

        state = {
            "arnorm": arnorm.__version__,
            "sources": _sources_digest(),
            "policy": self.policy,
            "max_tokens": self.max_tokens,
            "batch_invariant": self.batch_invariant,
            "chained": self.chained.uuid() if self.chained is not None else None,
        }
        return InductorPass.hash_dict(state)

    def __repr__(self) -> str:
        return (f"ArnormFusionPass(policy={self.policy!r}, max_tokens={self.max_tokens}, "
                f"batch_invariant={self.batch_invariant}, chained={self.chained!r})")  # fmt: skip
