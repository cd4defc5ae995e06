"""The checked call of :class:`arnorm.AllReduceNorm` (its ``__call__``), apart from construction.

For a valid call the cost is one combined test of :mod:`arnorm.op._check`'s rule (that module says
it in words, and :func:`arnorm.op._check.check_call` builds the message when the test fails; a
property test holds the two equal), a list index that picks the backend for the token count, and
the backend call. Where the backend has a fast path (the optional ``fast_path`` of
:class:`arnorm.plugin.FusedAllReduceNorm`) and the rows are contiguous, the call goes there with
the data pointers the test already read, so neither side reads them twice. :func:`call` is
``AllReduceNorm.__call__``: it reads the op's :class:`arnorm.op._dispatch.Dispatch` and nothing else
of the op (the op itself only travels on, to the custom op and to :func:`arnorm.op._faults.call_failed`).
"""

from __future__ import annotations

from threading import get_ident
from typing import TYPE_CHECKING, Any

from arnorm._errors import BackendBrokenError, InvalidInputError, PeerError
from arnorm._types import Output
from arnorm.comm._steps import call_rejected
from arnorm.op._call_faults import (
    busy_error,
    is_inference_call,
    retry_in_inference_mode,
    run_in_inference_mode,
)
from arnorm.op._caller_outputs import check_out_tensors, copy_into, unwritten_destination
from arnorm.op._check import check_call
from arnorm.op._custom_op import call_custom_op
from arnorm.op._dispatch import Dispatch, Dispatched, closed_error
from arnorm.op._faults import call_failed, thread_error
from arnorm.op._first_calls import served_by
from arnorm.op._guards import agree_call, guard, no_backend

if TYPE_CHECKING:
    import torch

__all__ = ["call", "out_check", "returned_out", "trust_weight"]


