"""Module-level functions that spawned ranks run (they must be importable by name)."""

from __future__ import annotations

from typing import Any

import torch

import arnorm
from arnorm._reference import add_rmsnorm, rank_order_sum


def attempt(fn):
    """``("ok", value)`` or ``("error", type name, message)``: a call's outcome, in a form that
    pickles back from a spawned rank and compares across ranks."""
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


def make_inputs(rank: int, world: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """This rank's partial, plus the residual and weight every rank shares."""
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(world)]
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.1).to(dtype)
    return partials, residual, weight


def reference_matches(
    rank: int, world: int, tokens: int, hidden: int, quant: str | None, backend: str | None
):
    """Run the op once; return (chosen backend, residual bitwise ok, normed bitwise ok)."""
    dtype = torch.bfloat16
    partials, residual, weight = make_inputs(rank, world, tokens, hidden, dtype)
    scale = torch.tensor([0.05]) if quant in ("fp8_static", "nvfp4") else None
    with arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=hidden,
        dtype=dtype,
        norm=arnorm.RMSNorm(1e-6, 1.0),
        quant=quant,
        backend=backend,
        max_tokens=64,
    ) as op:
        x = partials[rank].clone()
        out = op(x, residual, weight, scale)
        h, y = add_rmsnorm(rank_order_sum(partials), residual, weight, 1e-6, 1.0)
        return op.backend, torch.equal(out.residual, h), torch.equal(out.normed, y), out.residual is x


def choice_under_env(rank: int, world: int):
    """Build an op in auto mode and report the chosen backend and the explanation text."""
    import fake_backends

    fake_backends.install_default()
    op = arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=32,
        dtype=torch.float32,
        max_tokens=8,
        norm=arnorm.RMSNorm(1e-6),
    )
    try:
        return op.backend, str(op.explain())
    finally:
        op.close()


def fallback_after_setup_failure(rank: int, world: int):
    """Auto mode with a backend whose setup fails on rank 1: the backend used and flaky's verdict."""
    import fake_backends

    fake_backends.install(fake_backends.spec("flaky", 70, "FailingSetupBackend"))
    with arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=32,
        dtype=torch.float32,
        norm=arnorm.RMSNorm(1e-6),
        max_tokens=8,
    ) as op:
        verdict = op.explain().verdict("flaky")
        return op.backend, verdict.status, verdict.reasons


def error_under_env(rank: int, world: int, backend: str | None):
    """Build an op that must fail; return the exception type name and message."""
    import fake_backends

    fake_backends.install(fake_backends.spec("flaky", 70, "FailingSetupBackend"))
    try:
        arnorm.AllReduceNorm(
            torch.distributed.group.WORLD,
            hidden_size=32,
            dtype=torch.float32,
            max_tokens=8,
            backend=backend,
            norm=arnorm.RMSNorm(1e-6),
        )
    except arnorm.ArnormError as exc:
        return type(exc).__name__, str(exc)
    return None, ""


def mismatched_hidden(rank: int, world: int):
    """Ranks pass different hidden sizes: every rank must raise the same error."""
    try:
        arnorm.AllReduceNorm(
            torch.distributed.group.WORLD,
            hidden_size=32 + 32 * rank,
            dtype=torch.float32,
            max_tokens=8,
            norm=arnorm.RMSNorm(1e-6),
        )
    except arnorm.InvalidInputError as exc:
        return str(exc)
    return "no error"


def bad_call_then_good(rank: int, world: int):
    """A rejected call leaves the op usable: the next valid call runs the collective fine."""
    partials, residual, weight = make_inputs(rank, world, 4, 32, torch.float32)
    op = arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=32,
        dtype=torch.float32,
        max_tokens=8,
        norm=arnorm.RMSNorm(1e-6),
    )
    messages = []
    for bad in (partials[rank][:, :16], partials[rank].double(), partials[rank].t()):
        try:
            op(bad, residual, weight)
        except arnorm.InvalidInputError as exc:
            messages.append(str(exc))
    out = op(partials[rank].clone(), residual, weight)
    h, _ = add_rmsnorm(rank_order_sum(partials), residual, weight, 1e-6, 0.0)
    op.close()
    return messages, torch.equal(out.residual, h)


def reference_matches_on_cuda(rank: int, world: int, tokens: int, hidden: int):
    """Two ranks share one GPU over gloo: reference residual and normed equal the contract."""
    partials, residual, weight = make_inputs(rank, world, tokens, hidden, torch.bfloat16)
    dev = torch.device("cuda", 0)
    with arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=hidden,
        dtype=torch.bfloat16,
        max_tokens=16,
        backend="reference",
        device=dev,
        norm=arnorm.RMSNorm(1e-6),
    ) as op:
        out = op(partials[rank].to(dev), residual.to(dev), weight.to(dev))
        h, y = add_rmsnorm(rank_order_sum(partials), residual, weight, 1e-6, 0.0)
        return torch.equal(out.residual.cpu(), h), torch.equal(out.normed.cpu(), y)


