"""The ``arnorm`` command line: backends, explain, doctor, demo, bench.

Exit status: 0 success; 1 the command ran and found a problem (nothing eligible, a demo
mismatch, a failed rank); 2 a usage error (a bad argument, a device that is not there, a malformed
setting), reported on one line of stderr without a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from arnorm._formats import DTYPES, LAYOUTS, QUANT_FORMATS
from arnorm._norm import NORM_OPTIONS
from arnorm.cli._usage import UsageError

__all__ = ["build_parser", "main"]

QUANTS = ("none", *QUANT_FORMATS)
MODELS = ("llama", "gemma3")

DESCRIPTION = """\
arnorm: fused tensor-parallel all-reduce + residual add + RMSNorm + quantization.

Start with 'arnorm backends' (what is installed), then 'arnorm explain' (which backend a problem
gets on this machine, and why not the others). 'arnorm demo' runs a small model through the op on
CPU or GPU ranks and checks it against plain torch; 'arnorm bench' times every backend against
the unfused path.
"""
EPILOG = "Exit status: 0 ok, 1 the check or run found a problem, 2 a usage error."


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} (needs an integer >= {low})")
        return value

    return parse


#: argparse types: an int >= 1, an int >= 0.
positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} (needs a finite number > 0)")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite float."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or abs(value) == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} (needs a finite number)")
    return value


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def device_arg(text: str) -> str:
    """argparse type for ``explain --device``: auto, cpu, cuda or cuda:N."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} (needs auto, cpu, cuda or cuda:N)")
    return text


def token_list(text: str) -> list[int]:
    """argparse type: ``"1,16,128"`` -> ``[1, 16, 128]`` (sorted, deduplicated, each >= 1)."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r} (needs a comma list of integers >= 1, e.g. 1,16,128)")
    return values


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    from arnorm.registry._failure import printable

    # Cells come from plugins (names, versions, reasons): one printable line each.
    rows = [tuple(printable(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows
    )


# -- commands -------------------------------------------------------------------------------------


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


def resolve_cli_device(text: str | None) -> Any:
    """The torch device for ``--device`` (``auto``/None: cuda:0 when present, else cpu);
    raises :class:`UsageError` for a device this machine does not have."""
    import torch

    if text in (None, "auto"):
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(text)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"--device {text}: no CUDA device is visible (torch.cuda.is_available() is False)"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise UsageError(f"--device {text}: no such device (needs cuda:0 to cuda:{count - 1})")
    return dev


def problem_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~arnorm.plugin.Problem` ``arnorm explain`` asks about (checked like an op's arguments)."""
    import torch

    import arnorm
    from arnorm.op._args import build_problem

    device = resolve_cli_device(args.device)
    return build_problem(
        args.tp,
        hidden_size=args.hidden,
        dtype=getattr(torch, args.dtype),
        norm=arnorm.RMSNorm(args.eps, args.weight_offset, **{n: getattr(args, n) for n in NORM_OPTIONS}),
        quant=None if args.quant == "none" else args.quant,
        scale_layout=args.layout,
        max_tokens=args.tokens,
        normed_output=True,
        inplace=True,
        device=device,
    )


def status_legend(expl: Any) -> list[str]:
    """One line per status that appears in ``expl``, saying what it means (from ``arnorm.STATUSES``)."""
    from arnorm.registry._explain import STATUSES

    seen = list(dict.fromkeys(v.status for v in expl.verdicts))
    width = max((len(s) for s in seen), default=0)
    return [f"  {s.ljust(width)}  {STATUSES[s]}" for s in seen if s in STATUSES]


def check_settings(backend: str | None = None) -> None:
    """Read every ``ARNORM_*`` setting (the core's and each installed backend's) and warn about
    names that match no backend, before any work: a malformed value is a usage error here (exit
    2, one line), not a traceback from every rank later."""
    from arnorm.op._op import warn_unknown_names
    from arnorm.registry._discovery import get_registry
    from arnorm.registry._load import load_config, load_settings
    from arnorm.registry._select import Preference

    config = load_config()
    registry = get_registry()
    load_settings(registry, config)
    warn_unknown_names(Preference.resolve(backend, config), registry, stacklevel=2)