def call(
    self: Dispatched,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    out: Output | None = None,
) -> Output:
    """Run one fused step; see the class docstring for the formula.

    Args:
        hidden_states: ``[T, H]`` this rank's partial sum (becomes the new residual when the
            op is in place). Rows may be strided when every backend of the op says so.
        residual: ``[T, H]``, not modified; must not share memory with ``hidden_states``.
            ``None`` exactly when the op was built with ``add_residual=False``.
        weight: ``[H]`` norm weight in the op's dtype (raw Gemma weight; the offset is added).
        scale: fp32 ``[1]`` on the op's device: the dequant scale (fp8_static) or the global
            encode scale (nvfp4); ``None`` for the other formats.
        out: caller-owned buffers for exactly ``T`` tokens, written instead of allocating
            (:meth:`empty_output` makes one; an earlier call's result may be passed back). The
            result holds ``out``'s tensors. Each is contiguous, 16-byte aligned and shares no
            byte with another or with the inputs (README, "Caller-provided outputs").

    One call at a time per op: a second, concurrent call from another thread raises. At TP > 1,
    calls come from the thread that owns the op's group (the one that built its first live op;
    README, "Threads"); a call that raises part-way poisons the op on every rank
    (:class:`arnorm.PeerError` from then on; build a new op).

    ``weight``, ``scale`` and ``out`` are checked in full when first seen, then trusted by
    identity and data pointer: a tensor whose pointer changes (``w.data = other``) is checked
    again, but an in-place change that keeps it (``as_strided_``, ``resize_``, ``.data`` set to
    a view of the same memory in another dtype) is not seen. Pass a new tensor instead. Writes
    into ``hidden_states`` and ``out`` are not recorded in autograd's version counter by every
    backend (a bump costs more host time than the rest of a decode call): arnorm is for
    inference, so do not pass a tensor that autograd saved for a backward.
    """
    d = self._dispatch  # the call reads this one object (arnorm.op._dispatch), nothing else of the op
    if d.is_compiling():
        dests = None
        if out is not None:  # fake tensors have no data pointers: the custom op tests the overlaps
            dests = [t for _, t in check_out_tensors(d.out_rules, out, hidden_states.shape[0])]
        result = call_custom_op(self, d.handle, hidden_states, residual, weight, scale, dests)
        return result if out is None else copy_into(result, out, d.inplace)
    owner = d.owner  # 0 at TP 1; else the thread that owns the group (arnorm.op._faults)
    if owner:
        if owner != get_ident():
            raise thread_error(owner)
        if (d.inplace or out is not None) and is_inference_call(hidden_states, out):
            # Made under torch.inference_mode(): the writes after the collective are allowed only
            # there (TP 1 pays nothing for this test: see the end of this function).
            result = run_in_inference_mode(call, self, hidden_states, residual, weight, scale, out=out)
            if result is not NotImplemented:
                return result
    declined = False  # the backend's fast path returned None for this call: __call__ serves it
    accept = d.accept  # None with check_calls, or without the C helper
    if accept is not None:  # the C helper: this function's test (a subset of it), then fast(...)
        result = accept(d.accel_state, d, hidden_states, residual, weight, scale, out)
        if result is not NotImplemented:
            if result is not None:
                # With out=, the helper tested that the result holds out's tensors; one that does
                # not comes back as a 1-tuple (an Output's type is Output, never tuple).
                if out is None or type(result) is not tuple:
                    return result
                return returned_out(d, result[0], out, hidden_states)
            declined = True
    if d.check_calls:
        if d.closed:  # a closed op holds no group to agree over
            raise closed_error()
        if d.poisoned is not None:  # before agreeing: the peers' ops are poisoned too
            raise PeerError(d.poisoned)
        d.seq += 1
        try:
            agree_call(d.comm, d.rules, d.seq, hidden_states, residual, weight, scale, out_check(d, out))
        except InvalidInputError:
            raise  # the same error on every rank, none of which entered the collective
        except BaseException as exc:  # a timeout, a peer's note, an interrupt: the ranks may part here
            call_failed(self, exc)
            raise
    token = d.token
    try:
        token.pop()
    except IndexError:
        raise busy_error(self, _CALL_CODES) from None
    try:
        fast = None
        sp = rp = rn = 0  # no residual: an empty range at 0, which no output or input overlaps
        h, row_bytes, dt, on_cpu, index, max_tokens = d.consts
        try:
            shape = hidden_states.shape
            t = shape[0]
            hp, wp = hidden_states.data_ptr(), weight.data_ptr()
            if residual is None:
                if hidden_states.is_contiguous():
                    hn = t * row_bytes
                    ok = not d.add_residual
                    fast = d.fast_table[t]
                elif d.strided:
                    hst = hidden_states.stride()
                    hn = ((t - 1) * hst[0] + h) * d.itemsize
                    ok = not d.add_residual and (h == 1 or hst[1] == 1) and (t == 1 or hst[0] >= h)
                else:
                    ok = False
                if on_cpu:  # is_cpu and get_device() both exclude meta tensors, and are cheap
                    ok = ok and hidden_states.is_cpu
                else:
                    ok = ok and hidden_states.get_device() == index
            else:
                rp = residual.data_ptr()
                if hidden_states.is_contiguous() and residual.is_contiguous():
                    hn = rn = t * row_bytes
                    ok = abs(hp - rp) >= hn
                    fast = d.fast_table[t]
                elif d.strided:
                    hst, rst = hidden_states.stride(), residual.stride()
                    hn = ((t - 1) * hst[0] + h) * d.itemsize
                    rn = ((t - 1) * rst[0] + h) * d.itemsize
                    ok = (h == 1 or hst[1] == rst[1] == 1) and (t == 1 or (hst[0] >= h and rst[0] >= h))
                    ok = ok and (hp >= rp + rn or rp >= hp + hn)
                else:
                    ok = False
                if on_cpu:
                    ok = ok and hidden_states.is_cpu and residual.is_cpu
                else:
                    ok = ok and hidden_states.get_device() == index and residual.get_device() == index
                ok = (
                    ok
                    and d.add_residual
                    and residual.dtype is dt
                    and residual.shape == shape
                    and not residual.is_neg()
                )
            ok = (
                ok
                and hidden_states.dtype is dt
                and len(shape) == 2
                and shape[1] == h
                and 0 < t <= max_tokens
                and not hidden_states.is_neg()  # a lazy negation: pointer-based backends ignore the bit
                and (
                    (weight is d.last_weight and wp == d.last_wptr)
                    or d.trusted_weights.get(id(weight)) == wp
                    or trust_weight(d, weight, wp)
                )
                and (wp >= hp + hn or hp >= wp + row_bytes)
            )
            if scale is not None:
                sp = scale.data_ptr()
                ok = (
                    ok
                    and (d.trusted_scales.get(id(scale)) == sp or d.trust.scale(scale, sp))
                    and (sp >= hp + hn or hp >= sp + 4)
                )
            elif d.scaled:
                ok = False
            grad = (
                ok
                and d.grad_enabled()
                and (
                    hidden_states.requires_grad
                    or (residual is not None and residual.requires_grad)
                    or weight.requires_grad
                )
            )
            if grad and d.inplace and hidden_states.requires_grad and hidden_states.is_leaf:
                ok = False
            if grad and d.rules.writes_residual and residual.requires_grad and residual.is_leaf:  # type: ignore[union-attr]
                ok = False
        except (AttributeError, TypeError, IndexError, RuntimeError):
            ok = grad = False
        checked = out is None
        if ok and not checked:
            # OutTrust.check's trusted case inline (every out= call pays it): each destination kept
            # its data pointer and shape and shares no byte with an input; else the full check,
            # which raises.
            spans = d.out_spans.get(id(out))
            if spans is not None and spans[0] == t:
                he, re_, we, se = hp + hn, rp + rn, wp + row_bytes, sp + 4 if scale is not None else 0
                for dest, a, b, shape in spans[1]:
                    if dest.data_ptr() != a or dest.shape != shape or (
                        (a < he and hp < b) or (a < re_ and rp < b) or (a < we and wp < b)
                        or (a < se and sp < b)
                    ):  # fmt: skip
                        break
                else:
                    checked = True
            if not checked:
                d.out_trust.check(out, t, (hidden_states, residual, weight, scale))
                checked = True
        if fast is not None and ok and not declined:
            try:
                result = fast(t, hidden_states, residual, weight, scale, out, hp, rp, wp, sp)
            except BaseException as exc:
                call_failed(self, exc)
                raise
            if result is not None:
                if out is not None and not (
                    type(result) is Output
                    and (result.normed is out.normed or out.normed is None)  # None: normed over hidden_states
                    and result.quant is out.quant
                    and (d.inplace or result.residual is out.residual)
                ):
                    result = returned_out(d, result, out, hidden_states)
                return guard(result, hidden_states, residual, weight) if grad else result
        if not ok:
            check_call(d.rules, hidden_states, residual, weight, scale)
            grad = d.grad_enabled() and _requires_grad(hidden_states, residual, weight)
            t = hidden_states.shape[0]
        impl = d.table[t]
        if impl is None:
            raise closed_error() if d.closed else no_backend(t)
        if not checked:
            d.out_trust.check(out, t, (hidden_states, residual, weight, scale))
        try:
            if out is None:
                result = impl(hidden_states, residual, weight, scale)
            else:
                result = d.into_table[t](hidden_states, residual, weight, scale, out)
        except BaseException as exc:
            call_failed(self, exc)
            raise
        if out is not None:
            result = returned_out(d, result, out, hidden_states)
        return guard(result, hidden_states, residual, weight) if grad else result
    except BaseException as exc:
        if not retry_in_inference_mode(self, exc, hidden_states, out):
            call_rejected(self)  # before its collective: tell the peers (comm._steps)
            raise
    finally:
        token.append(None)
    # TP 1, tensors made under torch.inference_mode(): no collective ran, so the call is made again
    # there, where torch allows its writes (valid calls never get here).
    return run_in_inference_mode(call, self, hidden_states, residual, weight, scale, out=out)


