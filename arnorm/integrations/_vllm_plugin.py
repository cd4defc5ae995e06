"""arnorm's vLLM plugin: the ``vllm.general_plugins`` entry point ``arnorm`` (pyproject.toml).

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (the front end, the
engine core, every worker) before it builds the model; ``VLLM_PLUGINS`` is an allow-list of their
names. :func:`register` routes vLLM's fused all-reduce + norm helpers to arnorm's drop-ins
(:mod:`arnorm.integrations.vllm`), so ``pip install arnorm`` into a vLLM environment is enough:

- each helper the installed vLLM has, with the signature arnorm knows, is replaced in the module
  that defines it and in every module that already imported it by name (vLLM's model files do);
  a module imported later takes arnorm's from the defining module;
- a helper that is missing is skipped; one whose signature differs (a newer vLLM) is left alone;
- one log line per process (logger ``vllm.arnorm``, so vLLM's own log shows it; stderr in a process
  that has configured no logging yet, as vLLM's front end when it loads plugins) says which
  helpers were routed, which were left alone and why, and which arnorm backends serve;
- it adds arnorm's fusion pass to every engine config the process builds (the seams of every
  compiled model: :mod:`arnorm.integrations._vllm_pass_install`), under ``Config.vllm_pass``
  (``ARNORM_VLLM_PASS``: ``after``, ``take`` or ``off``); a vLLM whose pass API differs gets none;
- ``ARNORM_VLLM=0`` (``Config.vllm``) leaves vLLM untouched, and the line says so.

Importing this module imports neither torch nor vLLM nor a backend. ``register`` imports vLLM's
helper modules and compile modules (modules vLLM imports anyway) and arnorm's drop-ins; the ops are
built by the first call, which vLLM's profile run makes before any CUDA-graph capture (a call first seen
inside a capture runs unfused and builds nothing: see :mod:`arnorm.integrations._vllm_ops`).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["HELPERS", "Helper", "Routing", "compile_pass", "register", "route"]

#: vLLM's logger namespace: vLLM configures the ``vllm`` logger, so its log shows these lines.
logger = logging.getLogger("vllm.arnorm")


@dataclass(frozen=True)
class Helper:
    """One vLLM helper arnorm serves: where vLLM defines it, and the signature arnorm knows
    (parameters as ``inspect.signature`` writes them, without annotations)."""

    name: str
    module: str
    signature: str


HELPERS = (
    Helper(
        "fused_allreduce_gemma_rms_norm",
        "vllm.model_executor.layers.fused_allreduce_gemma_rms_norm",
        "(hidden_states, residual, norm)",
    ),
    Helper(
        "fused_allreduce_rms_norm",
        "vllm.models.common.ops.fused_allreduce_rms_norm",
        "(hidden_states, residual, norm)",
    ),
    # The seeds (not in vLLM 0.33): routed where an installed vLLM has them.
    Helper(
        "allreduce_gemma_rms_norm_mxfp8",
        "vllm.model_executor.layers.fused_allreduce_gemma_rms_norm",
        "(hidden_states, residual, norm, return_normed=False)",
    ),
    Helper(
        "fused_allreduce_gemma_rms_norm_quant",
        "vllm.models.qwen3_5.nvidia.ops.fused_allreduce_norm_quant",
        "(hidden_states, residual, weight, eps, scale, key)",
    ),
)


@dataclass(frozen=True)
class Routing:
    """What :func:`route` did: helpers routed (with the number of modules patched), and helpers
    left alone with the reason."""

    routed: tuple[tuple[str, int], ...]
    left_alone: tuple[tuple[str, str], ...]


def _plain_signature(fn: Any) -> str | None:
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _find(helper: Helper) -> tuple[Any, str | None]:
    """``(vLLM's function, None)``, or ``(None, why it is left alone)``."""
    import importlib

    try:
        module = importlib.import_module(helper.module)
    except ImportError:
        return None, f"{helper.module}: not in this vLLM"
    except Exception as exc:  # a vLLM module that fails to import on this platform
        return None, f"{helper.module}: import failed ({type(exc).__name__}: {exc})"
    fn = getattr(module, helper.name, None)
    if fn is None:
        return None, "not in this vLLM"
    if getattr(fn, "__module__", "").startswith("arnorm."):
        return fn, None  # already routed (register runs once per process; route may run again)
    found = _plain_signature(fn)
    if found != helper.signature:
        return None, f"signature {found} (needs {helper.signature}: a vLLM arnorm does not know)"
    return fn, None


def _replace_everywhere(original: Any, routed: Any) -> int:
    """Replace ``original`` by ``routed`` in every loaded module's namespace; the modules patched."""
    patched = 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        names = [k for k, v in list(namespace.items()) if v is original]
        for name in names:
            namespace[name] = routed
        patched += bool(names)
    return patched


def route(helpers: tuple[Helper, ...] = HELPERS) -> Routing:
    """Route each of ``helpers`` the installed vLLM has, with the known signature, to arnorm's drop-in
    of the same name; leave the others alone. Local to this process; safe to run again."""
    from arnorm.integrations import vllm as dropins

    routed, left = [], []
    for helper in helpers:
        original, why = _find(helper)
        if why is not None:
            left.append((helper.name, why))
            continue
        replacement = getattr(dropins, helper.name)
        if original is replacement:
            routed.append((helper.name, 0))
            continue
        routed.append((helper.name, _replace_everywhere(original, replacement)))
    return Routing(tuple(routed), tuple(left))


def _backends() -> str:
    """Which arnorm backends serve, as far as is known before an op is built (no probe, no import)."""
    from arnorm._config import Config

    config = Config()
    if config.backend:
        return f"{', '.join(config.backend)} (ARNORM_BACKEND, strict)"
    return (
        "auto: the first eligible of flashinfer, aiter, triton_symm, triton, else vLLM's unfused path "
        "(each op logs its choice when vLLM's profile run builds it)"
    )


def _say(level: int, message: str, *args: Any) -> None:
    """Log one line; where nothing would show it yet (vLLM's front end loads plugins before it
    configures its logging), write it to stderr instead, so every process says it."""
    if logger.hasHandlers():
        logger.log(level, message, *args)
    else:
        sys.stderr.write(f"{logging.getLevelName(level)} {message % args}\n")


def compile_pass(policy: str) -> str:
    """Add arnorm's compile pass to the engine configs this process builds, under ``policy``; what
    was done, for the log line. Never raises."""
    if policy == "off":
        return "compile pass: off (ARNORM_VLLM_PASS=off)"
    try:
        from arnorm.integrations._vllm_pass_install import prepare

        why = prepare(policy)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        return f"compile pass: not installed ({why})"
    return f"compile pass: {policy} (added to each engine config built here{_invariance()})"


def _invariance() -> str:
    import os

    if os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        return "; VLLM_BATCH_INVARIANT: only backends declaring batch invariance fuse"
    return ""


def register() -> None:
    """vLLM's hook (``vllm.general_plugins``): route the helpers and add the compile pass in this
    process, unless ARNORM_VLLM=0. Never raises: a failure leaves vLLM's own path and is logged."""
    import os

    try:
        from arnorm._config import Config

        config = Config()
        enabled, policy = config.vllm, config.vllm_pass
    except Exception as exc:  # a malformed ARNORM_* value: say it, keep vLLM's own path
        _say(logging.WARNING, "arnorm: vLLM helpers left to vLLM (pid %d): settings: %s; compile pass: "
             "not installed", os.getpid(), exc)  # fmt: skip
        return
    if not enabled:
        _say(logging.INFO, "arnorm: vLLM helpers left to vLLM (pid %d): ARNORM_VLLM=0; compile pass: "
             "not installed (ARNORM_VLLM=0)", os.getpid())  # fmt: skip
        return
    passed = compile_pass(policy)
    try:
        routing = route()
    except Exception as exc:
        _say(
            logging.WARNING,
            "arnorm: vLLM helpers left to vLLM (pid %d): routing failed (%s: %s); %s",
            os.getpid(),
            type(exc).__name__,
            exc,
            passed,
        )
        return
    routed = ", ".join(name for name, _ in routing.routed) or "none"
    left = "; ".join(f"{name}: {why}" for name, why in routing.left_alone) or "none"
    _say(
        logging.INFO,
        "arnorm: routed vLLM's %s to arnorm.integrations.vllm (pid %d); left to vLLM: %s; backend: %s; %s",
        routed,
        os.getpid(),
        left,
        _backends(),
        passed,
    )