def cmd_explain(args: argparse.Namespace) -> int:
    """Which backend this machine would choose for a problem, and every other backend's status and
    reasons (local check: no process group, no workspace)."""
    import dataclasses

    from arnorm._config import parse_names
    from arnorm.registry._discovery import get_registry
    from arnorm.registry._load import load_config, load_settings
    from arnorm.registry._select import Preference, explain_locally

    problem = problem_from_args(args)
    if args.backend is not None and not parse_names(args.backend):
        raise UsageError(f"--backend: {args.backend!r} names no backend (needs a name or a comma list; "
                         "leave it out for auto)")  # fmt: skip
    check_settings(args.backend)
    config = load_config()
    problem = config.configured(problem)
    registry = get_registry()
    pref = Preference.resolve(args.backend, config)
    expl = explain_locally(problem, registry, pref, config)
    # In auto mode every installed backend's settings (ARNORM_<NAME>_<FIELD>), not only the chosen
    # one's: explain is where a user looks for what can be set. A named backend: its settings only.
    settings = load_settings(registry, config)
    installed = {i.name for i in registry.infos() if i.status in ("available", "outdated")}
    wanted = installed if pref.names is None else installed & set(pref.names)
    shown = tuple(
        (n, tuple(s.model_dump().items())) for n, s in settings.items() if n in wanted and s.model_dump()
    )
    print(dataclasses.replace(expl, settings=shown))
    print("statuses:")
    print("\n".join(status_legend(expl)))
    print("formats each backend declares:")
    for info in registry.infos():
        if info.spec is not None:
            print(f"  {info.name:<11} {', '.join(sorted(info.spec.capabilities.quant))}")
    return 0 if expl.chain else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    """Python, torch, GPUs and their peer access, and each backend's status."""
    from arnorm.cli._doctor import report

    check_settings()
    print(report())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """A small tensor-parallel model through AllReduceNorm, checked against plain torch."""
    if args.model is not None:
        return _model_demo(args)
    if args.max_tokens is not None:
        raise UsageError("--max-tokens: used with --model only")
    from arnorm.cli._demo import check_backend_names, run

    check_backend_names(args.backend)
    check_settings(args.backend)

    return run(args)


def _model_demo(args: argparse.Namespace) -> int:
    given = [f"--{k}" for k in ("layers", "tokens", "hidden", "quant") if getattr(args, k) is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: not used with --model (the model fixes them)")
    try:
        from arnorm.cli._demo_model import run_model_demo
    except ModuleNotFoundError as exc:
        if exc.name in ("arnorm.cli._demo_model", "arnorm"):
            raise UsageError(
                "--model: this install has no model demo (arnorm.cli._demo_model is missing)"
            ) from None
        raise UsageError(f"--model: the model demo needs {exc.name}, which is not installed") from None
    from arnorm.cli._demo import check_backend_names, pick_device

    check_backend_names(args.backend)
    check_settings(args.backend)
    device = pick_device(args.device, args.tp)
    gpus = _gpu_count() if device == "cuda" else args.tp
    if gpus < args.tp:
        # Hugging Face's own tensor parallelism (DTensor collectives over gloo) crashed with two
        # ranks sharing one H200 (2026-12-03), in the unfused model, before arnorm was involved.
        raise UsageError(
            f"--device cuda: {gpus} GPU(s) visible for --tp {args.tp} (needs one GPU per rank with "
            "--model: transformers' tensor parallelism does not run ranks that share a GPU); "
            f"use --tp {gpus} or --device cpu"
        )
    return int(
        run_model_demo(
            args.model,
            args.tp,
            device,
            dtype=args.dtype,
            backend=args.backend,
            max_tokens=args.max_tokens or 16,
        )
    )


def _gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def cmd_bench(args: argparse.Namespace) -> int:
    """Time every eligible backend against the unfused torch path over a token sweep."""
    from arnorm.cli._bench import run

    for flag in ("json", "plot"):
        path = getattr(args, flag)
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise UsageError(f"--{flag}: {path!r} (needs a file in an existing, writable directory)")
    check_settings()
    return run(args)


# -- the parser -----------------------------------------------------------------------------------


def _add_problem_args(p: argparse.ArgumentParser, *, tokens_help: str) -> None:
    p.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--hidden", type=positive_int, default=4096, help="hidden size H (default 4096)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="activation dtype (default bfloat16)")
    p.add_argument("--quant", choices=QUANTS, default="none", help="quantized output format (default none)")
    p.add_argument("--tokens", type=positive_int, default=8192, help=tokens_help)


