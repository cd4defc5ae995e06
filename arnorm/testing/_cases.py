"""What one conformance case runs on each rank, as plain functions spawned ranks can import.

A case ends in one of three ways (:attr:`CaseResult.outcome`): ``"ran"`` (with the comparison
against the reference), ``"skipped"`` (the backend is merely ineligible for it on this machine:
its verdict is ``incompatible``) or ``"error"`` (anything else: the backend is broken, failed to
build, raised in the call, returned the wrong outputs). The decision reads the selection error's
:class:`arnorm.Explanation` (``exc.explanation.verdict(backend).status``), never its message.
"""

from __future__ import annotations

import dataclasses
import traceback
import zlib
from dataclasses import dataclass
from typing import Any

from arnorm._formats import FORMAT_SPECS
from arnorm._norm import NORM_OPTIONS
from arnorm._types import RMSNorm
from arnorm.testing._compare import (
    CodeMismatch,
    Mismatch,
    compare,
    compare_codes,
    expected_normed,
    first_difference,
)

__all__ = [
    "PADDING",
    "SKIP_STATUSES",
    "Case",
    "CaseResult",
    "bad_inputs_then_good",
    "build",
    "exact_inputs",
    "input_scale",
    "run_cases",
]

#: Verdicts that mean "ineligible on this machine": the case is skipped, with the reasons.
SKIP_STATUSES = frozenset({"incompatible"})
#: Strided cases: (extra columns, their value) of the buffers ``hidden_states`` and ``residual`` are
#: ``[:, :H]`` views of. The widths differ, so a backend that takes one row stride for both is seen;
#: the values are far from the inputs, so one that reads the padding is seen too.
PADDING = {"hidden_states": (64, -7.5), "residual": (32, 5.25)}


@dataclass(frozen=True)
class Case:
    """One problem: shape, dtype, format (with layout) and norm."""

    tokens: int
    hidden: int
    dtype: str
    quant: str | None
    layout: str | None
    weight_offset: float
    #: The options of the norm turned on (``RMSNorm.options``: names of :data:`arnorm.plugin.NORM_OPTIONS`).
    norm_options: frozenset[str] = frozenset()
    add_residual: bool = True
    #: The op's build options (``AllReduceNorm(inplace=, normed_output=)``).
    inplace: bool = True
    normed_output: bool = True
    #: ``hidden_states`` and ``residual`` are ``[:, :H]`` views of wider buffers (row stride above H).
    strided: bool = False
    #: The call passes caller-owned buffers (``out=op.empty_output(T)``, filled with NaN first).
    out: bool = False
    #: ``AllReduceNorm(output_layout=)``: ``"in_place"`` writes the normed output over
    #: ``hidden_states`` and the new residual over ``residual``.
    output_layout: str = "separate"

    @property
    def norm(self) -> RMSNorm:
        """The op's norm: epsilon 1e-6, the case's offset and options."""
        return RMSNorm.with_options(1e-6, self.weight_offset, self.norm_options)

    @property
    def id(self) -> str:
        # Readable in a failure list: the words Problem.short() uses, not letter codes.
        q = self.quant or "none"
        if self.layout:
            q += f"/{self.layout}"
        norm = {0.0: "plain", 1.0: "gemma"}.get(self.weight_offset, f"offset={self.weight_offset:g}")
        options = "".join(f"-{o.label}" for n, o in NORM_OPTIONS.items() if n in self.norm_options)
        nores = "" if self.add_residual else "-no-residual"
        copy = "" if self.inplace else "-not-inplace"
        nonormed = "" if self.normed_output else "-no-normed-output"
        strided = "-strided" if self.strided else ""
        out = "-out" if self.out else ""
        in_place = "-in-place" if self.output_layout == "in_place" else ""
        variant = f"{options}{nores}{copy}{in_place}{nonormed}{strided}{out}"
        return f"{self.dtype}-{q}-T{self.tokens}-H{self.hidden}-{norm}{variant}"