def _requires_grad(hidden_states: Any, residual: Any, weight: Any) -> bool:
    residual_grad = residual is not None and residual.requires_grad
    return bool(hidden_states.requires_grad or residual_grad or weight.requires_grad)


def returned_out(d: Dispatch, result: Any, out: Output, hidden_states: Any) -> Output:
    """``result``, when it hands back the caller's ``out`` tensors (identity: a few ``is`` tests);
    else raise naming the backend: one declaring ``caller_outputs`` that ignored ``out`` has left
    the caller's buffers unwritten, and the values an engine reads next would be stale."""
    if (
        type(result) is Output
        and (result.normed is out.normed or out.normed is None)  # None: normed over hidden_states
        and (d.inplace or result.residual is out.residual)
    ):
        q = out.quant
        if q is None or (
            result.quant is not None and result.quant.data is q.data and result.quant.scale is q.scale
        ):
            return result
    where = unwritten_destination(result, out, d.out_rules)
    if not where:
        return result
    impl = served_by(d.table[hidden_states.shape[0]])
    names = [n for n, c in zip(d.names, d.chain, strict=True) if c is impl]
    name = names[0] if names else d.names[0]
    msg = (
        f"backend {name!r}: {where}: not the caller's tensor, its buffer left unwritten (needs a backend "
        "that writes into out= and returns its tensors, as Capabilities(caller_outputs=True) promises; "
        "fix or report the plugin, or call without out=)"
    )
    raise BackendBrokenError(msg, d.explanation)


def out_check(d: Dispatch, out: Any) -> Any:
    """For ``ARNORM_CHECK_CALLS``: a function raising what ``out`` would raise, or ``None``."""
    if out is None:
        return None

    def check(hidden_states: Any, residual: Any, weight: Any, scale: Any) -> None:
        tensors = (hidden_states, residual, weight, scale)
        d.out_trust.check(out, hidden_states.shape[0], tensors)

    return check


def trust_weight(d: Dispatch, weight: Any, ptr: int) -> bool:
    """Check ``weight`` fully and trust it; the weight of the last call is then checked by
    identity alone (one op per layer); an op shared by the layers finds the others in the table."""
    if d.trust.weight(weight, ptr):
        d.last_weight, d.last_wptr = weight, ptr
        return True
    return False


#: A busy call token means re-entry when one of these runs on this thread for the same op.
_CALL_CODES = (call.__code__,)
