"""Small in-test backends and a registry holding them, for selection tests without real plugins."""

from __future__ import annotations

from typing import ClassVar

from arnorm._reference import ReferenceBackend
from arnorm.plugin import BackendSettings, BackendSpec, Capabilities, Output, add_rmsnorm, quantize_output
from arnorm.registry._discovery import Registry, reset_registry

CPU_ANY = Capabilities(platforms=frozenset({"cpu", "cuda"}))
ALL_QUANT = frozenset({"none", "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"})
#: What FastPathBackend declares by default: caller outputs (so its fast path is used), strided rows.
WRITES_OUT = Capabilities(
    platforms=frozenset({"cpu"}), quant=ALL_QUANT, caller_outputs=True, strided_rows=True
)


class AllReduceBackend:
    """all_reduce in fp32, then the reference math; serves at most ``limit`` tokens."""

    name: ClassVar[str] = "fast"
    limit: ClassVar[int | None] = None
    fail_setup_on_rank: ClassVar[int | None] = None
    probe_reasons: ClassVar[tuple[str, ...]] = ()
    closed: ClassVar[list[str]] = []
    groups_at_close: ClassVar[list[bool]] = []

    def __init__(self, problem, comm):
        self.problem, self.comm = problem, comm

    @classmethod
    def probe(cls, problem):
        return cls.probe_reasons

    @classmethod
    def create(cls, problem, comm, settings):
        if cls.fail_setup_on_rank == comm.rank:
            raise RuntimeError("workspace allocation failed")
        return cls(problem, comm)

    def check_tokens(self, num_tokens):
        if self.limit is not None and num_tokens > self.limit:
            return (f"tokens: {num_tokens} (needs <= {self.limit}, the workspace budget)",)
        return ()

    def __call__(self, hidden_states, residual, weight, scale):
        p = self.problem
        s = self.comm.all_reduce_(hidden_states.float()).to(hidden_states.dtype)
        h, y = add_rmsnorm(s, residual, weight, p.eps, p.weight_offset)
        q = quantize_output(y, p.quant, scale, p.scale_layout)
        if p.inplace:
            h = hidden_states.copy_(h)
        return Output(y if p.normed_output else None, h, q)

    def close(self):
        type(self).closed.append(self.name)
        # What a plugin's close() may read: its Comm, groups included (the op lets go after it).
        type(self).groups_at_close.append(self.comm.group is not None)


class FastSettings(BackendSettings):
    """A backend setting that changes the collective, so ranks must agree on it."""

    exact: bool = False


class SmallBackend(AllReduceBackend):
    name: ClassVar[str] = "small"
    limit: ClassVar[int | None] = 4


class FailingSetupBackend(AllReduceBackend):
    name: ClassVar[str] = "flaky"
    fail_setup_on_rank: ClassVar[int | None] = 1


class ProbeRejectsBackend(AllReduceBackend):
    name: ClassVar[str] = "picky"
    probe_reasons: ClassVar[tuple[str, ...]] = ("topology: no NVLink (needs P2P access between the GPUs)",)


class FastPathBackend(AllReduceBackend):
    """Writes caller outputs, and offers a fast path that records its arguments; ``decline`` makes
    it return ``None`` (the core then calls ``__call__``), ``fast_path_error`` makes asking raise."""

    name: ClassVar[str] = "fastpath"
    decline: ClassVar[bool] = False
    fast_path_error: ClassVar[Exception | None] = None
    fast_calls: ClassVar[list[tuple]] = []
    slow_calls: ClassVar[list[int]] = []

    def __call__(self, hidden_states, residual, weight, scale, out=None):
        type(self).slow_calls.append(hidden_states.shape[0])
        got = super().__call__(hidden_states, residual, weight, scale)
        if out is None:
            return got
        from arnorm.op._results import copy_into

        return copy_into(got, out, self.problem.inplace)

    def fast_path(self):
        if self.fast_path_error is not None:
            raise self.fast_path_error

        def fast(t, x, res, w, scale, out, xp, rp, wp, sp):
            type(self).fast_calls.append((t, x, res, w, scale, out, xp, rp, wp, sp))
            if self.decline:
                return None
            got = AllReduceBackend.__call__(self, x, res, w, scale)
            if out is None:
                return got
            from arnorm.op._results import copy_into

            return copy_into(got, out, self.problem.inplace)

        return fast


def spec(name: str, priority: int, cls: str, caps: Capabilities = CPU_ANY, **kw) -> BackendSpec:
    """A descriptor for backend ``name`` implemented by class ``cls`` (renamed to ``name`` when they differ).

    The core checks that a loaded class's ``name`` is the registered one, so a second name for
    the same behaviour gets its own subclass, made importable under ``fake_backends``.
    """
    base = globals()[cls]
    if base.name != name:
        alias = f"{cls}_as_{name}"
        if alias not in globals():
            globals()[alias] = type(alias, (base,), {"name": name, "__module__": __name__})
        cls = alias
    return BackendSpec(name=name, priority=priority, capabilities=caps, loader=f"fake_backends:{cls}", **kw)


REFERENCE = BackendSpec(
    name="reference",
    priority=0,
    capabilities=Capabilities(
        platforms=frozenset({"cpu", "cuda", "rocm"}),
        quant=frozenset({"none", "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"}),
    ),
    loader="arnorm._reference:ReferenceBackend",
)
assert ReferenceBackend.name == REFERENCE.name


def install(*specs: BackendSpec) -> Registry:
    """Make ``specs`` (plus the reference) the process registry; returns it."""
    reg = Registry()
    reg.add(REFERENCE, plugin="arnorm")
    for s in specs:
        reg.add(s, plugin="tests")
    reset_registry(reg)
    return reg


def install_default() -> Registry:
    """reference + fast (50) + small (60): what the multi-rank tests use."""
    return install(spec("fast", 50, "AllReduceBackend"), spec("small", 60, "SmallBackend"))
