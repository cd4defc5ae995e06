"""The ``arnorm`` command line: backends, explain, doctor, demo, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

DTYPES = ("bfloat16", "float16", "float32")
QUANTS = ("none", "fp8_static", "fp8_per_token", "nvfp4", "mxfp8")


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows
    )


def cmd_backends(args: argparse.Namespace) -> int:
    """List every registered backend: priority, version, status and reason, formats."""
    import arnorm

    rows = [("backend", "priority", "version", "status", "formats", "reason")]
    for i in arnorm.backends():
        formats = ",".join(sorted(i.spec.capabilities.quant)) if i.spec else "-"
        prio = "-" if i.priority is None else str(i.priority)
        rows.append((i.name, prio, i.version or "-", i.status, formats, i.reason or "-"))
    print(_table(rows))
    return 0


def _problem_from_args(args: argparse.Namespace) -> object:
    import torch

    from arnorm._op import _platform
    from arnorm._problem import Problem
    from arnorm.quant import check_format

    quant = None if args.quant == "none" else args.quant
    layout = check_format(quant, args.layout, args.hidden) if quant else None
    if args.device:
        device = torch.device(args.device)
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    platform, arch, gfx = _platform(device)
    return Problem(
        args.tp,
        args.hidden,
        args.dtype,
        args.eps,
        args.weight_offset,
        quant,
        layout,
        args.tokens,
        True,
        True,
        device.type,
        platform,
        arch,
        gfx,
    )


def cmd_explain(args: argparse.Namespace) -> int:
    """Which backend this machine would choose for a problem, and every rejection (no collective)."""
    from arnorm._config import load_config
    from arnorm._discovery import get_registry
    from arnorm._select import Preference, explain_locally

    problem = _problem_from_args(args)
    expl = explain_locally(problem, get_registry(), Preference.resolve(args.backend, load_config()))  # type: ignore[arg-type]
    print(expl)
    print("formats each backend declares:")
    for info in get_registry().infos():
        if info.spec is not None:
            print(f"  {info.name:<11} {', '.join(sorted(info.spec.capabilities.quant))}")
    return 0 if expl.chain else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from arnorm._doctor import report

    print(report())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from arnorm._demo import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    """Time every eligible backend against the unfused torch path over a token sweep."""
    from arnorm._bench import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arnorm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help=cmd_backends.__doc__).set_defaults(func=cmd_backends)

    ex = sub.add_parser("explain", help=cmd_explain.__doc__)
    ex.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    ex.add_argument("--hidden", type=int, default=4096)
    ex.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ex.add_argument("--quant", choices=QUANTS, default="none")
    ex.add_argument("--layout", choices=("linear", "swizzled_128x4"), default=None, help="nvfp4/mxfp8 scales")
    ex.add_argument("--tokens", type=int, default=8192, help="max tokens (workspace budget)")
    ex.add_argument("--eps", type=float, default=1e-6)
    ex.add_argument("--weight-offset", type=float, default=0.0, help="1.0 for Gemma norms")
    ex.add_argument("--backend", default=None, help="a name or comma list (strict), as ARNORM_BACKEND")
    ex.add_argument("--device", default=None, help="default: cuda:0 when present, else cpu")
    ex.set_defaults(func=cmd_explain)

    sub.add_parser("doctor", help="python, torch, GPUs, peer access, backends").set_defaults(func=cmd_doctor)

    demo = sub.add_parser(
        "demo", help="a small TP decoder stack through AllReduceNorm, checked against torch"
    )
    demo.add_argument("--tp", type=int, default=2)
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--tokens", type=int, default=16)
    demo.add_argument("--hidden", type=int, default=256)
    demo.add_argument("--quant", choices=QUANTS, default="fp8_static")
    demo.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    demo.add_argument("--backend", default=None)
    demo.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: NCCL on GPUs when at least --tp are present, else gloo on CPU",
    )
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help=cmd_bench.__doc__)
    bench.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel size (default 2; torchrun: WORLD_SIZE)"
    )
    bench.add_argument("--hidden", type=int, default=4096)
    bench.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    bench.add_argument("--quant", choices=QUANTS, default="none")
    bench.add_argument("--tokens", default=None, help="comma list (default 1,16,128,1024; GPU: also 8192)")
    bench.add_argument(
        "--iters", type=int, default=None, help="timed calls per point (default 20 CPU, 200 GPU)"
    )
    bench.add_argument(
        "--warmup", type=int, default=None, help="untimed calls per point (default 3 CPU, 20 GPU)"
    )
    bench.add_argument("--backends", default=None, help="comma list (default: every backend eligible here)")
    bench.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: NCCL on GPUs when at least --tp are present, else gloo on CPU",
    )
    bench.add_argument("--json", default=None, metavar="FILE", help="write every sample as JSON")
    bench.add_argument(
        "--plot", default=None, metavar="FILE.png", help="latency vs tokens (needs matplotlib)"
    )
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as exc:
        from arnorm._errors import ArnormError

        if isinstance(exc, ArnormError):
            print(f"arnorm: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        raise