@dataclass(frozen=True)
class CaseResult:
    """How the backend did on one case, on one rank.

    ``status`` is the backend's verdict when the op could not be built (``reasons`` its reasons);
    ``error`` says what went wrong for an ``"error"`` outcome. ``residual``, ``normed``, ``codes``
    and ``scales`` describe the differences from the reference (``None`` / ``""``: none).
    """

    case: Case
    outcome: str
    status: str = ""
    reasons: tuple[str, ...] = ()
    error: str = ""
    residual: Mismatch | None = None
    normed: Mismatch | None = None
    codes: CodeMismatch | None = None
    scales: str = ""


def exact_inputs(case: Case, world: int, device: Any) -> tuple[list[Any], Any, Any, Any]:
    """Partials whose fp32 sum is exact in any order (multiples of 2**-8 in [-4, 4]), so every
    correct backend reduces to the same ``s`` and the residual can be compared bit for bit."""
    import torch

    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))  # str hash differs per process

    def grid(*shape: int) -> Any:
        return (torch.randint(-1024, 1025, shape, generator=g).float() / 256).to(dtype).to(device)

    partials = [grid(case.tokens, case.hidden) for _ in range(world)]
    residual = grid(case.tokens, case.hidden)
    weight = (torch.randn(case.hidden, generator=g) * 0.2).to(dtype).to(device)
    return partials, residual, weight, input_scale(case, device)


def _group() -> Any:
    """WORLD inside ranks spawned by ``run_ranks``, ``arnorm.LOCAL`` in a single process."""
    import torch.distributed as dist

    import arnorm

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else arnorm.LOCAL


def input_scale(case: Case, device: Any) -> Any:
    """The fp32 ``[1]`` input scale of ``case``'s format (its sample scale), ``None`` for the others."""
    import torch

    sample = FORMAT_SPECS[case.quant].sample_scale if case.quant else None
    return torch.tensor([sample], device=device) if sample is not None else None


def build(
    backend: str, case: Case, device: Any, max_tokens: int, config: Any = None
) -> tuple[Any, CaseResult | None]:
    """Build the op of ``case`` strictly on ``backend`` (with ``config``, an ``arnorm.Config``, if
    given): ``(op, None)``, or ``(None, result)`` when it could not be."""
    import torch

    import arnorm

    try:
        op = arnorm.AllReduceNorm(
            _group(),
            hidden_size=case.hidden,
            dtype=getattr(torch, case.dtype),
            norm=case.norm,
            quant=case.quant,
            scale_layout=case.layout,
            max_tokens=max_tokens,
            backend=backend,
            device=device,
            add_residual=case.add_residual,
            inplace=case.inplace,
            normed_output=case.normed_output,
            config=config,
            **({} if case.output_layout == "separate" else {"output_layout": case.output_layout}),
        )
    except arnorm.SelectionError as exc:
        verdict = exc.explanation.verdict(backend) if exc.explanation is not None else None
        if verdict is None:
            return None, CaseResult(
                case, "error", error=f"{type(exc).__name__} without a verdict for {backend}: {exc}"
            )
        outcome = "skipped" if verdict.status in SKIP_STATUSES else "error"
        reasons = verdict.reasons or ("(no reason given)",)
        error = "" if outcome == "skipped" else f"{verdict.status}: " + "; ".join(reasons)
        return None, CaseResult(case, outcome, status=verdict.status, reasons=reasons, error=error)
    except arnorm.ArnormError as exc:
        return None, CaseResult(case, "error", error=f"building the op raised {type(exc).__name__}: {exc}")
    except Exception:
        return None, CaseResult(case, "error", error=f"building the op raised:\n{traceback.format_exc()}")
    return op, None


def _what(value: Any) -> str:
    """``None``, ``a tuple of 3 items``, ``a Tensor``: what a backend handed back, in a message."""
    if value is None:
        return "None"
    if isinstance(value, tuple):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def _shape_error(name: str, tensor: Any, shape: tuple[int, ...], dtype: Any) -> str:
    import torch

    want = f"{list(shape)} {str(dtype).removeprefix('torch.')}"
    if not isinstance(tensor, torch.Tensor):
        return f"{name}: {_what(tensor)} (needs a tensor {want})"
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        found = f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
        return f"{name}: {found} (needs {want})"
    return ""


