"""Shared helpers for the triton backend tests, and the functions spawned ranks run (importable by name)."""

from __future__ import annotations

import torch

from arnorm.plugin import DTYPES as DTYPE_NAMES
from arnorm.plugin import Comm, Problem, RMSNorm, add_rmsnorm, rank_order_sum
from arnorm.quant import quantize
from arnorm.testing import ulps as ulp_distance  # elementwise, as these tests use it
from arnorm.testing._compare import nearest_two_rounding_normed

#: Format variants: (quant, scale_layout).
VARIANTS = [
    (None, None),
    ("fp8_static", None),
    ("fp8_per_token", None),
    ("nvfp4", "linear"),
    ("nvfp4", "swizzled_128x4"),
    ("mxfp8", "linear"),
    ("mxfp8", "swizzled_128x4"),
]
DTYPES = [getattr(torch, d) for d in DTYPE_NAMES]


def variant_id(v: tuple[str | None, str | None]) -> str:
    return "none" if v[0] is None else (v[0] if v[1] is None else f"{v[0]}-{v[1]}")


def platform_of(device: torch.device) -> tuple[str, tuple[int, int] | None]:
    if device.type != "cuda":
        return device.type, None
    if torch.version.hip:
        return "rocm", None
    return "cuda", tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def make_problem(
    hidden: int,
    dtype: torch.dtype,
    quant: str | None = None,
    layout: str | None = None,
    *,
    weight_offset: float = 0.0,
    world_size: int = 1,
    max_tokens: int = 64,
    normed_output: bool = True,
    inplace: bool = True,
    device: torch.device | str = "cpu",
    eps: float = 1e-6,
    round_before_weight: bool = False,
    normalize_unrounded: bool = False,
) -> Problem:
    device = torch.device(device)
    platform, arch = platform_of(device)
    return Problem(
        world_size=world_size,
        hidden_size=hidden,
        dtype=str(dtype).removeprefix("torch."),
        eps=eps,
        weight_offset=weight_offset,
        quant=quant,
        scale_layout=layout,
        max_tokens=max_tokens,
        normed_output=normed_output,
        inplace=inplace,
        device_type=device.type,
        platform=platform,
        arch=arch,
        norm_options=RMSNorm(eps, weight_offset, round_before_weight, normalize_unrounded).options,
    )


def make_backend(problem: Problem, comm: Comm | None = None, **settings):
    """``TritonBackend.create`` with ``TritonSettings(**settings)`` (local comm by default)."""
    from arnorm_triton._backend import TritonBackend
    from arnorm_triton._plugin import TritonSettings

    cpu = problem.device_type == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    comm = comm if comm is not None else Comm(None, device)
    return TritonBackend.create(problem, comm, TritonSettings(**settings))


def make_inputs(tokens: int, hidden: int, dtype: torch.dtype, *, world: int = 1, weight_offset: float = 0.0,
                seed: int = 0, device: torch.device | str = "cpu"):  # fmt: skip
    """Partials [world, T, H], residual [T, H], weight [H] (around 1 for either norm), all in dtype."""
    g = torch.Generator().manual_seed(seed)
    partials = torch.randn(world, tokens, hidden, generator=g).to(dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.1 + (1.0 - weight_offset)).to(dtype)
    return partials.to(device), residual.to(device), weight.to(device)


def make_scale(quant: str | None, y_ref: torch.Tensor) -> torch.Tensor | None:
    """fp8_static: a dequant scale that saturates the largest values; nvfp4: 448 * 6 / amax."""
    if quant == "fp8_static":
        return torch.tensor([float(y_ref.float().abs().max()) / 400.0], device=y_ref.device)
    if quant == "nvfp4":
        return torch.tensor([448.0 * 6.0 / float(y_ref.float().abs().max())], device=y_ref.device)
    return None


def assert_normed_close(y: torch.Tensor, y_ref: torch.Tensor) -> None:
    """Within 1 ulp of the dtype for bf16 / fp16. fp32: within 2**-19 relative (a few ulps), because
    the reference's own fp32 mean and rsqrt are off by an ulp or two (CUDA's rsqrtf by up to 2) and
    the two fp32 products after them round again: no kernel can promise 1 fp32 ulp against it."""
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    if y.dtype == torch.float32:
        err = (y.double() - y_ref.double()).abs()
        bound = y_ref.double().abs() * 2.0**-19 + 1e-30
        bad = (err > bound) & ~(y.isnan() & y_ref.isnan())
        assert not bad.any(), f"fp32 normed: {int(bad.sum())} elements beyond 2**-19 relative"
    else:
        d = ulp_distance(y, y_ref)
        assert int(d.max()) <= 1, f"normed: max {int(d.max())} ulp"


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Same bits, except that any NaN matches any NaN (payloads are not part of the contract:
    torch, the hardware cast and the integer-bit cast each pick their own)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    nan = a.isnan() & b.isnan()
    same = (bytes_of(a) == bytes_of(b)).view((*a.shape, -1)).all(-1) | nan
    assert bool(same.all()), f"{what}: {int((~same).sum())} elements differ"


