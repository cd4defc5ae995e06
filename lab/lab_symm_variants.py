"""A/B of ``triton_symm`` kernel variants on one GPU: the kernel alone, with itself as its peer, and
two ranks pushing to each other.

Each variant is a copy of ``arnorm_triton/symm/_kernels.py`` (``git show
<commit>:arnorm_triton/symm/_kernels.py > old.py`` makes one of an older commit); ``NAME=PATH:KPATH``
also replaces ``arnorm_triton/_kernels.py`` (the epilogue it imports) with ``KPATH``. A variant runs
in a child process over an overlay: a copy of the ``arnorm_triton`` package with the variant's files
in place, first on ``PYTHONPATH``. Children run variant after variant, then back in reverse order
(``--rounds`` passes, alternating), so drift of the lent host falls on every variant alike; each
cell is the best of the passes, each pass the best of 3 CUDA-graph timings (check_triton_symm's
``_graph_time`` / ``_pair_graph_time``). Columns: ``triton`` (the reference kernel), ``push W=1``
(no protocol), ``push self`` (rank 0 whose peer is itself: every instruction of a TP 2 push call;
``push self W=n`` for each further ``--worlds`` size, every peer itself), ``pair`` (ranks 0 and 1 on
two streams); cells H 4096 none and H 8192 fp8_static at T 1, 16, 128. Each child checks its ``push
self`` results at T 16 bit for bit against the reference.

    python3 lab/lab_symm_variants.py head=old.py new=arnorm_triton/symm/_kernels.py [--rounds 2]
        [--worlds 2,8]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CELLS = ((4096, None), (8192, "fp8_static"))
TOKENS = (1, 16, 128)
BASE_COLUMNS = ("triton", "push W=1", "push self", "pair")


def columns(worlds: tuple[int, ...]) -> tuple[str, ...]:
    """The table's columns: ``push self`` is world size 2; other sizes get a column each."""
    return BASE_COLUMNS + tuple(f"push self W={w}" for w in worlds if w != 2)


def overlay(directory: str, symm_path: str, kernels_path: str | None) -> str:
    """A copy of ``arnorm_triton`` under ``directory`` with the variant's files; returns the path to
    put first on ``PYTHONPATH``."""
    pkg = os.path.join(directory, "arnorm_triton")
    shutil.copytree(os.path.join(ROOT, "arnorm_triton"), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(symm_path, os.path.join(pkg, "_symm_kernels.py"))
    if kernels_path:
        shutil.copyfile(kernels_path, os.path.join(pkg, "_kernels.py"))
    return directory


def child(name: str, worlds: tuple[int, ...] = (2,)) -> list[dict[str, Any]]:
    """Time every cell with the ``arnorm_triton`` importable now (the variant's overlay)."""
    import torch

    import arnorm_triton

    expected = os.environ.get("ARNORM_LAB_OVERLAY", "")
    assert arnorm_triton.__file__.startswith(expected), (arnorm_triton.__file__, expected)
    sys.path.insert(0, HERE)
    import check_triton_symm as C

    from arnorm.plugin import Comm
    from arnorm_triton._backend import TritonBackend
    from arnorm_triton._plugin import TritonSettings

    rows = []
    for hidden, quant in CELLS:
        problem = C._problem(1, hidden, "bfloat16", quant, None, max_tokens=1024)
        backends = {
            "triton": TritonBackend.create(problem, Comm(None, torch.device("cuda", 0)), TritonSettings()),
            "push W=1": C._local_backend(problem, C._slots(1), 1, oneshot_max=1024, push_max=128),
            "push self": C._self_push(problem, C._slots(2)),
            **{f"push self W={w}": C._self_push(problem, C._slots(w), world=w) for w in worlds if w != 2},
        }
        pair = C._pair(problem, C._slots(2), 128)
        for t in TOKENS:
            x = torch.randn(t, hidden, device="cuda").to(torch.bfloat16)
            res = torch.randn_like(x)
            w = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
            scale = torch.tensor([0.05], device="cuda") if quant else None
            row: dict[str, Any] = {"variant": name, "hidden": hidden, "quant": quant or "none", "tokens": t}
            for col, b in backends.items():
                row[col] = min(
                    C._graph_time(functools.partial(b, x.clone(), res, w, scale)) for _ in range(3)
                )
                if col != "triton":
                    b.check()
            xs = [x.clone(), (x * 0.5).clone()]
            fns = [functools.partial(b, xs[r], res.clone(), w, scale) for r, b in enumerate(pair)]
            row["pair"] = min(C._pair_graph_time(fns) for _ in range(3))
            for b in pair:
                b.check()
            if t == 16:
                row["self check"] = "; ".join(
                    C._self_check(b, x, res, w, scale, problem, col)
                    for col, b in backends.items()
                    if col.startswith("push self")
                )
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], names: list[str], worlds: tuple[int, ...] = (2,)) -> str:
    """One markdown table per column: a row per cell, a column per variant (best over passes)."""
    out = []
    for col in columns(worlds):
        out += [f"### {col} (us per call)", "", "| H | format | T | " + " | ".join(names) + " |",
                "|---:|---|---:|" + "---:|" * len(names)]  # fmt: skip
        for hidden, quant in CELLS:
            for t in TOKENS:
                cells = []
                for n in names:
                    got = [r[col] for r in rows if r["variant"] == n and r["hidden"] == hidden
                           and r["quant"] == (quant or "none") and r["tokens"] == t]  # fmt: skip
                    cells.append(f"{min(got):.2f}" if got else "-")
                out.append(f"| {hidden} | {quant or 'none'} | {t} | " + " | ".join(cells) + " |")
        out.append("")
    checks = sorted({f"- {r['variant']}: {r['self check']}" for r in rows if "self check" in r})
    return "\n".join([*out, "Push self at T 16 against the reference:", "", *checks])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", help="NAME=PATH[:KERNELS_PATH] of a copy of _symm_kernels.py")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--worlds", default="2", help="comma-separated world sizes of the push self columns")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    worlds = tuple(int(w) for w in args.worlds.split(","))
    if args.child:
        print("JSON " + json.dumps(child(args.child, worlds)), flush=True)
        return
    specs = []
    for v in args.variants:
        name, _, paths = v.partition("=")
        symm, _, kernels = paths.partition(":")
        specs.append((name, os.path.abspath(symm), os.path.abspath(kernels) if kernels else None))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {n: overlay(os.path.join(tmp, n), s, k) for n, s, k in specs}
        order = [n for n, _, _ in specs]
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                path = os.pathsep.join([paths[name], os.environ.get("PYTHONPATH", "")])
                env = dict(os.environ, PYTHONPATH=path, ARNORM_LAB_OVERLAY=paths[name])
                cmd = [sys.executable, __file__, "--child", name, "--worlds", args.worlds]
                run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
                got = [ln for ln in run.stdout.splitlines() if ln.startswith("JSON ")]
                if run.returncode or not got:
                    print(f"{name}: exit {run.returncode}\n{run.stderr[-2000:]}", file=sys.stderr)
                    continue
                rows += json.loads(got[-1][5:])
                print(f"round {r} {name} done", file=sys.stderr, flush=True)
    print(table(rows, [n for n, _, _ in specs], worlds))


if __name__ == "__main__":
    main()