def _padded(t: Any, arg: str) -> tuple[Any, Any]:
    """``(buffer, view)``: ``t`` copied into the first columns of a wider buffer of :data:`PADDING`."""
    import torch

    extra, value = PADDING[arg]
    rows, cols = t.shape
    buf = torch.full((rows, cols + extra), value, dtype=t.dtype, device=t.device)
    buf[:, :cols] = t
    return buf, buf[:, :cols]


def _shares_memory(a: Any, b: Any) -> bool:
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _in_place_problems(case: Case, out: Any, x: Any, residual: Any) -> list[str]:
    """The in-place layout: the result's residual is ``residual`` itself, its normed output
    ``hidden_states`` itself. Without a normed output ``hidden_states`` may hold anything after
    the call (a backend may all-reduce into it), as with any in-place op."""
    import torch

    problems = []
    got = out.residual if isinstance(out.residual, torch.Tensor) else None
    if got is not None and residual is not None and got.data_ptr() != residual.data_ptr():
        problems.append(
            "Output.residual: not residual itself (needs the new residual written over residual: the "
            "op was built with output_layout='in_place')"
        )
    normed = out.normed if isinstance(out.normed, torch.Tensor) else None
    if case.normed_output and normed is not None and normed.data_ptr() != x.data_ptr():
        problems.append(
            "Output.normed: not hidden_states itself (needs the normed output written over "
            "hidden_states: the op was built with output_layout='in_place')"
        )
    return problems


def _layout_problems(
    case: Case, out: Any, x: Any, x_before: Any, buffers: dict[str, Any], residual: Any = None
) -> list[str]:
    """Where the call wrote what it must not have, or returned hidden_states where it must not."""
    import torch

    problems = []
    got = out.residual if isinstance(out.residual, torch.Tensor) else None
    if case.output_layout == "in_place":
        problems += _in_place_problems(case, out, x, residual)
    elif case.inplace:
        if got is not None and got.data_ptr() != x.data_ptr():
            problems.append("Output.residual: a new tensor (needs hidden_states itself: the op is in place)")
    else:
        if got is not None and _shares_memory(got, x):
            problems.append(
                "Output.residual: hidden_states' memory (needs a new tensor: the op was built with "
                "inplace=False)"
            )
        if not torch.equal(x, x_before):
            problems.append(
                "hidden_states: written by the call (needs it unchanged: the op was built with inplace=False)"
            )
    t, h = case.tokens, case.hidden
    for arg, buf in buffers.items():
        extra, value = PADDING[arg]
        pad = buf[:, h:]
        if not torch.equal(pad, torch.full_like(pad, value)):
            problems.append(
                f"{arg}: written past its [{t}, {h}] view, in the padding of its buffer (row stride "
                f"{h + extra}; needs only the view's elements written)"
            )
    return problems


def _nan_output(op: Any, tokens: int) -> Any:
    """``op.empty_output(tokens)`` with every float destination NaN: an unwritten one cannot pass."""
    dest = op.empty_output(tokens)
    for t in (dest.normed, dest.residual):
        if t is not None:
            t.fill_(float("nan"))
    return dest


def _out_problems(out: Any, dest: Any) -> list[str]:
    """Where the call did not hand back the caller's ``out=`` tensors (their values are judged as
    the result's, so an unwritten buffer also fails on its NaN)."""
    import torch

    problems = []
    for field in ("normed", "residual"):
        want = getattr(dest, field)
        got = getattr(out, field)
        if want is not None and not (isinstance(got, torch.Tensor) and got.data_ptr() == want.data_ptr()):
            problems.append(
                f"Output.{field}: not out.{field} (needs the caller's buffer passed as out=, "
                "written and returned)"
            )
    return problems


