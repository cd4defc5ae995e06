"""What a call does when it cannot run as asked, apart from the hot path (:mod:`arnorm.op._call`).

Each helper here runs only once something is already off (a busy token, a rejected call, a failed
check-mode agreement) or, for inference tensors, behind one cheap test, so a valid call pays nothing
more for them:

- a second call while the op's one call token is out is named for what it is: a call from inside
  the op's own call on the same thread (a backend or hook calling back), or two threads at once;
- inputs or ``out=`` buffers made under ``torch.inference_mode()`` reach the backend inside
  inference mode, where torch allows the in-place writes of the call (outside it, the first write
  into such a tensor raises, after the collective and after the write). At TP > 1 one
  ``is_inference()`` test per call sends them there before anything is sent. At TP 1 (no
  collective) valid calls pay nothing: a call that raised on such tensors is made again there when
  it wrote only into ``out``, and an in-place one raises :class:`InvalidInputError` saying so;
- a call rejected on this rank before its collective tells the peers in that collective's slot,
  and a failure of check mode's agreement poisons the op (:mod:`arnorm.comm._steps`).
"""

from __future__ import annotations

import sys
from typing import Any

from arnorm._errors import InvalidInputError

__all__ = ["busy_error", "is_inference_call", "retry_in_inference_mode", "run_in_inference_mode"]

_TWO_THREADS = "op: called from two threads at once (needs one call at a time per op)"
_REENTERED = (
    "op: called again from inside its own call on this thread (a backend, hook or callback running "
    "in the call called the op again) (needs each call to return before the next one starts)"
)


def busy_error(op: Any, codes: Any) -> InvalidInputError:
    """The error of a call that found the op's call token taken: re-entry when a call of ``op``
    whose code is one of ``codes`` is running on this thread's stack, else another thread's call."""
    f: Any = sys._getframe(2)
    while f is not None:
        if f.f_code in codes and f.f_locals.get("self") is op:
            return InvalidInputError(_REENTERED)
        f = f.f_back
    return InvalidInputError(_TWO_THREADS)


def is_inference_call(hidden_states: Any, out: Any) -> bool:
    """Whether the call writes into an inference tensor (made under ``torch.inference_mode()``):
    ``hidden_states`` (an in-place op) or a destination of ``out``. Anything else is ``False``
    (the call's check names what is wrong)."""
    try:
        if hidden_states.is_inference():
            return True
        if out is None:
            return False
        quant = getattr(out, "quant", None)
        for t in (out.normed, out.residual, getattr(quant, "data", None), getattr(quant, "scale", None)):
            if t is not None and t.is_inference():
                return True
    except (AttributeError, TypeError):
        pass
    return False


def retry_in_inference_mode(op: Any, exc: BaseException, hidden_states: Any, out: Any) -> bool:
    """After a call of ``op`` raised ``exc`` at TP 1 (no collective), outside inference mode, on
    tensors made under ``torch.inference_mode()``: ``True`` when the call is to be made again inside
    inference mode (it wrote only into ``out``, which the retry writes in full); for an in-place op
    raise :class:`InvalidInputError` from ``exc`` (torch raises after the write: ``hidden_states``
    may already hold the new residual, so the call cannot be made again); else ``False``."""
    if not isinstance(exc, RuntimeError) or op._dispatch.comm.world_size != 1:
        return False
    if not (op._dispatch.inplace or out is not None) or not is_inference_call(hidden_states, out):
        return False
    import torch

    if torch.is_inference_mode_enabled():
        return False
    if not op._dispatch.inplace:
        return True
    raise InvalidInputError(
        "hidden_states: an inference tensor (made under torch.inference_mode()) written in place "
        "outside inference mode, which torch refuses after the write (hidden_states may already hold "
        "the new residual) (needs the call inside torch.inference_mode(), as engines make it, or a "
        "tensor made outside it; at TP > 1 such calls run in inference mode by themselves)"
    ) from exc


def run_in_inference_mode(call: Any, op: Any, *args: Any, out: Any) -> Any:
    """``call(op, *args, out=out)`` inside ``torch.inference_mode()``, where torch allows the in-place
    writes into inference tensors that raise outside it (after the collective, on some ranks only);
    ``NotImplemented`` when inference mode is on already (the call goes on as it is)."""
    import torch

    if torch.is_inference_mode_enabled():
        return NotImplemented
    with torch.inference_mode():
        return call(op, *args, out=out)
