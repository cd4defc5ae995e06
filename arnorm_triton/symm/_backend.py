"""``TritonSymmBackend``: the all-reduce fused into one Triton kernel over torch symmetric memory.

Per call, one kernel on each rank. Decode sizes (up to ``ARNORM_TRITON_SYMM_PUSH_MAX_TOKENS``)
push: each rank stores its partial into every peer's buffer, where the data itself says it has
arrived (no flags). Larger calls copy the partial into this rank's own buffer (or find it there:
:meth:`TritonSymmBackend.input_buffer`) and the ranks' programs meet through flags; one-shot
(every rank reads every partial) up to ``ARNORM_TRITON_SYMM_ONESHOT_MAX_TOKENS``, two-shot (each
rank reduces a share of the rows, then reads the others' sums) above. Either way each row's
partials are summed in fp32 from rank 0 up (one rounding: bitwise the reference's step 1,
identical on every rank), then ``triton``'s epilogue adds the residual, normalizes and
quantizes. docs/triton-symm.md has the protocols and why they are graph-safe.

A call allocates only its outputs, never synchronizes with the host and launches the same grid on
every rank; the calls of one op must be issued on one stream (or streams ordered with one
another) on every rank, in the same order, as for any collective.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, ClassVar

from arnorm.plugin import ArnormError, BackendSetupError, Output, RMSNorm
from arnorm_triton.symm._plugin import (
    DEFAULT_MAX_BYTES,
    DEFAULT_SPIN_LIMIT,
    MAX_WORLD_SIZE,
    auto_oneshot_tokens,
)
from arnorm_triton.symm._setup import agree_topology, collective_step, symmetric_memory_reasons

if TYPE_CHECKING:
    import torch

    from arnorm.plugin import BackendSettings, Comm, Problem
    from arnorm_triton.symm._workspace import SymmWorkspace

__all__ = ["TritonSymmBackend"]


def _soft_fp8(problem: Problem) -> bool:
    # As ``triton``: e4m3 in integer arithmetic where the hardware conversion is missing or differs.
    return problem.platform != "cuda" or (problem.arch or (0, 0)) < (8, 9)


class TritonSymmBackend:
    """The ``triton_symm`` backend: 2 to 8 ranks of one node, CUDA or ROCm, every format.

    Outputs per call: the new residual (``hidden_states`` itself when ``problem.inplace``, except
    for zero-copy input, whose buffer the peers read: then a new tensor), the normed activation
    when ``problem.normed_output``, and the quantized activation as :func:`arnorm.quant.quantize`
    lays it out.
    """

    name: ClassVar[str] = "triton_symm"

    def __init__(
        self, problem: Problem, comm: Comm, workspace: SymmWorkspace, settings: dict[str, int]
    ) -> None:
        import torch

        from arnorm_triton._direct import pdl_available
        from arnorm_triton._kernels import INTERPRETED
        from arnorm_triton._outputs import OutputPlan
        from arnorm_triton.symm._launch import SymmLauncher

        self._problem = problem
        self._comm = comm
        self._ws: SymmWorkspace | None = workspace
        self._hidden = problem.hidden_size
        self._inplace = problem.inplace
        self._oneshot_max = settings["oneshot_max_tokens"]
        self._max_bytes = settings["max_bytes"]
        self._capacity = workspace.layout.capacity
        #: Calls with at most this many tokens push (0: none do).
        self._push_cap = workspace.layout.push_cap
        self._in_ptr = workspace.input_ptr()
        #: Once an input buffer is lent, every call waits at its end until the peers are done
        #: reading this rank's rows (the caller writes the next partial there before the next call).
        self._lent = False
        # The kernel writes the layout the plan resolved (None in a Problem: the format's default).
        self._plan = OutputPlan(
            hidden=problem.hidden_size,
            dtype=getattr(torch, problem.dtype),
            quant=problem.quant,
            layout=problem.scale_layout,
            normed=problem.normed_output,
            device=comm.device,
        )
        self._launcher = SymmLauncher(
            workspace,
            quant=problem.quant,
            layout=self._plan.layout,
            write_normed=problem.normed_output,
            norm=RMSNorm.with_options(problem.eps, problem.weight_offset, problem.norm_options),
            # Integer-bit casts only in the interpreter (the CPU protocol tests drive this class).
            soft=INTERPRETED,
            soft_fp8=_soft_fp8(problem) or INTERPRETED,
            sync=True,
            spin_limit=settings["spin_limit"],
            pdl=bool(settings.get("pdl", 1)) and pdl_available(problem),
        )

    # -- selection --------------------------------------------------------------------------

    @classmethod
    def probe(cls, problem: Problem) -> tuple[str, ...]:
        """What the capabilities cannot say: Triton usable (as for ``triton``), and symmetric memory
        in this torch. Peer access and the node are checked in :meth:`create`, which knows the peers."""
        from arnorm_triton._backend import TritonBackend

        reasons = list(TritonBackend.probe(problem))
        if importlib.util.find_spec("torch") is not None:
            reasons += symmetric_memory_reasons()
        return tuple(reasons)

    @classmethod
    def create(cls, problem: Problem, comm: Comm, settings: BackendSettings) -> TritonSymmBackend:
        """Check the peers, allocate and rendezvous the workspace on the TP group, warm up.

        Collective over ``comm`` (every rank calls it; agreement over the CPU group first, so a
        rank that cannot build the workspace makes every rank raise the same error instead of
        leaving its peers in a rendezvous or a kernel).
        """
        import torch

        from arnorm_triton.symm._workspace import (
            allocate_buffer,
            build,
            local_offset,
            plan_layout,
            rendezvous,
        )

        itemsize = getattr(torch, problem.dtype).itemsize
        # Unset crossovers depend on the world size and the row (the same on every rank).
        auto = auto_oneshot_tokens(comm.world_size, problem.hidden_size * itemsize)
        oneshot = getattr(settings, "oneshot_max_tokens", None)
        push = getattr(settings, "push_max_tokens", None)
        values = {
            "max_bytes": int(getattr(settings, "max_bytes", DEFAULT_MAX_BYTES)),
            "oneshot_max_tokens": auto if oneshot is None else int(oneshot),
            "spin_limit": int(getattr(settings, "spin_limit", DEFAULT_SPIN_LIMIT)),
            "push_max_tokens": auto if push is None else int(push),
            "pdl": int(bool(getattr(settings, "pdl", True))),
        }
        if comm.group is None or comm.world_size < 2:
            raise BackendSetupError(f"world size: {comm.world_size} (needs 2 to {MAX_WORLD_SIZE} ranks)")
        slots = agree_topology(comm)
        layout = plan_layout(
            world=comm.world_size,
            slots=slots,
            hidden=problem.hidden_size,
            itemsize=itemsize,
            max_tokens=problem.max_tokens,
            max_bytes=values["max_bytes"],
            oneshot_max=values["oneshot_max_tokens"],
            push_max=values["push_max_tokens"],
        )
        if layout.capacity < 1:
            from arnorm_triton.symm._workspace import min_bytes

            need = min_bytes(
                world=comm.world_size, slots=slots, hidden=problem.hidden_size, itemsize=itemsize
            )
            raise BackendSetupError(
                f"workspace: ARNORM_TRITON_SYMM_MAX_BYTES={values['max_bytes']} holds no token of hidden "
                f"size {problem.hidden_size} in {problem.dtype} (needs >= {need})"
            )
        dtype = getattr(torch, problem.dtype)
        held: dict[str, Any] = {}
        # Allocation is local: agree on it before the rendezvous, which would wait for a rank that
        # failed to allocate until the store's timeout.
        collective_step(
            comm, "symmetric memory", lambda: held.update(buffer=allocate_buffer(layout, comm.device))
        )

        def join() -> None:
            held["handle"] = rendezvous(held["buffer"], comm.group)
            held["offset"] = local_offset(held["buffer"], held["handle"], comm.rank)

        collective_step(comm, "symmetric memory rendezvous", join)
        offsets = [int(o) for o in comm.gather_objects(held["offset"])]
        collective_step(
            comm,
            "symmetric memory rendezvous",
            lambda: held.update(ws=build(layout, comm.rank, held["buffer"], held["handle"], offsets, dtype)),
        )
        ws = held["ws"]
        # Every rank's flags are zero and its push slots the sentinel before any rank's first kernel
        # can write into them.
        torch.cuda.synchronize(comm.device)
        comm.gather_objects("flags zeroed")
        self = cls(problem, comm, ws, values)
        try:
            self._warm_up()
        except BaseException:
            self.close()
            raise
        return self

    def _warm_up(self) -> None:
        """Compile the kernels, then run every variant a call can take once on every rank (the JIT
        cost and module loads stay out of the step and out of graph captures)."""
        import torch

        comm, t, h = self._comm, min(3, self._capacity), self._hidden
        g = torch.Generator(device=comm.device).manual_seed(comm.rank)
        dtype = self._plan.dtype
        x = torch.randn((t, h), generator=g, device=comm.device).to(dtype)
        res = torch.randn((t, h), generator=g, device=comm.device).to(dtype)
        w = torch.ones((h,), dtype=dtype, device=comm.device)
        scale = torch.tensor([0.5], dtype=torch.float32, device=comm.device)
        variants = self._variants()

        def compile_all() -> None:  # one kernel serves every variant (runtime flags)
            push, two, copy_in, end_wait = variants[0]
            self._launch(x.clone(), res, w, scale, push, two, copy_in, end_wait, warmup=True)
            self._launcher.wait_done(warmup=True)

        # Compiled on every rank before any rank runs a kernel that waits for its peers: a rank
        # whose compile fails makes every rank raise instead of leaving its peers spinning.
        collective_step(comm, "kernel compile", compile_all)

        def run_all() -> None:
            first = variants[0]
            n = min(t, self._push_cap) if first[0] else t
            self.bind_direct(x[:n], res[:n], w, scale, push=first[0], two_shot=first[1])
            for push, two, copy_in, end_wait in variants:  # copy-in without end-wait first: see _variants
                n = min(t, self._push_cap) if push else t
                src = x[:n].clone() if copy_in else self._workspace().inputs(n).copy_(x[:n])
                self._launch(src, res[:n], w, scale, push, two, copy_in, end_wait)
            self._launcher.wait_done()
            torch.cuda.synchronize(comm.device)
            if self._timeouts():
                raise RuntimeError(
                    "a kernel waited past ARNORM_TRITON_SYMM_SPIN_LIMIT for a peer (needs every rank to "
                    "reach the op's first call)"
                )

        collective_step(comm, "warm-up", run_all)

    def bind_direct(
        self, x: Any, residual: Any, weight: Any, scale: Any, *, two_shot: bool, push: bool = False
    ) -> bool:
        """Bind the direct launch (:meth:`SymmLauncher.bind`): collective, every rank with the same
        token count and kind, on the stream the op runs on; a partial ``x`` copied in, never written."""
        t = x.shape[0]
        h_out = x.new_empty((t, self._hidden))
        y, q, sf = self._plan.alloc(t)
        kscale = scale if self._plan.takes_scale else None
        tensors = (x, residual, weight, kscale, h_out, y, q, sf)
        return self._launcher.bind(tensors, t, (self._hidden,) * 3, two_shot=two_shot, push=push)

    def _variants(self) -> list[tuple[bool, bool, bool, bool]]:
        """``(push, two_shot, copy_in, end_wait)`` a call can take, in an order that is safe to run
        back to back: a zero-copy flag call only after a flag call that waited at its end."""
        kinds = [False] if self._capacity <= self._oneshot_max else [True]
        if self._oneshot_max > 0 and self._capacity > self._oneshot_max:
            kinds = [False, True]
        out = [(True, False, True, False)] if self._push_cap > 0 else []
        for two in kinds:
            out += [(False, two, True, False), (False, two, True, True), (False, two, False, True)]
        return out

    def check_tokens(self, num_tokens: int) -> tuple[str, ...]:
        if num_tokens > self._capacity:
            return (
                f"tokens: {num_tokens} (needs <= {self._capacity}, what ARNORM_TRITON_SYMM_MAX_BYTES="
                f"{self._max_bytes} holds)",
            )
        return ()

    # -- the call ---------------------------------------------------------------------------

    def _workspace(self) -> SymmWorkspace:
        if self._ws is None:
            raise ArnormError("triton_symm: closed (needs a new arnorm.AllReduceNorm)")
        return self._ws

    def input_buffer(self, num_tokens: int) -> torch.Tensor | None:
        """``[T, H]`` view of this rank's inputs region: a partial written there is not copied.

        The first call enqueues a wait (on the current stream) until every peer is done reading
        the region, and from then on every call waits at its end so the caller may overwrite it.
        """
        if num_tokens > self._capacity:
            return None
        ws = self._workspace()
        if not self._lent:
            self._launcher.wait_done()
            self._lent = True
        return ws.inputs(num_tokens)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> Output:
        t = hidden_states.shape[0]
        zero_copy = hidden_states.data_ptr() == self._in_ptr and (
            t == 1 or hidden_states.stride(0) == self._hidden
        )
        push, two_shot = t <= self._push_cap, t > self._oneshot_max
        return self._launch(hidden_states, residual, weight, scale, push, two_shot, not zero_copy, self._lent)

    def _launch(self, x: Any, residual: Any, weight: Any, scale: Any, push: bool, two_shot: bool,
                copy_in: bool, end_wait: bool, warmup: bool = False) -> Output:  # fmt: skip
        self._workspace()
        t, hidden = x.shape[0], self._hidden
        xs = x.stride(0) if t > 1 else hidden
        rs = residual.stride(0) if t > 1 else hidden
        if copy_in and self._inplace:
            h_out, hs = x, xs
        else:
            # Zero-copy input is the peers' to read until the call ends: the residual goes elsewhere.
            h_out, hs = x.new_empty((t, hidden)), hidden
        y, q, sf = self._plan.alloc(t)
        # Only fp8_static and nvfp4 read the caller's scale; any other value would compile another
        # kernel variant (a different pointer type) in the middle of a step.
        kscale = scale if self._plan.takes_scale else None
        self._launcher.launch(x, residual, weight, kscale, h_out, y, q, sf, t, xs, rs, hs, push=push,
                              two_shot=two_shot, copy_in=copy_in, end_wait=end_wait,
                              warmup=warmup)  # fmt: skip
        return self._plan.output(y, h_out, q, sf, scale)

    # -- health and lifetime ----------------------------------------------------------------

    def _timeouts(self) -> int:
        ws = self._workspace()
        return int(ws.error.item())

    def check(self) -> None:
        """Raise if a wait of any earlier call gave up on a peer (synchronizes with the device).

        Such a call went on with whatever the peer's buffer held: its outputs, and those of every
        call since, are wrong. The usual cause is a rank that stopped calling the op."""
        bits = self._timeouts()
        if bits:
            names = ("publish", "two-shot sums", "done reading", "push")
            kinds = [k for i, k in enumerate(names) if bits >> i & 1]
            raise ArnormError(
                f"triton_symm: a wait for a peer ({', '.join(kinds)}) gave up after "
                "ARNORM_TRITON_SYMM_SPIN_LIMIT polls (needs every rank to call the op the same number of "
                "times, in the same order)"
            )

    def close(self) -> None:
        """Drop this rank's workspace (local and idempotent; torch unmaps it once unreferenced)."""
        if self._ws is not None:
            self._ws.release()
            self._ws = None

    # -- introspection used by tests and the benchmark ----------------------------------------

    @property
    def capacity(self) -> int:
        """Most tokens a call may have (the workspace budget)."""
        return self._capacity

    @property
    def oneshot_max_tokens(self) -> int:
        return self._oneshot_max

    @property
    def push_max_tokens(self) -> int:
        """Most tokens a push call may have (0: every call takes the flag protocol)."""
        return self._push_cap

    @property
    def launcher(self) -> Any:
        return self._launcher

    @property
    def workspace(self) -> SymmWorkspace | None:
        return self._ws