def _twin_normed(twin: Any, x: Any, residual: Any, weight: Any, scale: Any) -> tuple[Any, str]:
    """The normed output of the op's ``normed_output=True`` twin on the same inputs: ``(normed, "")``
    or ``(None, what went wrong)``."""
    import torch

    from arnorm.plugin import Output

    what = "the same op built with normed_output=True (its normed output judges the quant output)"
    try:
        out = twin(x, residual, weight, scale)
    except Exception:
        return None, f"{what} raised:\n{traceback.format_exc()}"
    if not isinstance(out, Output) or not isinstance(out.normed, torch.Tensor):
        return None, f"{what}: returned {_what(out)} (needs an arnorm.plugin.Output with a normed tensor)"
    return out.normed, ""


def _check(case: Case, op: Any, rank: int, world: int, device: Any, twin: Any = None) -> CaseResult:
    """One call on exact inputs, compared with the reference steps of :mod:`arnorm.plugin`.

    ``twin``: for a ``normed_output=False`` case, the same op with a normed output; the quantized
    output is judged against ``arnorm.quant`` of that op's normed output on the same inputs.
    """
    import torch

    from arnorm._reference import apply_norm
    from arnorm.plugin import Output, QuantizedActivation, format_spec, rank_order_sum
    from arnorm.quant import quantize

    partials, residual, weight, scale = exact_inputs(case, world, device)
    if not case.add_residual:
        residual = None
    x = partials[rank].clone()
    buffers: dict[str, Any] = {}
    if case.strided:
        buffers["hidden_states"], x = _padded(x, "hidden_states")
        if residual is not None:
            buffers["residual"], residual = _padded(residual, "residual")
    residual_before = None if residual is None else residual.clone()
    weight_before = weight.clone()
    dest = _nan_output(op, case.tokens) if case.out else None
    try:
        out = op(x, residual, weight, scale, out=dest)
    except Exception:
        return CaseResult(case, "error", error=f"the call raised:\n{traceback.format_exc()}")
    if not isinstance(out, Output):
        return CaseResult(
            case,
            "error",
            error=f"what {op.backend}'s __call__ returned: {_what(out)} "
            "(needs an arnorm.plugin.Output(normed, residual, quant))",
        )
    dtype = getattr(torch, case.dtype)
    shape = (case.tokens, case.hidden)
    problems = [_shape_error("Output.residual", out.residual, shape, dtype)]
    if case.normed_output:
        problems.append(_shape_error("Output.normed", out.normed, shape, dtype))
    elif out.normed is not None:
        problems.append(
            f"Output.normed: {_what(out.normed)} (needs None: the op was built with normed_output=False)"
        )
    problems += _layout_problems(case, out, x, partials[rank], buffers, residual)
    if dest is not None:
        problems += _out_problems(out, dest)
    in_place = case.output_layout == "in_place"
    if (
        not in_place
        and residual is not None
        and residual_before is not None
        and not torch.equal(residual, residual_before)
    ):
        problems.append(
            "residual: written by the call (needs it unchanged: only hidden_states may be written)"
        )
    if not torch.equal(weight, weight_before):
        problems.append("weight: written by the call (needs it unchanged)")
    if case.quant is not None:
        spec = format_spec(case.quant)
        got_q = out.quant
        if not isinstance(got_q, QuantizedActivation):
            problems.append(
                f"Output.quant: {_what(got_q)} (needs the {case.quant} output, an "
                "arnorm.plugin.QuantizedActivation)"
            )
        else:
            data_dtype = getattr(torch, spec.data_dtype)
            problems.append(
                _shape_error("Output.quant.data", got_q.data, spec.data_shape(*shape), data_dtype)
            )
    problems = [p for p in problems if p]
    if problems:
        return CaseResult(case, "error", error="; ".join(problems))
    reduced = rank_order_sum(partials)
    h, y = apply_norm(reduced, residual_before, weight_before, case.norm)
    normed = None
    if case.normed_output:
        y = expected_normed(out.normed, y, h, reduced, residual_before, weight_before, case.norm)
        normed = compare(out.normed, y)
    result = CaseResult(case, "ran", residual=compare(out.residual, h), normed=normed)
    if case.quant is None:
        return result
    # The quantizer is judged on the backend's own normed output: a 1-ulp normed difference must
    # not count twice.
    own: Any = out.normed
    quant_out: Any = out.quant  # checked above: a QuantizedActivation of the right shape
    if not case.normed_output:
        own, error = _twin_normed(
            twin,
            partials[rank].clone(),
            None if residual_before is None else residual_before.clone(),
            weight_before,
            scale,
        )
        if own is None:
            return CaseResult(case, "error", error=error)
    expect = quantize(own, case.quant, scale=scale, layout=op.problem.scale_layout)
    codes = compare_codes(
        quant_out.data, expect.data, packed_fp4=FORMAT_SPECS[case.quant].elements_per_byte == 2
    )
    scales = first_difference(quant_out.scale, expect.scale)
    return dataclasses.replace(result, codes=codes, scales=scales)