def mismatched_exact_mode(rank: int, world: int):
    """Ranks differ in a backend setting (a different collective): every rank raises the same error."""
    import fake_backends

    fake_backends.install(
        fake_backends.spec("fast", 50, "AllReduceBackend", settings=fake_backends.FastSettings)
    )
    try:
        arnorm.AllReduceNorm(
            torch.distributed.group.WORLD,
            hidden_size=32,
            dtype=torch.float32,
            max_tokens=8,
            config=arnorm.Config(settings={"fast": {"exact": bool(rank)}}),
            norm=arnorm.RMSNorm(1e-6),
        )
    except arnorm.InvalidInputError as exc:
        return str(exc)
    return "no error"


def check_calls_catches_divergence(rank: int, world: int):
    """ARNORM_CHECK_CALLS=1: different token counts, then a call rejected on rank 1 only."""
    import os

    os.environ["ARNORM_CHECK_CALLS"] = "1"
    op = arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=32,
        dtype=torch.float32,
        norm=arnorm.RMSNorm(1e-6),
        max_tokens=8,
    )
    messages = []
    t = 3 + rank  # rank 0 passes 3 tokens, rank 1 passes 4
    partials, residual, weight = make_inputs(rank, world, t, 32, torch.float32)
    for args in (
        (partials[rank], residual, weight),
        # rank 1 alone passes a bad dtype: without the check it would skip the collective
        (partials[rank].double() if rank == 1 else partials[rank], residual, weight),
    ):
        try:
            op(*args)
            messages.append("ok")
        except arnorm.InvalidInputError as exc:
            messages.append(str(exc))
    # Both rejections happened on every rank: the next good call is still paired correctly.
    partials, residual, weight = make_inputs(rank, world, 4, 32, torch.float32)
    out = op(partials[rank].clone(), residual, weight)
    h, _ = add_rmsnorm(rank_order_sum(partials), residual, weight, 1e-6, 0.0)
    op.close()
    return messages, torch.equal(out.residual, h)


def rank_dependent_token_budget(rank: int, world: int):
    """A backend serving 2 tokens on rank 0 and 6 on rank 1, and one whose check_tokens raises on rank 1."""
    import fake_backends

    class Uneven(fake_backends.AllReduceBackend):
        name = "uneven"

        def check_tokens(self, num_tokens):
            limit = 2 if self.comm.rank == 0 else 6
            return () if num_tokens <= limit else (f"tokens: {num_tokens} (needs <= {limit})",)

    class Raising(fake_backends.AllReduceBackend):
        name = "raising"

        def check_tokens(self, num_tokens):
            if self.comm.rank == 1:
                raise RuntimeError("budget lookup failed")
            return ()

    fake_backends.Uneven, fake_backends.Raising = Uneven, Raising
    fake_backends.install(
        fake_backends.spec("uneven", 60, "Uneven"), fake_backends.spec("raising", 70, "Raising")
    )
    with arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=32,
        dtype=torch.float32,
        norm=arnorm.RMSNorm(1e-6),
        max_tokens=8,
    ) as op:
        served = [op.backend_for(t) for t in range(1, 9)]
        raising = op.explain().verdict("raising")
        return served, raising.status, raising.reasons


