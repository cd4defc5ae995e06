"""The direct launch of a compiled Triton kernel, and whether PDL is available, shared by ``triton``
and ``triton_symm``.

``kernel[grid](...)`` re-binds and re-specializes every argument in Python per call; a compiled
variant's own launcher (``CompiledKernel.run``, a C function on a GPU) takes plain integer
pointers as they are. :func:`bound_launchers` says how one compiled variant may be called that
way; the launchers (:mod:`arnorm_triton._launch`, :mod:`arnorm_triton.symm._launch`) check each
candidate bit for bit against ``kernel[grid]`` before using it, and take the ordinary path while
a profiler's launch hook is installed: ``RUNTIME.launch_enter_hook`` is neither ``None`` nor an
empty ``HOOK_CHAIN`` (a test both launchers make inline, per launch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import triton

if TYPE_CHECKING:
    from arnorm.plugin import Problem

__all__ = ["HOOK_CHAIN", "KNOWN_CALL_SOURCES", "RUNTIME", "Bound", "bound_launchers", "pdl_available"]


class Bound(NamedTuple):
    """A compiled variant's launcher, ready to call as
    ``run(grid, 1, 1, stream, function, *mid, *kernel_args)``."""

    run: Callable[..., Any]
    function: Any
    mid: tuple[Any, ...]


#: sha256 of the whitespace-normalized source of ``CudaLauncher.__call__`` in Triton 3.6.0, whose
#: whole work for a kernel with no scratch memory is ``self.launch(grid..., stream, function,
#: cooperative, pdl, None, None, *args)``. Only a launcher with exactly that source is called
#: through its ``launch`` directly (a C function): it skips a Python frame, two closures and a
#: re-packing of 25 arguments per eager call. Any other Triton keeps ``CompiledKernel.run``.
KNOWN_CALL_SOURCES = frozenset({"b5e4d84a36af22efc4017e23f5873393dc885ae5ca6077a545182aa971d8d324"})


def bound_launchers(compiled: Any) -> list[Bound]:
    """How ``compiled`` may be launched directly, fastest first (each is checked bit for bit at bind)."""
    plain = Bound(compiled.run, compiled.function, (compiled.packed_metadata, None, None, None))
    run = compiled.run
    try:
        import hashlib
        import inspect

        text = " ".join(inspect.getsource(type(run).__call__).split())
        known = hashlib.sha256(text.encode()).hexdigest() in KNOWN_CALL_SOURCES
        if known and run.global_scratch_size == 0 and run.profile_scratch_size == 0:
            # cooperative, pdl, no global / profile scratch, then what __call__ passes on as *args.
            mid: tuple[Any, ...] = (run.launch_cooperative_grid, run.launch_pdl, None, None)
            mid += (compiled.packed_metadata, None, None, None)
            return [Bound(run.launch, compiled.function, mid), plain]
    except Exception:  # no source, other attributes: the plain launcher only
        pass
    return [plain]


#: ``triton.knobs`` (Triton >= 3.4): a profiler's launch hook needs the slow path.
_KNOBS: Any = getattr(triton, "knobs", None)


class _NoKnobs:
    launch_enter_hook = None


#: Read per fast launch. ``launch_enter_hook`` is a plain attribute (not an environment
#: descriptor) of this one ``runtime_knobs`` object in Triton 3.4 to 3.8, so the read is cheap.
RUNTIME: Any = getattr(_KNOBS, "runtime", None) or _NoKnobs()
#: Since Triton 3.5 the hook is a ``HookChain`` that is never ``None``; an empty chain means no
#: hook. Anything else that is not ``None`` (a function assigned as in Triton 3.4) is a hook.
HOOK_CHAIN: Any = getattr(_KNOBS, "HookChain", None) or _NoKnobs


def pdl_available(problem: Problem) -> bool:
    """Whether both backends' kernels may use programmatic dependent launch: CUDA SM 9.0+, compiled
    (not interpreted) kernels, and a Triton with ``gdc_wait``."""
    from arnorm_triton._kernels import INTERPRETED

    if INTERPRETED or problem.platform != "cuda" or (problem.arch or (0, 0)) < (9, 0):
        return False
    try:
        import triton.language as tl

        return hasattr(tl.extra.cuda, "gdc_wait")
    except Exception:
        return False