def run_case(backend: str, case: Case, rank: int, world: int, device: Any) -> CaseResult:
    """Build the backend strictly for ``case``, run it once, compare with the reference math."""
    max_tokens = max(64, case.tokens)
    op, failed = build(backend, case, device, max_tokens)
    if failed is not None:
        return failed
    twin = None
    try:
        if not case.normed_output:
            twin, failed = build(backend, dataclasses.replace(case, normed_output=True), device, max_tokens)
            if failed is not None:
                why = failed.error or f"{failed.status}: " + "; ".join(failed.reasons)
                return CaseResult(
                    case,
                    "error",
                    error=f"the same op built with normed_output=True (its normed output judges the "
                    f"quant output): {why}",
                )
        return _check(case, op, rank, world, device, twin)
    finally:
        op.close()
        if twin is not None:
            twin.close()


def _device(device: str) -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def run_cases(rank: int, world: int, backend: str, cases: list[Case], device: str) -> list[CaseResult]:
    """Every case on this rank (the entry point ``run_ranks`` spawns)."""
    dev = _device(device)
    return [run_case(backend, c, rank, world, dev) for c in cases]


def _bad_calls(
    case: Case, x: Any, residual: Any, weight: Any, scale: Any, max_tokens: int
) -> list[tuple[str, tuple[Any, ...]]]:
    import torch

    h = case.hidden
    other = torch.float16 if x.dtype != torch.float16 else torch.bfloat16
    too_many = torch.zeros(max_tokens + 1, h, dtype=x.dtype, device=x.device)
    calls = [
        (
            "hidden_states with half the columns",
            (x[:, : h // 2].contiguous(), residual[:, : h // 2].contiguous(), weight, scale),
        ),
        ("hidden_states in another dtype", (x.to(other), residual, weight, scale)),
        ("residual of another shape", (x, residual[:, ::2], weight, scale)),
        ("weight of half the length", (x, residual, weight[: h // 2].contiguous(), scale)),
        (
            f"{max_tokens + 1} tokens (max_tokens is {max_tokens})",
            (too_many, too_many.clone(), weight, scale),
        ),
        ("residual that is hidden_states itself", (x, x, weight, scale)),
    ]
    if scale is not None:
        calls.append(("scale None for a format that takes one", (x, residual, weight, None)))
    return calls


def bad_inputs_then_good(
    rank: int, world: int, backend: str, case: Case, device: str
) -> tuple[list[str], CaseResult]:
    """Each bad call's outcome on this rank (``""`` when it raised InvalidInputError), then a good call.

    Every rank makes the same bad calls: one that reached a collective on some ranks only would
    hang the run, which ``run_ranks`` reports as a failure at its timeout.
    """
    import arnorm

    dev = _device(device)
    max_tokens = max(64, case.tokens)
    op, failed = build(backend, case, dev, max_tokens)
    if failed is not None:
        return [], failed
    try:
        partials, residual, weight, scale = exact_inputs(case, world, dev)
        x = partials[rank].clone()
        outcomes = []
        for what, args in _bad_calls(case, x, residual, weight, scale, max_tokens):
            try:
                op(*args)
                outcomes.append(f"{what}: accepted (needs InvalidInputError)")
            except arnorm.InvalidInputError:
                outcomes.append("")
            except Exception as exc:
                outcomes.append(
                    f"{what}: raised {type(exc).__name__}: {exc} (needs arnorm.InvalidInputError)"
                )
        return outcomes, _check(case, op, rank, world, dev)
    finally:
        op.close()