def build_parser() -> argparse.ArgumentParser:
    """The ``arnorm`` argument parser (every option has help text)."""
    parser = argparse.ArgumentParser(
        prog="arnorm",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    def command(name: str, func: Any, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=EPILOG)
        p.set_defaults(func=func)
        return p

    command("backends", cmd_backends, "list every registered backend: priority, version, status, formats")

    ex = command(
        "explain",
        cmd_explain,
        "which backend this machine would choose for a problem, every other backend's status and "
        "reasons, and the backend settings in force (a local check: no process group, no workspace)",
    )
    _add_problem_args(ex, tokens_help="max tokens per call, the workspace budget (default 8192)")
    ex.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=None,
        help="block-scale layout for nvfp4 / mxfp8 (default: the format's)",
    )
    ex.add_argument("--eps", type=positive_float, default=1e-6, help="RMSNorm epsilon (default 1e-6)")
    ex.add_argument(
        "--weight-offset",
        type=finite_float,
        default=0.0,
        help="added to the norm weight: 1.0 for Gemma (default 0.0)",
    )
    for option in NORM_OPTIONS.values():  # a flag per norm option: --round-before-weight, ...
        ex.add_argument(f"--{option.name.replace('_', '-')}", action="store_true", help=option.summary)
    ex.add_argument(
        "--backend",
        default=None,
        help="a backend name or comma list, strict like ARNORM_BACKEND (default: auto)",
    )
    ex.add_argument(
        "--device",
        type=device_arg,
        default="auto",
        help="auto (cuda:0 when present, else cpu), cpu, cuda or cuda:N",
    )

    command("doctor", cmd_doctor, "python, torch, GPUs and their peer access, and each backend's status")

    demo = command(
        "demo",
        cmd_demo,
        "a small tensor-parallel model through AllReduceNorm on spawned ranks, checked against plain torch",
    )
    demo.add_argument(
        "--model",
        choices=MODELS,
        default=None,
        help="run a real model architecture (llama or gemma3) instead of the synthetic decoder stack",
    )
    demo.add_argument(
        "--tp", type=positive_int, default=2, help="tensor-parallel size: ranks to spawn (default 2)"
    )
    demo.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="activation dtype (default bfloat16)"
    )
    demo.add_argument("--backend", default=None, help="a backend name or comma list, strict (default: auto)")
    demo.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: NCCL on GPUs when at least --tp are present, else gloo on CPU",
    )
    demo.add_argument(
        "--layers", type=positive_int, default=None, help="synthetic stack: decoder layers (default 4)"
    )
    demo.add_argument(
        "--tokens", type=positive_int, default=None, help="synthetic stack: tokens per step (default 16)"
    )
    demo.add_argument(
        "--hidden",
        type=positive_int,
        default=None,
        help="synthetic stack: hidden size, a multiple of --tp (default 256)",
    )
    demo.add_argument(
        "--quant",
        choices=QUANTS,
        default=None,
        help="synthetic stack: quantized output format (default fp8_static)",
    )
    demo.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="with --model: the most tokens to generate (default 16)",
    )

    bench = command(
        "bench", cmd_bench, "time every eligible backend against the unfused torch path over a token sweep"
    )
    bench.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        help="tensor-parallel size (default 2; under torchrun: WORLD_SIZE)",
    )
    bench.add_argument("--hidden", type=positive_int, default=4096, help="hidden size H (default 4096)")
    bench.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="activation dtype (default bfloat16)"
    )
    bench.add_argument(
        "--quant", choices=QUANTS, default="none", help="quantized output format (default none)"
    )
    bench.add_argument(
        "--tokens",
        type=token_list,
        default=None,
        help="token counts, a comma list (default 1,16,128,1024; GPU: also 8192)",
    )
    bench.add_argument(
        "--iters",
        type=positive_int,
        default=None,
        help="samples per point: calls on CPU or with --eager (default 20; --eager on GPU: 200), "
        "else replays of a 20-call CUDA graph (default 20)",
    )
    bench.add_argument(
        "--eager",
        action="store_true",
        help="GPU: time one call at a time after a barrier (host launch and rank skew included) "
        "instead of CUDA-graph replay",
    )
    bench.add_argument(
        "--warmup",
        type=non_negative_int,
        default=None,
        help="untimed calls per point (default 3 on CPU, 20 on GPU)",
    )
    bench.add_argument(
        "--backends",
        default=None,
        help="comma list to time (default: every backend eligible here); 'auto' times the op built "
        "without backend= and says which backend it ran per token count",
    )
    bench.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: NCCL on GPUs when at least --tp are present, else gloo on CPU",
    )
    bench.add_argument(
        "--timeout",
        type=positive_int,
        default=900,
        metavar="SECONDS",
        help="bound on the spawned ranks' whole run (default 900: a backend's first use may build "
        "its kernels for minutes, e.g. FlashInfer's all-reduce module)",
    )
    bench.add_argument("--json", default=None, metavar="FILE", help="write every sample as JSON to FILE")
    bench.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="plot latency vs tokens to FILE.png (needs matplotlib)",
    )
    return parser


# -- entry point ----------------------------------------------------------------------------------


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"arnorm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from arnorm._errors import ArnormError, SelectionError
        from arnorm.testing._ranks import RankError

        if isinstance(exc, RankError):
            print(f"arnorm {args.command}: {exc}", file=sys.stderr)
            if exc.timed_out and getattr(args, "timeout", None):
                print(
                    f"arnorm {args.command}: --timeout {args.timeout} s ran out (needs more when a backend "
                    "builds its kernels on first use, which takes minutes: raise --timeout)",
                    file=sys.stderr,
                )
            return 1
        if isinstance(exc, SelectionError):  # the message carries the explanation table
            print(f"arnorm {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, ArnormError):  # a bad argument or setting: one line
            print(f"arnorm {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see the module docstring)."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # here, not at interpreter exit, so a closed pipe is caught below
    except BrokenPipeError:
        # The reader went away (``arnorm backends | head -1``): stop quietly, as a filter should.
        # stdout is pointed at devnull so the interpreter's final flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a process a closed pipe stopped
    except KeyboardInterrupt:
        print("arnorm: interrupted", file=sys.stderr)
        return 130
