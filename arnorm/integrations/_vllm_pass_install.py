"""Putting arnorm's compile pass into every engine config vLLM builds in this process.

The vLLM plugin calls :func:`prepare` in each process: it checks that the installed vLLM has the
pass API arnorm knows (:func:`api_mismatch`), defines ``torch.ops.arnorm.vllm_seam`` (a graph loaded
from Inductor's cache calls it without any pass running), and wraps
``EngineArgs.create_engine_config`` so that the config it returns carries the pass
(:func:`install`): in the front end, before the config's hash is taken and before the config is
pickled to the workers. Importing this module imports neither torch nor vLLM.

Policies (``Config.vllm_pass``, ``ARNORM_VLLM_PASS``): ``after`` adds the pass after vLLM's own
(its FlashInfer all-reduce fusion, where on, takes its seams first); ``take`` also turns vLLM's
``fuse_allreduce_rms`` off, so arnorm serves every seam; ``off`` adds nothing.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["KEY", "api_mismatch", "install", "prepare"]

#: The slot of vLLM's CompilationConfig.inductor_compile_config that VllmBackend adds to its passes.
KEY = "post_grad_custom_post_pass"


def api_mismatch() -> str | None:
    """Why the installed vLLM's pass API is not the one arnorm knows (None: it is)."""
    import inspect

    try:
        from vllm.compilation.backends import VllmBackend
        from vllm.compilation.passes.inductor_pass import InductorPass
        from vllm.config import CompilationConfig, PassConfig
        from vllm.engine.arg_utils import EngineArgs
    except Exception as exc:  # a vLLM without these modules, or one failing to import here
        return f"vLLM's compile modules: {type(exc).__name__}: {exc}"
    checks = (
        (callable(getattr(InductorPass, "uuid", None)), "InductorPass.uuid"),
        ("inductor_compile_config" in getattr(CompilationConfig, "__dataclass_fields__", {}),
         "CompilationConfig.inductor_compile_config"),
        ("fuse_allreduce_rms" in getattr(PassConfig, "__dataclass_fields__", {}),
         "PassConfig.fuse_allreduce_rms"),
        (callable(getattr(EngineArgs, "create_engine_config", None)), "EngineArgs.create_engine_config"),
    )  # fmt: skip
    for ok, what in checks:
        if not ok:
            return f"{what}: missing (needs vLLM's pass API of 0.33)"
    try:
        source = inspect.getsource(VllmBackend.configure_post_pass)
    except (AttributeError, OSError, TypeError):
        source = ""
    if KEY not in source or "InductorPass" not in source:
        return f"VllmBackend.configure_post_pass: does not add the {KEY} pass (needs vLLM's pass API of 0.33)"
    return None


def _batch_invariant() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_BATCH_INVARIANT)


def install(vllm_config: Any, policy: str) -> Any:
    """Add arnorm's pass to ``vllm_config`` (a ``VllmConfig``) under ``policy``; the pass added, or the
    one already there. A pass the user put in the slot is kept and runs first."""
    from arnorm.integrations._vllm_pass import ArnormFusionPass

    compilation = vllm_config.compilation_config
    slot = compilation.inductor_compile_config.get(KEY)
    if isinstance(slot, ArnormFusionPass):
        return slot
    if policy == "take":
        compilation.pass_config.fuse_allreduce_rms = False
    scheduler = getattr(vllm_config, "scheduler_config", None)
    max_tokens = getattr(scheduler, "max_num_batched_tokens", None) or 8192
    added = ArnormFusionPass(policy, max_tokens, _batch_invariant(), chained=slot)
    compilation.inductor_compile_config[KEY] = added
    return added


def _take_before(engine_args: Any) -> None:
    """Under ``take``: vLLM's all-reduce fusion off before the config is built (so nothing vLLM
    derives from it, its compile ranges among them, assumes it on)."""
    compilation = getattr(engine_args, "compilation_config", None)
    if isinstance(compilation, dict):
        compilation.setdefault("pass_config", {})
        if isinstance(compilation["pass_config"], dict):
            compilation["pass_config"]["fuse_allreduce_rms"] = False
    elif compilation is not None and getattr(compilation, "pass_config", None) is not None:
        compilation.pass_config.fuse_allreduce_rms = False


def prepare(policy: str) -> str | None:
    """Make every engine config this process builds carry the pass; None, or why nothing was done."""
    why = api_mismatch()
    if why is not None:
        return why
    from vllm.engine.arg_utils import EngineArgs

    from arnorm.integrations._vllm_pass_op import define

    define()
    original = EngineArgs.create_engine_config
    if getattr(original, "__arnorm_policy__", None) is not None:
        original = original.__wrapped__

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        if policy == "take":
            _take_before(self)
        config = original(self, *args, **kwargs)
        install(config, policy)
        return config

    create_engine_config.__arnorm_policy__ = policy  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config
    return None