def assert_quant_equal(q, expect) -> None:
    """Bitwise: data, scales, format, layout, global scale."""
    assert q is not None and expect is not None
    assert (q.format, q.layout) == (expect.format, expect.layout)
    assert q.data.dtype == expect.data.dtype and q.data.shape == expect.data.shape
    assert q.scale.dtype == expect.scale.dtype and q.scale.shape == expect.scale.shape
    assert torch.equal(bytes_of(q.data), bytes_of(expect.data)), "quant data differs"
    assert torch.equal(bytes_of(q.scale), bytes_of(expect.scale)), "quant scales differ"
    if expect.global_scale is not None:
        assert q.global_scale is not None and torch.equal(q.global_scale, expect.global_scale)


def check_output(out, s: torch.Tensor, residual, weight, problem: Problem, scale) -> None:
    """The contract given the backend's reduced sum ``s``: residual bitwise, normed close, quant
    bitwise equal to arnorm.quant.quantize of the kernel's own normed values."""
    norm = RMSNorm.with_options(problem.eps, problem.weight_offset, problem.norm_options)
    h_ref, y_ref = add_rmsnorm(
        s, residual, weight, norm.eps, norm.weight_offset, **dict.fromkeys(norm.options, True)
    )
    assert_bitwise(out.residual, h_ref, "residual")
    if problem.normed_output and norm.round_before_weight:
        unrounded = s.float() + residual.float() if norm.normalize_unrounded else None
        y_ref = nearest_two_rounding_normed(
            out.normed, h_ref, weight, problem.eps, problem.weight_offset, unrounded
        )
    if problem.normed_output:
        assert_normed_close(out.normed, y_ref)
    else:
        assert out.normed is None
    if problem.quant is None:
        assert out.quant is None
    elif problem.normed_output:
        assert_quant_equal(
            out.quant, quantize(out.normed, problem.quant, scale=scale, layout=problem.scale_layout)
        )


# -- functions the spawned ranks run --------------------------------------------------------------


def rank_cases(
    rank: int, world: int, cases: list[tuple], exact: bool, via_op: bool, device: str = "cpu"
) -> list[str]:
    """Run each (quant, layout, dtype, offset, tokens, hidden, inplace) case on this rank; return failures.

    Normal mode: the expected ``s`` is what the same gloo all-reduce gives; exact mode: the
    reference's fp32 rank-order sum, and the residual must match it bitwise.
    """
    import torch.distributed as dist

    import arnorm

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    failures = []
    for i, (quant, layout, dtype, offset, tokens, hidden, inplace) in enumerate(cases):
        try:
            # On the device: an NCCL group reduces device tensors only.
            partials, residual, weight = make_inputs(
                tokens, hidden, dtype, world=world, weight_offset=offset, seed=i, device=dev
            )
            problem = make_problem(hidden, dtype, quant, layout, weight_offset=offset, world_size=world,
                                   inplace=inplace, device=dev, max_tokens=max(64, tokens))  # fmt: skip
            if exact:
                s = rank_order_sum(list(partials))
            else:
                s = partials[rank].clone()
                dist.all_reduce(s)
            scale = make_scale(quant, add_rmsnorm(s, residual, weight, 1e-6, offset)[1])
            x = partials[rank].clone()
            config = arnorm.Config(settings={"triton": {"exact": exact}})
            if via_op:
                with arnorm.AllReduceNorm(
                    dist.group.WORLD,
                    hidden_size=hidden, dtype=dtype, norm=arnorm.RMSNorm(1e-6, offset), quant=quant,
                    scale_layout=layout, max_tokens=64, backend="triton", inplace=inplace, config=config,
                    device=dev,
                ) as op:  # fmt: skip
                    assert op.backend == "triton"
                    out = op(x, residual, weight, scale)
            else:
                # resolve: an NCCL group gets its gloo twin for the agreement, as an op's does.
                backend = make_backend(problem, Comm.resolve(dist.group.WORLD, dev), exact=exact)
                assert backend.exact == exact
                out = backend(x, residual, weight, scale)
                backend.close()
            assert (out.residual is x) == inplace
            if not inplace:
                assert torch.equal(x, partials[rank]), "hidden_states modified with inplace=False"
            check_output(out, s, residual, weight, problem, scale)
        except AssertionError as exc:
            failures.append(f"rank {rank} case {i} {quant} {layout} {dtype} offset={offset}: {exc}")
    return failures


def rank_plan(rank: int, world: int, plan: list[tuple[list[tuple], bool, bool]]) -> list[str]:
    """Several :func:`rank_cases` groups ``(cases, exact, via_op)`` in one spawn (start-up dominates)."""
    failures = []
    for cases, exact, via_op in plan:
        failures += rank_cases(rank, world, cases, exact, via_op)
    return failures


def gpu_rank_cases(rank: int, world: int, cases: list[tuple], exact: bool) -> list[str]:
    """:func:`rank_cases` on this rank's GPU over NCCL, driving the backend directly."""
    return rank_cases(rank, world, cases, exact, False, device="cuda")
