"""The call of :class:`arnorm.AllReduceNorm` (its ``__call__``) and the one rule for its arguments.

The call reads the op's :class:`arnorm.op._plan.CallPlan`, checks its arguments, dispatches and
hands back, each once. It is the only code that changes the op's
:class:`arnorm.op._plan.CallState` (the call token, check mode's sequence, the trust caches, the
token counts whose first result was checked). An argument goes from here to
:mod:`arnorm.op._caller_outputs` (an ``out=`` not trusted yet) and to :mod:`arnorm.op._results`
(what a backend is handed and what it hands back), and never comes back.

The rule, for an op built for ``H``, dtype ``D``, a device and ``max_tokens``. A call is accepted when:

- ``residual`` is ``None`` exactly when the op was built with ``add_residual=False``;
- ``hidden_states`` and ``residual`` are ``[T, H]`` tensors of ``D`` on the op's device (a meta
  tensor is never on it), ``1 <= T <= max_tokens``, with contiguous rows: contiguous, or, when
  every backend of the op takes strided rows, column stride 1 and row stride ``>= H``;
- ``residual``, ``weight`` and ``scale`` share no byte with ``hidden_states`` (its memory range:
  the op may write it, and a residual read through another view of it gives wrong sums);
- ``weight`` is a contiguous ``[H]`` tensor of ``D`` on the device;
- ``scale`` is an fp32 ``[1]`` tensor on the device for fp8_static / nvfp4, else ``None``;
- no tensor has the negative or conjugate bit set (``torch._neg_view``, ``z.conj().imag``): a
  backend reads the memory through its data pointer, where the lazy negation is not applied;
- with autograd recording, an in-place op is not handed a leaf ``hidden_states`` that requires grad,
  nor an op of the in-place layout (``output_layout="in_place"``) a leaf ``residual`` that does.

A valid call pays for one combined test of it (weights, scales and ``out`` are checked in full when
first seen, then trusted by identity and data pointer); a call that fails the test goes to
:func:`check_call`, which says the rule in messages naming the argument. A property test holds the
two to accepting exactly the same inputs. The rule depends only on the arguments and the op, so
every rank passing the same shapes raises the same error before any collective.
"""

from __future__ import annotations

from threading import get_ident
from typing import TYPE_CHECKING, Any

from arnorm._errors import InvalidInputError, NoEligibleBackendError, PeerError
from arnorm._formats import FORMAT_SPECS
from arnorm._types import Output
from arnorm.comm._comm import CLOSED
from arnorm.comm._steps import call_rejected
from arnorm.op._caller_outputs import check_out_tensors, checked_out, span
from arnorm.op._custom_op import call_custom_op
from arnorm.op._faults import call_failed, thread_error
from arnorm.op._results import broken_result, check_result, copy_into, guard, returned_out

if TYPE_CHECKING:
    import torch

    from arnorm.op._plan import CallPlan, CallRules, CallState

__all__ = ["agree_call", "agree_larger_call", "call", "check_call", "no_backend"]

#: Trusted weights/scales, and ``out=`` objects, per op before a table starts over (an op shared by
#: every layer sees one weight per layer; a caller passing fresh tensors must not grow it forever).
TRUST_LIMIT = 1024
OUT_TRUST_LIMIT = 64

_BUSY = "op: called from two threads at once, or from inside its own call (needs one call at a time per op)"
_REENTERED = (
    "op: called again from inside its own call on this thread (a backend, hook or callback running "
    "in the call called the op again) (needs each call to return before the next one starts)"
)