def group_safety(rank: int, world: int):
    """4 ranks in two TP groups of 2: the errors a device group without its CPU twin gets, and the fix."""
    import torch.distributed as dist

    import arnorm.comm._comm as comm_module

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    twins = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine, other = pairs[rank // 2], pairs[1 - rank // 2]
    twin, wrong_twin = twins[rank // 2], twins[1 - rank // 2]
    kw = dict(hidden_size=32, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4)
    out = {}
    # Pretend the TP groups are device (NCCL) groups: only the twins "support CPU".
    real = comm_module._supports_cpu
    comm_module._supports_cpu = lambda g: g not in pairs and real(g)
    try:
        for label, group, cpu_group in (
            ("no twin", mine, None),
            ("not a member", other, None),
            ("wrong twin", mine, wrong_twin),
        ):
            try:
                arnorm.AllReduceNorm(group, cpu_group=cpu_group, **kw).close()
                out[label] = "built"
            except arnorm.InvalidInputError as exc:
                out[label] = str(exc)
        with arnorm.AllReduceNorm(mine, cpu_group=twin, **kw) as op:
            out["with twin"] = op.problem.world_size
    finally:
        comm_module._supports_cpu = real
    return out


def malformed_setting_on_one_rank(rank: int, world: int):
    """ARNORM_PROBE_TIMEOUT=abc on rank 1 only: every rank raises the same ConfigError, none blocks."""
    import os

    if rank == 1:
        os.environ["ARNORM_PROBE_TIMEOUT"] = "abc"
    try:
        arnorm.AllReduceNorm(
            torch.distributed.group.WORLD, hidden_size=32, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6)
        ).close()
    except arnorm.ConfigError as exc:
        return str(exc)
    return "built"


def without_residual(rank: int, world: int, backend: str | None):
    """An add_residual=False op on every rank; returns (backend, residual bitwise, normed bitwise,
    whether the backend is served through the -0.0 residual buffer)."""
    from arnorm.op._results import ZeroResidual

    dtype = torch.bfloat16
    partials, _, weight = make_inputs(rank, world, 5, 32, dtype, seed=3)
    partials[0][0, :4] = -0.0  # a sum of negative zeros stays -0.0 only without a +0.0 residual
    for p in partials[1:]:
        p[0, :4] = -0.0
    with arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=32,
        dtype=dtype,
        norm=arnorm.RMSNorm(1e-6, 1.0),
        backend=backend,
        max_tokens=8,
        add_residual=False,
    ) as op:
        out = op(partials[rank].clone(), None, weight)
        h, y = add_rmsnorm(rank_order_sum(partials), None, weight, 1e-6, 1.0)
        same = torch.equal(out.residual.view(torch.int16), h.view(torch.int16))
        wrapped = isinstance(op._plan.table[5], ZeroResidual)
        return op.backend, same, torch.equal(out.normed.view(torch.int16), y.view(torch.int16)), wrapped


def caller_outputs(rank: int, world: int, backend: str):
    """out= at TP ``world`` for every format: bitwise the allocating call, written into ``out``'s
    tensors; under ARNORM_CHECK_CALLS a bad ``out`` on rank 1 alone is rejected on every rank."""
    import os

    hidden, t = 32, 3
    results = []
    for quant in (None, "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"):
        partials, residual, weight = make_inputs(rank, world, t, hidden, torch.bfloat16)
        scale = torch.tensor([0.05]) if quant in ("fp8_static", "nvfp4") else None
        with arnorm.AllReduceNorm(
            torch.distributed.group.WORLD, hidden_size=hidden, dtype=torch.bfloat16,
            norm=arnorm.RMSNorm(1e-6), quant=quant, backend=backend, max_tokens=8,
        ) as op:  # fmt: skip
            a = op(partials[rank].clone(), residual, weight, scale)
            out = op.empty_output(t, scale)
            b = op(partials[rank].clone(), residual, weight, scale, out=out)
            same = torch.equal(a.residual, b.residual) and torch.equal(a.normed, b.normed)
            if quant is not None:
                same = same and torch.equal(a.quant.data.view(torch.uint8), b.quant.data.view(torch.uint8))
                same = same and torch.equal(a.quant.scale.view(torch.uint8), b.quant.scale.view(torch.uint8))
            results.append((quant, same, b.normed is out.normed))
    os.environ["ARNORM_CHECK_CALLS"] = "1"
    partials, residual, weight = make_inputs(rank, world, t, hidden, torch.float32)
    with arnorm.AllReduceNorm(
        torch.distributed.group.WORLD, hidden_size=hidden, dtype=torch.float32,
        norm=arnorm.RMSNorm(1e-6), backend=backend, max_tokens=8,
    ) as op:  # fmt: skip
        bad = op.empty_output(t + 1 if rank == 1 else t)
        try:
            op(partials[rank].clone(), residual, weight, out=bad)
            message = "no error"
        except arnorm.InvalidInputError as exc:
            message = str(exc)
        good = op(partials[rank].clone(), residual, weight, out=op.empty_output(t))
        plain = op(partials[rank].clone(), residual, weight)
        results.append(
            (message, torch.equal(good.residual, plain.residual) and torch.equal(good.normed, plain.normed))
        )
    return results


def not_inplace_leaves_hidden_states(rank: int, world: int, backend: str, dtype_name: str) -> bool:
    """One call of an op built with inplace=False: is hidden_states unchanged afterwards?"""
    dtype = getattr(torch, dtype_name)
    partials, residual, weight = make_inputs(rank, world, 3, 64, dtype)
    x = partials[rank].clone()
    with arnorm.AllReduceNorm(
        torch.distributed.group.WORLD, hidden_size=64, dtype=dtype, norm=arnorm.RMSNorm(1e-6),
        inplace=False, backend=backend, device="cpu", max_tokens=8,
    ) as op:  # fmt: skip
        op(x, residual, weight)
    return bool(torch.equal(x, partials[rank]))


