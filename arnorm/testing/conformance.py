"""The conformance suite: any registered backend against the reference, through the public API.

Subclass it in a backend's own tests and name the backend; pytest collects the methods::

    from arnorm.testing import ConformanceSuite

    class TestMyBackend(ConformanceSuite):
        backend = "mine"
        world_sizes = (1, 2, 4)

It needs pytest (``pip install 'arnorm[test]'``). For every dtype, format and norm the backend
*declares* (every declared scale layout at the first dtype, a format's first layout at the others),
at several shapes (odd token counts included), on each of ``world_sizes`` ranks (gloo on CPU; CUDA
tensors over gloo or NCCL on GPUs), it checks the numerics contract
(docs/numerics.md): the residual bit for bit (inputs are chosen so every correct reduction order
gives the same sum), the normed output within ``normed_ulps``, the quantized output equal to
``arnorm.quant`` applied to the backend's own normed output (``quant_mismatch`` allows a fraction
of codes off, for fast-math kernels); the call returns an ``arnorm.plugin.Output``; the residual is
``hidden_states`` itself (in place) and the residual and weight inputs are left unwritten. A few
more cases, for the first declared dtype at the largest shape, check the op's other forms: built
with ``inplace=False`` (``hidden_states`` left unwritten, the residual a new tensor), the same
called with ``out=`` (the result must be the caller's buffers, written), with
``normed_output=False`` (no normed output; the quantized output judged against the normed output
of the same op built with one), where the backend declares ``strided_rows``, ``hidden_states``
and ``residual`` that are ``[:, :H]`` views of wider buffers (nothing written outside the views),
and where it declares the ``in_place`` output layout (``Capabilities.output_layouts``), ops built
with ``output_layout="in_place"`` (the normed output over ``hidden_states``, the new residual over
``residual``). Bad inputs must raise ``InvalidInputError`` on every rank and leave the op
usable. A backend that declares ``batch_invariant`` is built with ``Config(batch_invariant=True)``
and each row of a pool, computed alone, must come back bit for bit inside batches of every size of
``invariance_sizes`` (residual, normed output, codes, per-row scales; ``test_batch_invariant``,
arnorm/testing/_invariance.py); a backend that does not declare it skips that test.

What fails and what skips:

- **fails**: the backend is not registered; its plugin or module fails to import; its probe
  raises or hangs; it breaks the protocol; ``create()`` fails (``setup_failed``); a call raises or
  returns wrong values; ranks end differently.
- **skips**, with the reasons: the backend is not installed or too old (``not_installed``,
  ``outdated``), a world size of ``world_sizes`` is not one the backend declares, or every case at
  a world size is ``incompatible`` on this machine (its declared capabilities or its probe rule it
  out, e.g. a CUDA backend on a CPU host). A single declared case that is incompatible here (nvfp4
  on a GPU older than the backend's floor) is left out silently while others run. (A world size of
  the tests' parameters, 1, 2 and 4, that is not in ``world_sizes`` is skipped, whatever ``require``.)
- ``require = True`` turns those skips into failures: set it where the backend must run (its
  own CI on its hardware, e.g. ``require = torch.cuda.is_available()``), so that a lost
  dependency or a probe that started rejecting cannot pass as skipped.

Rank runs are bounded by ``timeout`` seconds (:func:`arnorm.testing.run_ranks`); a rank that dies
fails the test within seconds with its traceback.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest

from arnorm._formats import FORMAT_SPECS
from arnorm._norm import NORM_OPTIONS
from arnorm.registry._capabilities import admitted_hidden
from arnorm.testing._cases import Case, CaseResult, bad_inputs_then_good, run_cases
from arnorm.testing._invariance import invariance_cases, run_invariance
from arnorm.testing._ranks import run_ranks

__all__ = ["ConformanceSuite"]

#: Registry statuses that mean "not usable on this machine" rather than "broken".
ABSENT = frozenset({"not_installed", "outdated"})
#: A declared (dtype, format, scale layout).
Combo = tuple[str, str | None, str | None]


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _waited_hint(per_rank: list[list[CaseResult]]) -> str:
    """When some ranks' call raised ``PeerError`` (they waited in a collective) in a case that other
    ranks ran to the end: what the first such rank said, and the likely cause."""
    for rows in zip(*per_rank, strict=True):
        waited = [r for r, row in enumerate(rows) if row.outcome == "error" and "PeerError" in row.error]
        ran = [r for r, row in enumerate(rows) if row.outcome not in ("error", "skipped")]
        if waited and ran:
            said = rows[waited[0]].error.strip().splitlines()[-1][:400]
            names = ", ".join(map(str, ran))
            return (
                f"\n{rows[0].case.id}: rank {waited[0]}: {said}\n(the backend skipped its collective "
                f"on rank(s) {names}, or made a different number of them there: every rank's call "
                "must make the same collectives, in the same order)"
            )
    return ""


class ConformanceSuite:
    """Base class: set ``backend``; override the class attributes to narrow or widen the sweep.

    Class attributes:

    - ``backend``: the registered name of the backend under test (required).
    - ``world_sizes``: the numbers of ranks to run, among 1, 2 and 4 (default ``(1, 2)``).
    - ``shapes``: the ``(tokens, hidden)`` problems of the sweep; a hidden size is raised to the
      backend's ``min_hidden`` and rounded up to its multiples (default ``((1, 256), (7, 512),
      (33, 256))``).
    - ``normed_ulps``: how many ulps a bf16 / fp16 normed output may be off (default 1);
      ``normed_ulps_fp32`` the same for fp32 (default 8).
    - ``quant_mismatch``: the fraction of quantized codes allowed off (default 0.0), each at most
      ``quant_max_code_diff`` steps (default 0); for fast-math kernels.
    - ``quant_scales_exact``: whether the scales the kernel computes must be bitwise those of
      ``arnorm.quant`` (default ``True``; ``False`` holds approximate dividers to their codes only).
    - ``require``: fail instead of skip (default ``False``; see the module docstring).
    - ``timeout``: seconds a multi-rank run may take before it fails (default 300).
    - ``invariance_sizes``: the batch sizes :meth:`test_batch_invariant` feeds a backend that
      declares ``batch_invariant`` (default ``(1, 7, 128, 129)``; the largest is the op's
      ``max_tokens`` and the pool of rows). Add the backend's own path boundaries (the last token
      count of each kernel or protocol and the first of the next).
    - ``invariance_hidden``: the hidden size of those cases (default 256).
    """

    backend: ClassVar[str] = ""
    world_sizes: ClassVar[tuple[int, ...]] = (1, 2)
    shapes: ClassVar[tuple[tuple[int, int], ...]] = ((1, 256), (7, 512), (33, 256))
    normed_ulps: ClassVar[int] = 1  # bf16 / fp16 outputs
    # fp32 outputs: the reference's own mean, rsqrt and two products each round in fp32, so any
    # kernel lands a few fp32 ulps from it (3-4 measured); the contract's 1 ulp is for bf16/fp16.
    normed_ulps_fp32: ClassVar[int] = 8
    quant_mismatch: ClassVar[float] = 0.0
    quant_max_code_diff: ClassVar[int] = 0  # set to 1 with quant_mismatch for fast-math kernels
    # Scales computed by the kernel (per-token fp8, block scales) bit for bit; fast-math kernels
    # that divide approximately set this False and are held to their codes only.
    quant_scales_exact: ClassVar[bool] = True
    #: Fail instead of skip when the backend is absent or ineligible here (see the module docstring).
    require: ClassVar[bool] = False
    #: Seconds a multi-rank run may take before it fails (passed to run_ranks).
    timeout: ClassVar[float] = 300.0

    invariance_sizes: ClassVar[tuple[int, ...]] = (1, 7, 128, 129)
    invariance_hidden: ClassVar[int] = 256

    _results: ClassVar[dict[tuple[type, int], list[CaseResult]]] = {}

    # -- the sweep ----------------------------------------------------------------------------

    @classmethod
    def _skip(cls, why: str) -> None:
        if cls.require:
            pytest.fail(f"{cls.backend}: {why} (require = True: it must run here)")
        pytest.skip(f"{cls.backend}: {why}")

    @classmethod
    def spec(cls) -> Any:
        """The backend's descriptor; fails for an unregistered or broken backend, skips an absent one."""
        import arnorm

        if not cls.backend:
            pytest.fail(f"{cls.__name__}.backend: '' (needs the name of the backend under test)")
        infos = {i.name: i for i in arnorm.backends()}
        info = infos.get(cls.backend)
        if info is None:
            pytest.fail(
                f"backend: {cls.backend!r} is not registered (needs one of {', '.join(sorted(infos))})"
            )
        if info.status in ABSENT:
            cls._skip(info.reason)
        if info.status != "available" or info.spec is None:
            pytest.fail(f"backend {cls.backend!r} is {info.status}: {info.reason}")
        return info.spec

    @classmethod
    def cases(cls) -> list[Case]:
        """Every declared (dtype, format) at each shape, in every declared layout for the first dtype
        and the format's first declared layout for the others; the norms rotate through the
        declared weight offsets, with ``add_residual=False`` where the backend declares it, and the
        declared norm options (``Capabilities.norm_options``, in the table's order): the ``k``-th on
        at shape ``i`` when ``i + k`` is odd, and all of them together at the last shape. Then a few
        cases of the op's other build options and call layouts (:meth:`_variant_cases`)."""
        caps = cls.spec().capabilities
        offsets = sorted(caps.weight_offsets) if caps.weight_offsets is not None else [0.0, 1.0]
        declared = [n for n in NORM_OPTIONS if n in caps.norm_options]
        last = len(cls.shapes) - 1
        out = []
        combos: list[Combo] = []
        dtypes = sorted(caps.dtypes)
        for dtype in dtypes:
            for quant in sorted(caps.quant):
                q = None if quant == "none" else quant
                if quant in caps.quant_dtypes and dtype not in caps.quant_dtypes[quant]:
                    continue
                block_layouts = FORMAT_SPECS[q].layouts if q else ()
                layouts = [x for x in block_layouts if x in caps.scale_layouts] if block_layouts else [None]
                # A layout is where the scales go, not how they are computed: every layout at the
                # first dtype, the format's first declared layout at the others.
                for layout in layouts if dtype == dtypes[0] else layouts[:1]:
                    combos.append((dtype, q, layout))
                    for i, (t, h) in enumerate(cls.shapes):
                        hidden = admitted_hidden(caps, quant, h)
                        if hidden is None:
                            continue
                        nores = caps.residual_free and i % 4 == 1
                        on = frozenset(n for k, n in enumerate(declared) if i == last or (i + k) % 2)
                        offset = float(offsets[i % len(offsets)])
                        out.append(Case(t, hidden, dtype, q, layout, offset, on, not nores))
        return out + cls._variant_cases(combos, float(offsets[0]))

    @classmethod
    def _variant_cases(cls, combos: list[Combo], offset: float) -> list[Case]:
        """One case each, at the shape of ``shapes`` with the most tokens, for the first declared
        dtype (and format ``none`` where declared): an op built with ``inplace=False``; the same
        called with ``out=`` (NaN-filled caller buffers that must come back written); one built
        with ``normed_output=False`` (for the first declared quant format); where the backend
        declares ``strided_rows``, ``hidden_states`` and ``residual`` that are ``[:, :H]`` views of
        wider buffers (two different row strides); and where it declares the ``in_place`` output
        layout, ops built with ``output_layout="in_place"`` (plain; quantized, with and without the
        normed output and with ``out=``; strided), whose result must be the inputs themselves."""
        caps = cls.spec().capabilities
        if not combos or not cls.shapes:
            return []
        tokens, h = max(cls.shapes, key=lambda s: s[0])
        plain = next((c for c in combos if c[1] is None), combos[0])
        quant = next((c for c in combos if c[1] is not None), None)
        wanted: list[tuple[Combo, dict[str, Any]]] = [
            (plain, {"inplace": False}),
            (plain, {"inplace": False, "out": True}),
        ]
        if quant is not None:
            wanted.append((quant, {"normed_output": False}))
        if caps.strided_rows:
            wanted.append((plain, {"strided": True, "tokens": max(tokens, 3)}))
        if "in_place" in caps.output_layouts:
            in_place = {"output_layout": "in_place"}
            wanted.append((plain, in_place))
            if quant is not None:
                wanted += [
                    (quant, in_place),
                    (quant, in_place | {"normed_output": False}),
                    (quant, in_place | {"out": True}),
                ]
            if caps.strided_rows:
                wanted.append((plain, in_place | {"strided": True, "tokens": max(tokens, 3)}))
        out = []
        for (dtype, q, layout), options in wanted:
            hidden = admitted_hidden(caps, q or "none", h)
            if hidden is not None:
                case = Case(tokens, hidden, dtype, q, layout, offset)
                out.append(dataclasses.replace(case, **options))
        return out

    @classmethod
    def _declared_world(cls, world: int) -> str:
        """Why ``world`` is outside what the backend declares (``""``: inside)."""
        caps = cls.spec().capabilities
        if caps.world_sizes is not None and world not in caps.world_sizes:
            return f"world size {world} is not declared (declares {sorted(caps.world_sizes)})"
        if world < caps.min_world_size:
            return f"world size {world} is not declared (declares >= {caps.min_world_size})"
        return ""

    @classmethod
    def _run(cls, world: int, fn: Any, *args: Any) -> list[Any]:
        if world == 1:
            return [fn(0, 1, *args)]
        return run_ranks(world, fn, *args, timeout=cls.timeout)

    @classmethod
    def results(cls, world: int) -> list[CaseResult]:
        """Every case on ``world`` ranks, run once per class and world size; rank 0's view.

        Fails when the ranks ended a case differently (one ran it, another skipped or failed).
        """
        key = (cls, world)
        if key not in cls._results:
            cases = cls.cases()
            per_rank = cls._run(world, run_cases, cls.backend, cases, _device())
            diverged = [
                f"{a.case.id}: rank 0 {a.outcome} {a.status}".rstrip()
                + f", rank {r} {b.outcome} {b.status}".rstrip()
                for r, rows in enumerate(per_rank[1:], start=1)
                for a, b in zip(per_rank[0], rows, strict=True)
                if (a.outcome, a.status) != (b.outcome, b.status)
            ]
            if diverged:
                pytest.fail("ranks ended cases differently:\n" + "\n".join(diverged) + _waited_hint(per_rank))
            cls._results[key] = per_rank[0]
        return cls._results[key]

    def _ran(self, world: int) -> list[CaseResult]:
        """The cases that ran at ``world``; skips (or, with ``require``, fails) when none could."""
        if world not in self.world_sizes:
            pytest.skip(f"world size {world} not in {type(self).__name__}.world_sizes {self.world_sizes}")
        undeclared = self._declared_world(world)
        if undeclared:
            self._skip(undeclared)
        rows = self.results(world)
        if not rows:
            pytest.fail(
                f"{self.backend}: declares no case the suite can build (dtypes, formats or hidden sizes)"
            )
        ran = [r for r in rows if r.outcome != "skipped"]
        if not ran:
            reasons = sorted({reason for r in rows for reason in r.reasons})
            self._skip(f"incompatible with every case on {world} rank(s) here: " + "; ".join(reasons))
        return ran

    # -- the tests ----------------------------------------------------------------------------

    def test_declares_and_loads(self) -> None:
        """The descriptor declares at least one dtype, format and platform, and the class imports."""
        spec = self.spec()
        caps = spec.capabilities
        missing = [f for f in ("dtypes", "quant", "platforms") if not getattr(caps, f)]
        if missing:
            pytest.fail(
                f"{self.backend}: capabilities declare no {', '.join(missing)} (needs at least one each)"
            )
        from arnorm.registry._imports import discovery_timeout, import_bounded, timed_out

        timeout = discovery_timeout()  # a module whose import never returns fails, not hangs, the run
        if import_bounded(spec.loader.partition(":")[0], timeout)[0] == "timeout":
            pytest.fail(f"{self.backend}: loading {spec.loader}: {timed_out(timeout)}")
        try:
            spec.load()
        except Exception as exc:
            pytest.fail(f"{self.backend}: loading {spec.loader} raised {type(exc).__name__}: {exc}")

    @pytest.mark.parametrize("world", [1, 2, 4])
    def test_matches_reference(self, world: int) -> None:
        """Residual bitwise, normed within tolerance, quant bitwise (or within the declared slack);
        every declared case that is not merely incompatible here must build and run."""
        failures = []
        for r in self._ran(world):
            if r.outcome == "error":
                failures.append(f"{r.case.id}: {r.error}")
                continue
            failures.extend(f"{r.case.id}: {f}" for f in self._judge(r))
        if failures:
            pytest.fail(
                f"{self.backend} on {world} rank(s), {len(failures)} failure(s):\n" + "\n".join(failures)
            )

    def _judge(self, r: CaseResult) -> list[str]:
        out = []
        if r.residual is not None:
            hint = (
                "read row i of hidden_states and residual at i * stride(0), not i * H"
                if r.case.strided
                else "round the reduced sum to the dtype before the residual add, docs/numerics.md"
            )
            out.append(r.residual.describe("residual", "0: bitwise") + f" (hint: {hint})")
        allowed = self.normed_ulps_fp32 if r.case.dtype == "float32" else self.normed_ulps
        if r.normed is not None and r.normed.max_ulps > allowed:
            out.append(r.normed.describe("normed", f"{allowed} ulp"))
        if self.quant_scales_exact and r.scales:
            out.append(f"quant scales differ from arnorm.quant's: {r.scales}")
        if r.codes is not None and (
            r.codes.fraction > self.quant_mismatch or r.codes.max_steps > self.quant_max_code_diff
        ):
            allowed_codes = (
                f"{100 * self.quant_mismatch:.4f}% of codes, at most {self.quant_max_code_diff} step(s) off"
            )
            out.append(r.codes.describe("quant codes") + f"; allowed: {allowed_codes}")
        return out

    def test_bad_inputs_raise_everywhere_and_leave_op_usable(self) -> None:
        """Bad calls raise InvalidInputError on every rank before any collective; a good call still works."""
        declared = [w for w in self.world_sizes if not self._declared_world(w)] or [min(self.world_sizes)]
        world = max(declared)
        ran = [
            r
            for r in self._ran(min(declared))
            if r.outcome == "ran" and r.case.normed_output and not r.case.strided
        ]
        if not ran:
            pytest.fail(
                f"{self.backend}: no case ran cleanly, so bad inputs cannot be tested "
                "(see test_matches_reference)"
            )
        case = ran[0].case
        per_rank = self._run(world, bad_inputs_then_good, self.backend, case, _device())
        failures: list[str] = []
        for rank, (outcomes, good) in enumerate(per_rank):
            failures.extend(f"rank {rank}: {o}" for o in outcomes if o)
            if good.outcome != "ran":
                failures.append(f"rank {rank}: the good call after the bad ones: {good.error or good.status}")
            else:
                failures.extend(
                    f"rank {rank}: the good call after the bad ones: {f}" for f in self._judge(good)
                )
        if failures:
            pytest.fail(f"{self.backend} on {world} rank(s), {case.id}:\n" + "\n".join(failures))

    @pytest.mark.parametrize("world", [1, 2, 4])
    def test_batch_invariant(self, world: int) -> None:
        """Where the backend declares ``batch_invariant``: built with ``Config(batch_invariant=True)``,
        every row alone and inside batches of ``invariance_sizes`` gives bitwise the same residual,
        normed output, codes and per-row scales (arnorm/testing/_invariance.py). Skips a backend
        that does not declare it."""
        if world not in self.world_sizes:
            pytest.skip(f"world size {world} not in {type(self).__name__}.world_sizes {self.world_sizes}")
        caps = self.spec().capabilities
        if not caps.batch_invariant:
            pytest.skip(f"{self.backend}: does not declare batch_invariant (nothing to check)")
        undeclared = self._declared_world(world)
        if undeclared:
            self._skip(undeclared)
        cases = invariance_cases(caps, self.invariance_hidden)
        sizes = tuple(sorted(set(self.invariance_sizes)))
        per_rank = self._run(world, run_invariance, self.backend, cases, sizes, _device())
        rows = per_rank[0]
        ran = [r for r in rows if r.outcome != "skipped"]
        if not ran:
            reasons = sorted({reason for r in rows for reason in r.reasons})
            self._skip(f"incompatible with every case on {world} rank(s) here: " + "; ".join(reasons))
        failures = []
        for rank, results in enumerate(per_rank):
            for r in results:
                if r.outcome == "error":
                    failures.append(f"rank {rank}: {r.case.id}: {r.error}")
                failures.extend(f"rank {rank}: {r.case.id}: {f}" for f in r.failures)
        if failures:
            pytest.fail(
                f"{self.backend} on {world} rank(s) is not batch invariant, {len(failures)} failure(s):\n"
                + "\n".join(failures)
            )