def call(
    self: Any,
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
    plan: CallPlan = self._plan
    state: CallState = self._state
    if plan.is_compiling():
        dests = None
        if out is not None:  # fake tensors have no data pointers: the custom op tests the overlaps
            dests = [t for _, t in check_out_tensors(plan.out_rules, out, hidden_states.shape[0])]
        result = call_custom_op(self, plan.handle, hidden_states, residual, weight, scale, dests)
        return result if out is None else copy_into(result, out, plan.inplace)
    owner = state.owner  # 0 at TP 1; else the thread that owns the group (arnorm.op._faults)
    if owner:
        if owner != get_ident():
            raise thread_error(owner)
        if (plan.inplace or out is not None) and _inference_target(hidden_states, out):
            # Made under torch.inference_mode(): the writes after the collective are allowed only
            # there (TP 1 pays nothing for this test: see the end of this function).
            import torch

            if not torch.is_inference_mode_enabled():
                with torch.inference_mode():
                    return call(self, hidden_states, residual, weight, scale, out=out)
    token = state.token
    try:
        token.pop()
    except IndexError:
        raise _busy(state) from None
    agreed = False  # check mode: a rejection every rank agreed on, in no collective's slot
    try:
        if plan.check_calls:
            if plan.closed:  # a closed op holds no group to agree over
                raise InvalidInputError(CLOSED)
            if plan.poisoned is not None:  # before agreeing: the peers' ops are poisoned too
                raise PeerError(plan.poisoned)
            state.seq += 1
            try:
                agree_call(plan, state.seq, hidden_states, residual, weight, scale, out)
            except InvalidInputError:
                agreed = True  # the same error on every rank, none of which entered the collective
                raise
            except BaseException as exc:  # a timeout, a peer's note, an interrupt: the ranks may part here
                call_failed(self, exc)
                raise
        fast = None
        sp = rp = rn = 0  # no residual: an empty range at 0, which no output or input overlaps
        h, row_bytes, dt = plan.hidden, plan.row_bytes, plan.dtype
        try:
            shape = hidden_states.shape
            t = shape[0]
            hp, wp = hidden_states.data_ptr(), weight.data_ptr()
            if residual is None:
                if hidden_states.is_contiguous():
                    hn = t * row_bytes
                    ok = not plan.add_residual
                    fast = plan.fast_table[t]
                elif plan.strided:
                    hst = hidden_states.stride()
                    hn = ((t - 1) * hst[0] + h) * plan.itemsize
                    ok = not plan.add_residual and (h == 1 or hst[1] == 1) and (t == 1 or hst[0] >= h)
                else:
                    ok = False
                if plan.on_cpu:  # is_cpu and get_device() both exclude meta tensors, and are cheap
                    ok = ok and hidden_states.is_cpu
                else:
                    ok = ok and hidden_states.get_device() == plan.device_index
            else:
                rp = residual.data_ptr()
                if hidden_states.is_contiguous() and residual.is_contiguous():
                    hn = rn = t * row_bytes
                    ok = abs(hp - rp) >= hn
                    fast = plan.fast_table[t]
                elif plan.strided:
                    hst, rst = hidden_states.stride(), residual.stride()
                    hn = ((t - 1) * hst[0] + h) * plan.itemsize
                    rn = ((t - 1) * rst[0] + h) * plan.itemsize
                    ok = (h == 1 or hst[1] == rst[1] == 1) and (t == 1 or (hst[0] >= h and rst[0] >= h))
                    ok = ok and (hp >= rp + rn or rp >= hp + hn)
                else:
                    ok = False
                if plan.on_cpu:
                    ok = ok and hidden_states.is_cpu and residual.is_cpu
                else:
                    index = plan.device_index
                    ok = ok and hidden_states.get_device() == index and residual.get_device() == index
                ok = (
                    ok
                    and plan.add_residual
                    and residual.dtype is dt
                    and residual.shape == shape
                    and not residual.is_neg()
                )
            ok = (
                ok
                and hidden_states.dtype is dt
                and len(shape) == 2
                and shape[1] == h
                and 0 < t <= plan.max_tokens
                and not hidden_states.is_neg()  # a lazy negation: pointer-based backends ignore the bit
                and (
                    (weight is state.last_weight and wp == state.last_wptr)
                    or state.weights.get(id(weight)) == wp
                    or _trust_weight(plan.rules, state, weight, wp)
                )
                and (wp >= hp + hn or hp >= wp + row_bytes)
            )
            if scale is not None:
                sp = scale.data_ptr()
                ok = (
                    ok
                    and (state.scales.get(id(scale)) == sp or _trust_scale(plan.rules, state, scale, sp))
                    and (sp >= hp + hn or hp >= sp + 4)
                )
            elif plan.scaled:
                ok = False
            grad = (
                ok
                and plan.grad_enabled()
                and (
                    hidden_states.requires_grad
                    or (residual is not None and residual.requires_grad)
                    or weight.requires_grad
                )
            )
            if grad and plan.inplace and hidden_states.requires_grad and hidden_states.is_leaf:
                ok = False
            if grad and plan.rules.writes_residual and residual.requires_grad and residual.is_leaf:  # type: ignore[union-attr]
                ok = False
        except (AttributeError, TypeError, IndexError, RuntimeError):
            ok = grad = False
        if not ok:
            check_call(plan.rules, hidden_states, residual, weight, scale)  # raises: says what is wrong
            grad = plan.grad_enabled() and _requires_grad(hidden_states, residual, weight)
            t = hidden_states.shape[0]
        if out is not None:
            # A trusted out (every out= call pays this test): each destination kept its data pointer
            # and shape and shares no byte with an input; else the full check, which raises.
            spans = state.out_spans.get(id(out))
            if spans is not None and spans[0] == t and ok:
                he, re_, we, se = hp + hn, rp + rn, wp + row_bytes, sp + 4 if scale is not None else 0
                for dest, a, b, dshape in spans[1]:
                    if dest.data_ptr() != a or dest.shape != dshape or (
                        (a < he and hp < b) or (a < re_ and rp < b) or (a < we and wp < b)
                        or (a < se and sp < b)
                    ):  # fmt: skip
                        spans = None
                        break
            else:
                spans = None
            if spans is None:
                spans = checked_out(plan.out_rules, out, t, (hidden_states, residual, weight, scale))
                if len(state.out_held) >= OUT_TRUST_LIMIT:
                    state.out_spans.clear()
                    state.out_held.clear()
                state.out_spans[id(out)] = spans
                state.out_held.append(out)
        impl = plan.table[t]
        if impl is None:
            raise InvalidInputError(CLOSED) if plan.closed else no_backend(t)
        try:
            if fast is not None and ok:
                served = fast(t, hidden_states, residual, weight, scale, out, hp, rp, wp, sp)
                if served is not None:
                    result = served
                    if out is not None:
                        if not (
                            type(result) is Output
                            # out.normed None: the in-place layout, the normed output over hidden_states
                            and (result.normed is out.normed or out.normed is None)
                            and result.quant is out.quant
                            and (plan.inplace or result.residual is out.residual)
                        ):
                            name = _name(plan, t)
                            result = returned_out(result, out, plan.out_rules, name, plan.explanation)
                    elif not state.fast_checked[t]:
                        problem = check_result(plan.out_rules, result, t)
                        if problem:
                            raise broken_result(_name(plan, t), t, problem, plan.explanation)
                        state.fast_checked[t] = True
                    return guard(result, hidden_states, residual, weight) if grad else result
            if out is None:
                result = impl(hidden_states, residual, weight, scale)
                if not state.checked[t]:
                    problem = check_result(plan.out_rules, result, t)
                    if problem:
                        raise broken_result(_name(plan, t), t, problem, plan.explanation)
                    state.checked[t] = True
            else:
                result = plan.into_table[t](hidden_states, residual, weight, scale, out)  # type: ignore[misc]
                result = returned_out(result, out, plan.out_rules, _name(plan, t), plan.explanation)
        except BaseException as exc:
            call_failed(self, exc)  # at TP > 1 the backend's collectives may be out of step: poisoned
            if getattr(exc, "busy_state", None) is state:  # this op's call, made inside this one
                raise InvalidInputError(_REENTERED) from None
            raise
        return guard(result, hidden_states, residual, weight) if grad else result
    except BaseException as exc:
        if not _retry_in_inference_mode(plan, exc, hidden_states, out):
            now = self._plan  # poisoned or closed meanwhile: nothing to tell the peers
            if not agreed and now.poisoned is None and not now.closed:
                call_rejected(now.comm)  # before its collective: tell the peers (comm._steps)
            raise
    finally:
        token.append(None)
    # TP 1, tensors made under torch.inference_mode(): no collective ran, so the call is made again
    # there, where torch allows its writes (valid calls never get here).
    import torch

    with torch.inference_mode():
        return call(self, hidden_states, residual, weight, scale, out=out)


def _busy(state: CallState) -> InvalidInputError:
    """The error of a call that found the op's call token taken. When the call holding it is on this
    thread (a backend or hook called the op again), the error reaches that call, which knows it by
    its ``busy_state`` and names the re-entry (built here, not in the call: a local of the call's
    frame holding its own exception would keep the op alive for the collector)."""
    error = InvalidInputError(_BUSY)
    error.busy_state = state  # type: ignore[attr-defined]
    return error


def _requires_grad(hidden_states: Any, residual: Any, weight: Any) -> bool:
    residual_grad = residual is not None and residual.requires_grad
    return bool(hidden_states.requires_grad or residual_grad or weight.requires_grad)


def _name(plan: CallPlan, t: int) -> str:
    """The name of the backend serving ``t`` tokens (a fast path is its backend's)."""
    impl = plan.table[t]
    for name, c in zip(plan.names, plan.chain, strict=True):
        if c is impl:
            return name
    return plan.names[0]


def no_backend(num_tokens: int) -> NoEligibleBackendError:
    return NoEligibleBackendError(
        f"tokens: {num_tokens} (needs a token count some backend of this op serves; "
        f"see op.explain({num_tokens}))"
    )


# -- trust: weights and scales checked in full once, then by identity and data pointer -------------


def _keep(state: CallState, table: dict[int, int], t: Any, ptr: int) -> bool:
    if len(state.held) >= TRUST_LIMIT:
        state.weights.clear()
        state.scales.clear()
        state.held.clear()
    table[id(t)] = ptr
    state.held.append(t)  # kept alive: an id is never reused by another tensor while trusted
    return True


def _trust_weight(r: CallRules, state: CallState, w: Any, ptr: int) -> bool:
    """Check ``w`` fully and trust it when it passes (``ptr`` is its data pointer); the weight of
    the last call is then checked by identity alone (one op per layer); an op shared by the layers
    finds the others in the table. Weights and scales have separate tables: a trusted scale passed
    as a weight is checked as a weight."""
    ok = w.dtype is r.dtype and w.shape == (r.hidden,) and w.device == r.device and w.is_contiguous()
    if ok and not w.is_neg() and _keep(state, state.weights, w, ptr):
        state.last_weight, state.last_wptr = w, ptr
        return True
    return False


def _trust_scale(r: CallRules, state: CallState, s: Any, ptr: int) -> bool:
    """Check the fp32 ``[1]`` scale fully and trust it when it passes."""
    import torch

    ok = r.needs_scale and s.dtype is torch.float32 and s.shape == (1,) and s.device == r.device
    return ok and not s.is_neg() and _keep(state, state.scales, s, ptr)


# -- tensors made under torch.inference_mode() -------------------------------------------------------


def _inference_target(hidden_states: Any, out: Any) -> str:
    """The argument the call writes that is an inference tensor (made under
    ``torch.inference_mode()``): ``hidden_states`` (an in-place op) or a destination of ``out``;
    ``""`` for none (anything that is not a tensor is left to the rule)."""
    try:
        if hidden_states.is_inference():
            return "hidden_states"
        if out is None:
            return ""
        quant = getattr(out, "quant", None)
        named = (("out.normed", out.normed), ("out.residual", out.residual),
                 ("out.quant.data", getattr(quant, "data", None)),
                 ("out.quant.scale", getattr(quant, "scale", None)))  # fmt: skip
        for name, t in named:
            if t is not None and t.is_inference():
                return name
    except (AttributeError, TypeError):
        pass
    return ""


def _retry_in_inference_mode(plan: CallPlan, exc: BaseException, hidden_states: Any, out: Any) -> bool:
    """After a call raised ``exc`` at TP 1 (no collective), outside inference mode, on tensors made
    under ``torch.inference_mode()`` (outside it, torch refuses the first write into one, after the
    write): ``True`` when the call is to be made again inside inference mode (it wrote only into
    ``out``, which the retry writes in full); for an in-place op raise :class:`InvalidInputError`
    naming the inference tensor (``hidden_states`` may already hold the new residual, so the call
    cannot be made again); else ``False``. Valid calls pay nothing for this."""
    if not isinstance(exc, RuntimeError) or plan.comm is None or plan.comm.world_size != 1:
        return False
    which = _inference_target(hidden_states, out) if plan.inplace or out is not None else ""
    if not which:
        return False
    import torch

    if torch.is_inference_mode_enabled():
        return False
    if not plan.inplace:
        return True
    made = "a buffer" if which.startswith("out") else "a tensor"
    raise InvalidInputError(
        f"{which}: an inference tensor (made under torch.inference_mode()) written outside inference "
        "mode, which torch refuses after the write (hidden_states may already hold the new residual) "
        f"(needs the call inside torch.inference_mode(), as engines make it, or {made} made outside it; "
        "at TP > 1 such calls run in inference mode by themselves)"
    ) from exc


# -- the rule in words -------------------------------------------------------------------------------


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _rows_ok(t: Any, rules: CallRules) -> bool:
    if not rules.strided_rows:
        return bool(t.is_contiguous())
    rows, h = t.stride()
    return (h == 1 or rules.hidden == 1) and (t.shape[0] == 1 or rows >= rules.hidden)


def _layout_message(arg: str, t: Any, rules: CallRules) -> str:
    if rules.strided_rows:
        return (
            f"{arg}: strides {list(t.stride())} (needs column stride 1 and row stride >= {rules.hidden}; "
            "pass .contiguous())"
        )
    return (
        f"{arg}: non-contiguous, strides {list(t.stride())} (needs .contiguous(); this op's backends "
        "take no strided rows)"
    )


def _check_tensor(arg: str, t: object, rules: CallRules) -> torch.Tensor:
    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{arg}: {type(t).__name__} (needs a torch.Tensor)")
    if t.layout != torch.strided or t.is_nested:
        layout = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise InvalidInputError(f"{arg}: layout {layout} (needs a dense torch.strided tensor)")
    if t.dtype != rules.dtype:
        raise InvalidInputError(f"{arg}: dtype {t.dtype} (needs {rules.dtype}, the op's dtype)")
    if t.device != rules.device:
        raise InvalidInputError(f"{arg}: device {t.device} (needs {rules.device}, the op's device)")
    _check_lazy_bits(arg, t)
    return t


def _check_lazy_bits(arg: str, t: Any) -> None:
    """A tensor whose negation or conjugation is a bit, not its memory: a backend reading the data
    pointer (a Triton or CUDA kernel, a fast path) would ignore it and compute wrong values."""
    if t.is_neg():
        raise InvalidInputError(
            f"{arg}: negative bit set, a lazy negation such as torch._neg_view(t) or z.conj().imag "
            f"(needs {arg}.resolve_neg(): backends read the memory, not the bit)"
        )
    if t.is_conj():
        raise InvalidInputError(
            f"{arg}: conjugate bit set (needs {arg}.resolve_conj(): backends read the memory, not the bit)"
        )


def _check_residual(residual: object, shape: tuple[int, ...], rules: CallRules) -> torch.Tensor | None:
    if not rules.add_residual:
        if residual is not None:
            raise InvalidInputError(
                f"residual: {type(residual).__name__} (needs None: the op was built with add_residual=False)"
            )
        return None
    if residual is None:
        raise InvalidInputError(
            f"residual: None (needs a [tokens, {rules.hidden}] tensor; for a norm with no residual add, "
            "build the op with add_residual=False)"
        )
    res = _check_tensor("residual", residual, rules)
    if tuple(res.shape) != shape:
        raise InvalidInputError(
            f"residual: shape {list(res.shape)} (needs {list(shape)}, the shape of hidden_states)"
        )
    return res


def check_call(
    rules: CallRules, hidden_states: object, residual: object, weight: object, scale: object
) -> None:
    """Raise :class:`InvalidInputError` for the first thing wrong with a call's arguments."""
    import torch

    h, t_max = rules.hidden, rules.max_tokens
    hs = _check_tensor("hidden_states", hidden_states, rules)
    shape = tuple(hs.shape)
    if len(shape) != 2 or shape[1] != h:
        raise InvalidInputError(f"hidden_states: shape {list(shape)} (needs [tokens, {h}], hidden_size={h})")
    if not 1 <= shape[0] <= t_max:
        fix = "skip a call with no tokens" if shape[0] < 1 else "build the op with a larger max_tokens"
        raise InvalidInputError(f"hidden_states: {shape[0]} tokens (needs 1 to {t_max}; {fix})")
    res = _check_residual(residual, shape, rules)
    for arg, t in (("hidden_states", hs), ("residual", res)):
        if t is not None and not _rows_ok(t, rules):
            raise InvalidInputError(_layout_message(arg, t, rules))
    w = _check_tensor("weight", weight, rules)
    if tuple(w.shape) != (h,):
        raise InvalidInputError(f"weight: shape {list(w.shape)} (needs [{h}])")
    if not w.is_contiguous():
        raise InvalidInputError(f"weight: non-contiguous, strides {list(w.stride())} (needs .contiguous())")
    if rules.needs_scale:
        what = "dequant" if rules.quant and FORMAT_SPECS[rules.quant].returns_input_scale else "global encode"
        if scale is None:
            raise InvalidInputError(
                f"scale: missing (needs the fp32 [1] {what} scale for quant={rules.quant!r})"
            )
        if not isinstance(scale, torch.Tensor):
            raise InvalidInputError(
                f"scale: {type(scale).__name__} (needs a torch.Tensor of dtype float32, shape [1])"
            )
        if scale.dtype != torch.float32:
            raise InvalidInputError(f"scale: dtype {scale.dtype} (needs torch.float32)")
        if tuple(scale.shape) != (1,):
            raise InvalidInputError(f"scale: shape {list(scale.shape)} (needs [1])")
        if scale.device != rules.device:
            raise InvalidInputError(f"scale: device {scale.device} (needs {rules.device}, the op's device)")
        _check_lazy_bits("scale", scale)
    elif scale is not None:
        raise InvalidInputError(
            f"scale: {type(scale).__name__} (needs None: quant={rules.quant!r} takes no input scale)"
        )
    hs_span = span(hs, shape[0], h)
    if res is not None and _overlap(hs_span, span(res, shape[0], h)):
        raise InvalidInputError("residual: overlaps hidden_states' memory (needs a separate buffer)")
    if _overlap(hs_span, span(w, 1, h)):
        raise InvalidInputError("weight: overlaps hidden_states' memory (needs a separate buffer)")
    if isinstance(scale, torch.Tensor) and _overlap(hs_span, span(scale, 1, 1)):
        raise InvalidInputError("scale: overlaps hidden_states' memory (needs a separate buffer)")
    if rules.inplace and torch.is_grad_enabled() and hs.requires_grad and hs.is_leaf:
        raise InvalidInputError(
            "hidden_states: a leaf tensor that requires grad (needs .detach() or torch.no_grad(): "
            "the op writes the new residual into it)"
        )
    written = res if rules.writes_residual else None
    if written is not None and torch.is_grad_enabled() and written.requires_grad and written.is_leaf:
        raise InvalidInputError(
            "residual: a leaf tensor that requires grad (needs .detach() or torch.no_grad(): the op, "
            "built with output_layout='in_place', writes the new residual into it)"
        )


# -- check mode (ARNORM_CHECK_CALLS): every call agreed across ranks first -----------------------------


def agree_call(
    plan: CallPlan,
    seq: int,
    hidden_states: Any,
    residual: Any,
    weight: Any,
    scale: Any,
    out: Any = None,
    rules: CallRules | None = None,
) -> None:
    """Gather every rank's fingerprint of call number ``seq`` (shapes, dtypes, devices, whether a
    scale came, and the local verdict on the arguments, ``out=`` included) before the collective,
    and raise the same error on every rank when they differ or any rank rejects its arguments."""

    def fingerprint(t: Any) -> Any:
        try:
            return f"{list(t.shape)} {t.dtype} {t.device.type}"
        except Exception:  # not a tensor, or one without sizes (nested)
            return type(t).__name__

    try:
        check_call(rules or plan.rules, hidden_states, residual, weight, scale)
        if out is not None:
            checked_out(plan.out_rules, out, hidden_states.shape[0], (hidden_states, residual, weight, scale))
        error = ""
    except Exception as exc:  # whatever it is, every rank must learn of it before the collective
        error = str(exc) if isinstance(exc, InvalidInputError) else f"{type(exc).__name__}: {exc}"
    mine = (seq, fingerprint(hidden_states), fingerprint(residual), fingerprint(weight), scale is None, error)
    assert plan.comm is not None
    seen = plan.comm.gather_objects(mine)
    if all(s == seen[0] for s in seen):
        if not error:
            return
        # The same call, rejected the same way on every rank (or the only rank): that is the error.
        raise InvalidInputError(error)
    detail = "; ".join(
        f"rank {r}: call {s[0]}, hidden_states {s[1]}, residual {s[2]}, weight {s[3]}, "
        f"scale {'none' if s[4] else 'given'}" + (f", rejected: {s[5]}" if s[5] else "")
        for r, s in enumerate(seen)
    )
    raise InvalidInputError(
        f"calls: differ across ranks or were rejected ({detail}) (needs the same call on every rank)"
    )


def agree_larger_call(op: Any, hidden_states: Any, residual: Any, weight: Any, scale: Any) -> None:
    """Check mode, ``fused_allreduce_norm``: a call with more tokens than ``op``'s budget is agreed
    on every rank (as the call itself would be) before a larger op is built."""
    import dataclasses

    plan: CallPlan = op._plan
    state: CallState = op._state
    state.seq += 1
    rules = dataclasses.replace(plan.rules, max_tokens=int(hidden_states.shape[0]))
    agree_call(plan, state.seq, hidden_states, residual, weight, scale, None, rules)