def _gloo_threads() -> int:
    """The process's gloo worker threads (two per live ProcessGroupGloo)."""
    import glob

    return sum(open(p).read().strip() == "pt_gloo_runloop" for p in glob.glob("/proc/self/task/*/comm"))


def group_references(rank: int, world: int, backend: str) -> dict[str, int]:
    """What an op keeps of its process group once closed, or once dropped, with the cyclic
    collector off: a group kept alive past ``destroy_process_group`` is torn down at interpreter
    exit, where a gloo worker finishing the last collective aborts the process."""
    import gc
    import sys

    group = torch.distributed.group.WORLD
    partials, residual, weight = make_inputs(rank, world, 2, 64, torch.float32)

    def build() -> arnorm.AllReduceNorm:
        op = arnorm.AllReduceNorm(
            group, hidden_size=64, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6),
            backend=backend, device="cpu", max_tokens=8,
        )  # fmt: skip
        op(partials[rank].clone(), residual, weight)
        return op

    gc.collect()
    gc.disable()
    try:
        base, threads = sys.getrefcount(group), _gloo_threads()
        op = build()
        out = {"while open": int(sys.getrefcount(group) > base)}
        out["threads while open"] = _gloo_threads() - threads
        op.close()
        out["closed"] = sys.getrefcount(group) - base
        out["threads after close"] = _gloo_threads() - threads
        del op
        build()  # dropped without close
        out["dropped"] = sys.getrefcount(group) - base
        out["threads after drop"] = _gloo_threads() - threads
    finally:
        gc.enable()
    return out


def twin_after_reinit(rank: int, world: int) -> tuple[bool, bool, bool]:
    """A device group over WORLD gets a gloo twin from arnorm (WORLD stands in for an NCCL group
    here). After ``destroy_process_group()`` and a new ``init_process_group()``: is the old twin let
    go (no group kept past its world, see group_references), is a new op given a new twin, and does
    that op give the contract's result?"""
    import gc
    import weakref

    import torch.distributed as dist

    from arnorm.comm import _comm

    store = dist.distributed_c10d._get_default_store()
    cpu_capable = _comm._supports_cpu
    _comm._supports_cpu = lambda g: g is not dist.group.WORLD and cpu_capable(g)
    partials, residual, weight = make_inputs(rank, world, 2, 64, torch.float32)

    def one() -> tuple[Any, bool]:
        with arnorm.AllReduceNorm(
            dist.group.WORLD, hidden_size=64, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6),
            backend="reference", device="cpu", max_tokens=8,
        ) as op:  # fmt: skip
            twin = op._comm.cpu_group
            out = op(partials[rank].clone(), residual, weight)
        h, _ = add_rmsnorm(rank_order_sum(partials), residual, weight, 1e-6, 0.0)
        return twin, bool(torch.equal(out.residual, h))

    gc.disable()
    try:
        first, _ = one()
        old = weakref.ref(first)
        del first
        dist.destroy_process_group()
        released = old() is None
        dist.init_process_group("gloo", store=dist.PrefixStore("again", store), rank=rank, world_size=world)
        second, ok = one()
        return released, second is not old(), ok
    finally:
        gc.enable()
        _comm._supports_cpu = cpu_capable


_KEPT: list[Any] = []


def ops_open_at_exit(rank: int, world: int, report: str) -> None:
    """Keep an op and a one-call op open past ``destroy_process_group()`` (run_ranks destroys the
    group after this returns), as an engine that never closes its ops does. An exit handler
    registered before arnorm's (so it runs after) writes how many gloo worker threads are left."""
    import atexit

    def count() -> None:
        with open(f"{report}.{rank}", "w") as f:
            f.write(str(_gloo_threads()))

    atexit.register(count)
    partials, residual, weight = make_inputs(rank, world, 2, 64, torch.float32)
    op = arnorm.AllReduceNorm(
        torch.distributed.group.WORLD, hidden_size=64, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6),
        backend="reference", device="cpu", max_tokens=8,
    )  # fmt: skip
    op(partials[rank].clone(), residual, weight)
    arnorm.fused_allreduce_norm(
        partials[rank].clone(), residual, weight, group=torch.distributed.group.WORLD, eps=1e-6
    )
    _KEPT.append(op)


def groups_seen_by_close(rank: int, world: int) -> list[bool]:
    """Whether a backend's close() still finds its Comm's group (a plugin's may need it)."""
    import fake_backends

    fake_backends.install_default()
    with arnorm.AllReduceNorm(
        torch.distributed.group.WORLD, hidden_size=32, dtype=torch.float32, max_tokens=8,
        norm=arnorm.RMSNorm(1e-6), backend="fast",
    ):  # fmt: skip
        pass
    return fake_backends.AllReduceBackend.groups_at_close
