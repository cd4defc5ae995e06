"""``arnorm bench``: every eligible backend against the unfused torch path, over a token sweep.

For one problem (TP size, hidden size, dtype, quant format) it times, per token count:

- ``baseline``: what an engine writes by hand: ``torch.distributed.all_reduce`` of the partial in
  place, then add + RMSNorm in torch (:func:`arnorm.plugin.add_rmsnorm`), then the quantizer of
  :mod:`arnorm.quant` when a format is set;
- each backend through ``arnorm.AllReduceNorm(..., backend=name)`` (strict). By default: every
  backend a local explain finds eligible here; a requested backend that is not eligible, or fails
  to build, is reported with its reasons and not timed;
- ``auto`` (when ``--backends`` names it): the op built without ``backend=``, so selection picks
  per token count; its rows say which backend it ran, so it can be held against the fastest.

Ranks are spawned with :func:`arnorm.testing.run_ranks` (gloo on CPU, NCCL when at least ``--tp``
GPUs exist); under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) the
bench runs in-process on every rank and rank 0 prints. On GPUs a sample is a CUDA-graph replay of
20 calls, per call (:mod:`arnorm.cli._bench_timing` says why and how); on CPU, or with ``--eager``, one
call timed alone after a barrier. A sample is the slowest rank's time; the table shows the median
and p10-p90 in microseconds, the speed-up over the baseline, and the backend auto mode picks for
each token count (``op.backend_for(T)`` of one auto-mode op).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from arnorm._formats import FORMAT_SPECS
from arnorm.cli._bench_report import BASELINE, combine, render_table, write_plot

if TYPE_CHECKING:
    import torch

    from arnorm._problem import Problem

__all__ = [
    "make_problem",
    "parse_tokens",
    "rejection",
    "run",
    "select_backends",
]

EPS = 1e-6
#: The ``--backends`` entry that times the op built without ``backend=`` (selection per token count).
AUTO = "auto"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: The token sweep when ``--tokens`` is not given, by "on a GPU".
DEFAULT_TOKENS = {False: "1,16,128,1024", True: "1,16,128,1024,8192"}


def parse_tokens(text: str) -> list[int]:
    """``"1,16,128"`` -> ``[1, 16, 128]`` (sorted, deduplicated); raises on anything but positive ints."""
    from arnorm._errors import InvalidInputError

    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise InvalidInputError(f"tokens: {text!r} (needs a comma list of positive ints, e.g. 1,16,128)")
    return values


class Progress:
    """A one-line progress bar on stderr (``[#####.....] 5/10 label``), redrawn in place."""

    def __init__(self, total: int, enabled: bool, width: int = 30) -> None:
        self.total, self.enabled, self.width, self.done = max(total, 1), enabled, width, 0

    def advance(self, label: str, steps: int = 1) -> None:
        self.done += steps
        if self.enabled:
            filled = self.width * self.done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {label:<28}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def make_problem(tp: int, hidden: int, dtype: str, quant: str | None, max_tokens: int, cuda: bool) -> Problem:
    """The :class:`~arnorm.plugin.Problem` every rank builds (device ``cuda:0`` or ``cpu``)."""
    import torch

    import arnorm
    from arnorm.op._args import build_problem

    return build_problem(
        tp,
        hidden_size=hidden,
        dtype=getattr(torch, dtype),
        norm=arnorm.RMSNorm(EPS, 0.0),
        quant=quant,
        scale_layout=None,
        max_tokens=max_tokens,
        normed_output=True,
        inplace=True,
        device=torch.device("cuda", 0) if cuda else torch.device("cpu"),
    )


def select_backends(
    problem: Problem, names: Sequence[str] | None
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """``(backends to time, {not timed: {"status", "reasons"}})`` from a local check (no collective).

    ``names=None``: every registered backend eligible for ``problem`` here, in the one backend
    order (priority, then name; ``ARNORM_DISABLE`` respected); else exactly ``names``, in that
    order, and the ones that are not eligible with their verdicts.
    """
    from arnorm.registry._discovery import get_registry
    from arnorm.registry._load import load_config
    from arnorm.registry._select import Preference, check_locally
    from arnorm.registry._spec import priority_order

    config = load_config()
    if names is None:
        pref = Preference(None, "auto", tuple(config.disable))
    else:
        pref = Preference(tuple(names), "--backends")
    verdicts = list(check_locally(problem, get_registry(), pref, timeout=config.probe_timeout).values())
    if names is None:
        verdicts.sort(key=lambda v: priority_order(v.priority, v.backend))
    eligible = [v.backend for v in verdicts if v.is_usable]
    rejected = {
        v.backend: {"status": v.status, "reasons": list(v.reasons)}
        for v in verdicts
        if not v.is_usable and names is not None
    }
    return eligible, rejected


def _timed_backends(
    problem: Problem, names: Sequence[str] | None
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """:func:`select_backends`, with ``auto`` (not a backend: the op built without ``backend=``)
    kept where it was asked for and left out of the eligibility check."""
    if names is None or AUTO not in names:
        return select_backends(problem, names)
    named = [n for n in names if n != AUTO]
    eligible, rejected = select_backends(problem, named) if named else ([], {})
    return [n for n in names if n in eligible or n == AUTO], rejected


def rejection(exc: BaseException, backend: str | None) -> dict[str, Any]:
    """``{"status", "reasons"}`` of an op that could not be built, read from the error's explanation:
    ``backend``'s verdict (strict builds), or every unusable verdict (auto mode)."""
    from arnorm._errors import SelectionError

    expl = exc.explanation if isinstance(exc, SelectionError) else None
    if expl is None:  # a bad argument or setting: the message is one line in the reason grammar
        return {"status": "error", "reasons": [f"{type(exc).__name__}: {exc}"]}
    if backend is not None:
        verdict = expl.verdict(backend)
        if verdict is not None:
            return {"status": verdict.status, "reasons": list(verdict.reasons)}
    reasons = [f"{v.backend} ({v.status}): {r}" for v in expl.verdicts if not v.is_usable for r in v.reasons]
    return {"status": "none_usable", "reasons": reasons}


def _unfused(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    *,
    quant: str | None,
    layout: str | None,
) -> Any:
    """The hand-written path: all_reduce (in place, in the dtype), add + RMSNorm, quantize."""
    import torch.distributed as dist

    from arnorm.plugin import add_rmsnorm, quantize_output

    dist.all_reduce(partial)
    h, y = add_rmsnorm(partial, residual, weight, EPS, 0.0)
    return h, y, quantize_output(y, quant, scale, layout)


def _rank_main(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank: the auto-mode picks, then the baseline and every backend over the token sweep."""
    import torch
    import torch.distributed as dist

    import arnorm
    from arnorm.cli._bench_timing import time_eager, time_graph
    from arnorm.quant import default_layout

    cuda: bool = opts["cuda"]
    if not cuda and "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores, as under torchrun
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, opts["dtype"])
    hidden, tokens, quant = int(opts["hidden"]), list(opts["tokens"]), opts["quant"]
    max_t = max(tokens)
    norm = arnorm.RMSNorm(eps=EPS, weight_offset=0.0)
    group = dist.group.WORLD
    common = dict(hidden_size=hidden, dtype=dtype, norm=norm, quant=quant, max_tokens=max_t, device=device)
    g = torch.Generator().manual_seed(1000 + rank)
    partial = torch.randn(max_t, hidden, generator=g).to(dtype).to(device)
    residual = torch.randn(max_t, hidden, generator=g).to(dtype).to(device)
    weight = (torch.randn(hidden, generator=g) * 0.1).to(dtype).to(device)
    sample = FORMAT_SPECS[quant].sample_scale if quant else None
    scale = torch.tensor([sample], device=device) if sample is not None else None
    cpu_group = None if str(dist.get_backend()) == "gloo" else dist.new_group(backend="gloo")
    graphs = cuda and not opts["eager"]

    def barrier() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=cpu_group)

    def agree(ok: bool) -> bool:
        flags: list[Any] = [None] * world
        dist.all_gather_object(flags, ok, group=cpu_group)
        return all(flags)

    def timed(fn: Callable[..., Any], t: int, entry: dict[str, Any]) -> list[float]:
        args = (torch.empty_like(partial[:t]), residual[:t], weight, scale)
        warmup, iters = opts["warmup"], opts["iters"]
        if graphs:
            got = time_graph(fn, args, partial[:t], warmup, iters, barrier, agree)
            if not isinstance(got, str):
                entry["restore_us"] = got[1]
                return got[0]
            entry["note"] = f"{got}: timed one call at a time"
        return time_eager(fn, args, partial[:t], warmup, iters, cuda, barrier)

    auto: dict[str, str] = {}
    auto_error: list[str] = []
    try:
        with arnorm.AllReduceNorm(group, **common) as op:
            for t in tokens:
                served = op.explain(t)
                auto[str(t)] = served.token_backend or "-"
                if served.token_backend is None:
                    auto_error += [f"T={t}: {n}: {r}" for n, rs in served.token_reasons for r in rs]
    except arnorm.ArnormError as exc:
        auto_error = rejection(exc, None)["reasons"]

    names: list[str] = list(opts["backends"])
    progress = Progress(len(tokens) * (1 + len(names)), rank == 0)
    results: list[dict[str, Any]] = []
    rejected: dict[str, dict[str, Any]] = {}
    layout = default_layout(quant) if quant else None
    baseline = functools.partial(_unfused, quant=quant, layout=layout)

    def sweep(name: str, fn: Callable[..., Any], op: Any) -> None:
        for t in tokens:
            progress.advance(f"{name} T={t}")
            entry: dict[str, Any] = {"backend": name, "tokens": t, "samples_us": [], "error": None}
            served = op.explain(t) if op is not None else None
            if name == AUTO and served is not None:
                entry["picked"] = served.token_backend
            if served is not None and served.token_backend is None:
                entry["error"] = "; ".join(r for _, rs in served.token_reasons for r in rs)
            else:
                entry["samples_us"] = timed(fn, t, entry)
            results.append(entry)

    sweep(BASELINE, baseline, None)
    for name in names:
        try:
            op = arnorm.AllReduceNorm(group, **common, backend=None if name == AUTO else name)
        except arnorm.ArnormError as exc:
            rejected[name] = rejection(exc, None if name == AUTO else name)
            progress.advance(f"{name}: not eligible", len(tokens))
            continue
        try:
            sweep(name, op, op)
        finally:
            op.close()
    progress.close()
    return {"auto": auto, "auto_error": auto_error, "results": results, "rejected": rejected}


def _in_process(opts: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """Under torchrun: join (or reuse) the env:// group, run this rank, gather every rank's result."""
    import torch
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        if opts["cuda"]:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if opts["cuda"] else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = _rank_main(rank, world, opts)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
    finally:
        if owned:
            dist.destroy_process_group()
    return rank, gathered


def run(args: argparse.Namespace) -> int:
    """``arnorm bench``; exit status 0: something was timed, 1: no backend could be.

    Usage errors raise the CLI's ``UsageError`` (exit status 2, one line)."""
    import torch

    from arnorm.cli._usage import UsageError

    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot: needs matplotlib (pip install 'arnorm[plot]')")
    torchrun = all(v in os.environ for v in TORCHRUN_VARS)
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (args.tp or 2)
    if args.tp is not None and args.tp != world:
        raise UsageError(f"--tp {args.tp}: differs from torchrun's WORLD_SIZE {world}")
    has_cuda = torch.cuda.is_available()
    if args.device == "cuda" and not has_cuda:
        raise UsageError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    n_gpu = torch.cuda.device_count() if has_cuda else 0
    cuda = args.device == "cuda" or (args.device == "auto" and has_cuda and (torchrun or n_gpu >= world))
    tokens = list(args.tokens) if args.tokens else parse_tokens(DEFAULT_TOKENS[cuda])
    quant = None if args.quant == "none" else args.quant
    from arnorm.registry._load import load_config
    from arnorm.registry._select import Preference

    config = load_config()
    problem = make_problem(world, args.hidden, args.dtype, quant, max(tokens), cuda)
    # As `arnorm explain` does: the ops read the mode too, so the local check asks what they will.
    problem = config.configured(problem)
    names = [n.strip() for n in args.backends.split(",") if n.strip()] if args.backends is not None else None
    if names == []:
        raise UsageError(
            f"--backends: {args.backends!r} names no backend (needs a name or a comma list; leave it out to "
            "time every eligible backend)"
        )
    backends, rejected = _timed_backends(problem, names)
    # The "auto" column's op reads ARNORM_BACKEND like any op: the report says what chose.
    choice = Preference.resolve(None, config).source
    comm = "nccl" if cuda and (n_gpu >= world or torchrun) else "gloo"
    opts: dict[str, Any] = {
        "tp": world,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "quant": quant,
        "batch_invariant": problem.batch_invariant,
        "tokens": tokens,
        "iters": args.iters or (200 if cuda and args.eager else 20),
        "warmup": args.warmup if args.warmup is not None else (20 if cuda else 3),
        "eager": bool(args.eager),
        "requested": names,
        "choice": choice,
        "backends": backends,
        "cuda": cuda,
        "device": "cuda" if cuda else "cpu",
        "comm": comm,
        "launcher": "torchrun" if torchrun else "spawned ranks",
        "timing": "time.perf_counter" if not cuda else "CUDA events" if args.eager else "CUDA graphs",
    }
    if torchrun:
        rank, per_rank = _in_process(opts)
        if rank != 0:
            return 0
    else:
        from arnorm.testing import run_ranks

        per_rank = run_ranks(world, _rank_main, opts, backend=comm, timeout=float(args.timeout))
    report = combine(per_rank, {k: v for k, v in opts.items() if k != "cuda"}, rejected)
    print(render_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if report["timed"] else 1
