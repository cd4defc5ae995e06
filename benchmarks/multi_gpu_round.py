"""The steps of ``benchmarks/gpu_multi_round.sh`` (one round on a machine with 2, 4 or 8 GPUs),
bounded by one deadline, each writing one line to ``$OUT/summary.txt``.

``build-flashinfer``: FlashInfer's all-reduce JIT module (``trtllm_ar.get_trtllm_comm_module()``),
built once, in the background, while the rest runs (about 6 minutes on a fresh machine); its last
line says ``built``, ``not installed`` or ``failed``.

``run``: the round itself, in this order, never starting a step its time does not fit:

1. functional, GPUs shared, FlashInfer disabled (its module is still building): every test marked
   ``multigpu`` outside ``tests/arnorm_flashinfer`` and ``triton_symm``'s leak test, side by side
   with ``arnorm demo --model llama`` and ``--model gemma3`` at TP 2 (NCCL, one rank per GPU), then
   ``benchmarks/multi_gpu_faults.py`` (a rank killed mid-call, a stalled one, a late one);
2. timed, GPUs exclusive per job (jobs on disjoint GPU groups run side by side): per TP (2, 4, 8
   up to the GPUs present) and (H, quant), ``arnorm bench --backends triton_symm,triton`` (part
   ``symm``, FlashInfer disabled) at once, and ``--backends flashinfer,auto`` (part ``fi``) as soon
   as the build has ended; at TP 8, H 8192 also ``triton_symm`` with push off (``nopush``: the
   world-8 push kernel's register spill, docs/triton-symm.md); the multi-GPU FlashInfer tests once
   the build has ended;
3. ``bench-summary.md``: per (TP, H, quant, T) every backend's median, which backend auto ran,
   the fastest, auto against it, and the issue's targets.

``--dry-run``: the same logic on CPU (gloo, tiny shapes, Triton's interpreter, FlashInfer absent).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH_TOKENS = (1, 16, 128, 1024, 8192)
#: (H, quant) in the order they are worth measuring when time runs out.
CONFIGS = (
    (8192, "none"),
    (8192, "fp8_static"),
    (4096, "none"),
    (8192, "nvfp4"),
    (4096, "fp8_static"),
    (4096, "nvfp4"),
)
PARTS = {"symm": "triton_symm,triton", "fi": "flashinfer,auto", "nopush": "triton_symm"}
#: A timed job is not started with less than this many seconds left.
MIN_JOB_S = 40


# -- FlashInfer's module ----------------------------------------------------------------------------


def build_flashinfer() -> int:
    t0 = time.monotonic()
    try:
        import flashinfer.comm  # noqa: F401
    except ImportError as exc:
        print(f"flashinfer: not installed ({type(exc).__name__}: {exc})", flush=True)
        return 3
    import importlib

    import torch

    try:
        with torch.cuda.device(0):
            importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()
    except Exception as exc:
        print(f"flashinfer: failed after {time.monotonic() - t0:.0f} s ({type(exc).__name__}: {exc})")
        return 1
    print(f"flashinfer: built (or loaded) in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


def build_state(log: pathlib.Path, done: pathlib.Path) -> str | None:
    """``None`` while the build runs, else its last line (``flashinfer: built ...`` etc.)."""
    if not done.exists():
        return None
    lines = [
        ln for ln in (log.read_text().splitlines() if log.exists() else []) if ln.startswith("flashinfer:")
    ]
    return lines[-1] if lines else "flashinfer: failed (no result line; see fi-build.log)"


# -- the round ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    name: str
    cmd: list[str]
    gpus: int  # exclusive GPUs; 0: none reserved
    timeout: int
    after_build: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    log: str = ""


class Round:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts, self.out = opts, pathlib.Path(opts.out)
        self.deadline = opts.deadline or time.time() + opts.budget
        self.t0 = time.time()
        self.py = sys.executable
        self.summary = self.out / "summary.txt"

    def left(self) -> float:
        return self.deadline - time.time()

    def say(self, line: str) -> None:
        text = f"[{time.time() - self.t0:5.0f}s] {line}"
        print(text, flush=True)
        with self.summary.open("a") as f:
            f.write(text + "\n")

    def start(self, job: Job, gpu_ids: list[int] | None = None) -> subprocess.Popen[bytes]:
        env = dict(os.environ, **job.env)
        if gpu_ids is not None and not self.opts.dry_run:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
        job.log = str(self.out / f"{job.name}.txt")
        timeout = max(5, min(job.timeout, int(self.left()) - 5))
        f = open(job.log, "w")  # noqa: SIM115 (the child holds it)
        where = "all" if gpu_ids is None else gpu_ids
        f.write(f"$ {' '.join(job.cmd)}  (timeout {timeout} s, GPUs {where})\n")
        f.flush()
        proc = subprocess.Popen(
            ["timeout", str(timeout), *job.cmd], env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
        )
        f.close()
        return proc

    def finish(self, job: Job, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        text = pathlib.Path(job.log).read_text(errors="replace")
        with open(job.log, "a") as f:
            f.write(f"\nexit {code}\n")
        self.say(f"{job.name}: {describe(job.name, code, text)}")

    # -- functional steps (GPUs shared) ------------------------------------------------------------

    def functional(self) -> None:
        o, py = self.opts, self.py
        off = {"ARNORM_DISABLE": "flashinfer"}
        pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA"]
        tests = Job(
            "tests-multigpu",
            [*pytest, "-m", "multigpu", "tests", "--ignore=tests/arnorm_flashinfer"],
            0,
            170,
            env=off,
        )
        leak = Job(
            "tests-symm-leak",
            [*pytest, "-k", "close_frees", "tests/arnorm_triton/symm/test_symm_gpu.py"],
            0,
            80,
            env=off,
        )
        device = "cpu" if o.dry_run else "cuda"
        demo_env = {**off, "ARNORM_DISABLE": "flashinfer,triton"} if o.dry_run else off
        demo = [py, "-m", "arnorm", "demo", "--tp", "2", "--device", device, "--max-tokens", "4"]
        demos = [Job(f"demo-{m}", [*demo, "--model", m], 0, 120, env=demo_env) for m in ("llama", "gemma3")]
        faults = [py, "benchmarks/multi_gpu_faults.py", "--out", str(self.out), "--device", device]
        faults += (
            ["--stall", "5", "--bound", "35", "--pg-timeout", "15"]
            if o.dry_run
            else ["--stall", "15", "--bound", "45"]
        )
        fault = Job("faults-run", faults, 0, 160)  # faults.txt is the script's own
        pair = None if o.dry_run or o.gpus < 4 else [o.gpus - 2, o.gpus - 1]  # off the tests' first GPUs
        # Nothing here is timed, so it all shares the GPUs: the two test runs, the demos, then the
        # faults (their ranks' waits are bounded by polls, which sharing slows but does not break).
        running = [(tests, self.start(tests)), (leak, self.start(leak))]
        demo_procs = [(d, self.start(d, pair)) for d in demos]
        for d, p in demo_procs:
            self.finish(d, p)
        running.append((fault, self.start(fault, pair)))
        for j, p in running:
            self.finish(j, p)

    # -- timed steps (GPUs exclusive) --------------------------------------------------------------

    def bench_jobs(self) -> list[Job]:
        o = self.opts
        tps = [tp for tp in o.tps if tp <= o.gpus]
        configs = ([(256, "none"), (256, "nvfp4")] if o.dry_run else list(CONFIGS))[: o.max_configs]
        tokens = "1,4" if o.dry_run else ",".join(map(str, BENCH_TOKENS))
        extra = ["--device", "cpu", "--iters", "3", "--warmup", "1"] if o.dry_run else ["--device", "cuda"]
        jobs: list[Job] = []

        def bench(
            tp: int, h: int, quant: str, part: str, toks: str = tokens, env: dict[str, str] | None = None
        ) -> Job:
            name = f"bench-tp{tp}-h{h}-{quant}-{part}"
            cmd = [self.py, "-m", "arnorm", "bench", "--tp", str(tp), "--hidden", str(h), "--quant", quant]
            cmd += [
                "--tokens",
                toks,
                "--backends",
                PARTS[part],
                "--json",
                str(self.out / f"{name}.json"),
                *extra,
            ]
            cmd += ["--timeout", "150"]
            env = dict(env or {})
            if part != "fi":
                env["ARNORM_DISABLE"] = "flashinfer"
            return Job(name, cmd, tp, 160, after_build=part == "fi", env=env)

        for h, quant in configs:
            for tp in tps:
                jobs.append(bench(tp, h, quant, "symm"))
                if tp == 8 and (h, quant) == (8192, "none"):
                    jobs.append(
                        bench(8, h, quant, "nopush", "1,16", {"ARNORM_TRITON_SYMM_PUSH_MAX_TOKENS": "0"})
                    )
        fi_jobs = [bench(tp, h, q, "fi") for h, q in configs for tp in tps]
        fi_pytest = [self.py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "-m", "multigpu"]
        fi_tests = Job(
            "tests-multigpu-flashinfer", [*fi_pytest, "tests/arnorm_flashinfer"], 2, 150, after_build=True
        )
        # Several GPU pairs: the FlashInfer tests first, on a pair of their own. One pair: after
        # the numbers that have never been measured.
        fi_order = [fi_tests, *fi_jobs] if o.gpus >= 4 else [*fi_jobs, fi_tests]
        return jobs + fi_order

    def timed(self, build_log: pathlib.Path, build_done: pathlib.Path) -> None:
        queue = self.bench_jobs()
        n_gpus = 2 if self.opts.dry_run else self.opts.gpus
        free = set(range(n_gpus))
        running: list[tuple[Job, subprocess.Popen[bytes], list[int]]] = []
        state: str | None = None
        said_build = False
        while True:
            state = build_state(build_log, build_done)
            if state is not None and not said_build:
                said_build = True
                self.say(state)
                if state.startswith("flashinfer: failed"):  # the bench would build it again, for minutes
                    for j in queue:
                        if j.after_build:
                            j.env["ARNORM_DISABLE"] = "flashinfer"
            for item in list(running):
                job, proc, ids = item
                if proc.poll() is not None:
                    self.finish(job, proc)
                    running.remove(item)
                    free |= set(ids)
            if not queue and not running:
                break
            ready = [j for j in queue if not j.after_build or state is not None]
            # Once FlashInfer is ready its comparisons come first: they were never measured.
            ready.sort(key=lambda j: not j.after_build)
            # Strictly in order (no job overtakes one waiting for GPUs, so TP 8 is not starved).
            if ready and self.left() >= MIN_JOB_S:
                block = _block(free, ready[0].gpus, n_gpus)
                if block is not None:
                    free -= set(block)
                    queue.remove(ready[0])
                    running.append((ready[0], self.start(ready[0], block), block))
                    continue
            if not running and self.left() < MIN_JOB_S:
                break
            time.sleep(0.5)
        if state is None:
            self.say("flashinfer: still building at the deadline (its jobs were not run)")
        for job in queue:
            self.say(f"{job.name}: not run (out of time)")


def _block(free: set[int], k: int, n: int) -> list[int] | None:
    """The first aligned block of ``k`` free GPUs (``[]`` for ``k == 0``), or None."""
    if k == 0:
        return []
    for start in range(0, n - k + 1, k):
        ids = list(range(start, start + k))
        if free.issuperset(ids):
            return ids
    return None


def describe(name: str, code: int, text: str) -> str:
    """One summary line for a step from its exit status and output."""
    import re

    status = "timed out" if code in (124, 137) else f"exit {code}"
    if name.startswith("tests"):
        counts = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)
        return f"{', '.join(f'{n} {w}' for n, w in counts) or 'no result line'} ({status})"
    if name.startswith("demo"):
        lines = [
            ln
            for ln in text.splitlines()
            if ln.startswith(("logits:", "no less", "logits within", "arnorm demo"))
        ]
        return f"{' | '.join(lines)[:400] or 'no result'} ({status})"
    if name.startswith("faults"):
        return f"{' | '.join(ln for ln in text.splitlines() if ln.startswith('fault '))[:600]} ({status})"
    if name.startswith("bench"):
        nt = [ln for ln in text.splitlines() if ln.startswith(("not timed:", "auto mode picks:"))]
        return f"{' | '.join(nt)[:400]} ({status})"
    return status


# -- the merged table --------------------------------------------------------------------------------


def summarize(out: pathlib.Path) -> str:
    """Every bench JSON in ``out`` merged: one row per (TP, H, quant, T); markdown."""
    points: dict[tuple[int, int, str, int], dict[str, Any]] = {}
    notes: list[str] = []
    for path in sorted(out.glob("bench-tp*.json")):
        rep = json.loads(path.read_text())
        part = path.stem.rsplit("-", 1)[1]
        for r in rep["results"]:
            key = (rep["tp"], rep["hidden"], rep["quant"] or "none", r["tokens"])
            cell = points.setdefault(key, {})
            name = (
                r["backend"] if part != "nopush" or r["backend"] == "baseline" else "triton_symm (push off)"
            )
            if r["median_us"] is not None and (
                name != "baseline" or part == "symm" or "baseline" not in cell
            ):
                cell[name] = r["median_us"]
            if "picked" in r:
                cell["auto ran"] = r["picked"] or "-"
        for name, why in rep["rejected"].items():
            notes.append(f"TP {rep['tp']} H {rep['hidden']} {rep['quant'] or 'none'}: {name} not timed "
                         f"({why['status']}): {'; '.join(why['reasons'])}")  # fmt: skip
    cols = ["baseline", "triton_symm", "triton", "flashinfer", "auto", "triton_symm (push off)"]
    head = ["TP", "H", "quant", "T", *cols, "auto ran", "fastest", "auto / fastest"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * 4 + "---:|" * len(cols) + "---|---|---:|"]
    misses = []
    for key in sorted(points):
        cell = points[key]
        named: dict[str, float] = {k: cell[k] for k in ("triton_symm", "triton", "flashinfer") if k in cell}
        best = min(named, key=named.__getitem__) if named else None
        ratio = cell["auto"] / named[best] if best and "auto" in cell else None
        if ratio is not None and ratio > 1.03:
            misses.append(f"TP {key[0]} H {key[1]} {key[2]} T {key[3]}: auto {ratio:.3f}x of {best}")
        row = [*map(str, key), *(f"{cell[c]:.2f}" if c in cell else "-" for c in cols)]
        row += [cell.get("auto ran", "-"), best or "-", f"{ratio:.3f}" if ratio else "-"]
        lines.append("| " + " | ".join(row) + " |")
    target = points.get((2, 8192, "none", 1), {}).get("triton_symm")
    lines += ["", "Targets (issue 38):"]
    lines.append(f"- TP 2, T 1, H 8192, none: triton_symm {target:.2f} us (target <= 4.5)" if target else
                 "- TP 2, T 1, H 8192, none: not measured")  # fmt: skip
    vs = [
        f"TP {k[0]} H {k[1]} {k[2]} T {k[3]}: {c['triton_symm'] / c['flashinfer']:.2f}x"
        for k, c in sorted(points.items())
        if k[3] <= 128 and "triton_symm" in c and "flashinfer" in c
    ]
    lines.append(
        "- triton_symm / flashinfer at T <= 128 (target <= 1.10): " + ("; ".join(vs) or "not measured")
    )
    lines.append("- auto within 3% of the fastest: " + ("; ".join(misses) or "every measured point" if any(
        "auto" in c for c in points.values()) else "not measured"))  # fmt: skip
    spill = {t: points.get((8, 8192, "none", t), {}) for t in (1, 16)}
    if any("triton_symm" in c and "triton_symm (push off)" in c for c in spill.values()):
        read = "; ".join(
            f"T {t}: push {c['triton_symm']:.2f} us, flags {c['triton_symm (push off)']:.2f} us"
            for t, c in spill.items()
            if "triton_symm" in c and "triton_symm (push off)" in c
        )
        lines.append(
            f"- world-8 push kernel (spills 368 B at H 8192): {read} (push no slower: the spill is harmless)"
        )
    else:
        lines.append(
            "- world-8 push kernel's spill: not measured (needs 8 GPUs: TP 8 H 8192 push on and off)"
        )
    return "\n".join([*lines, "", *notes]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=("build-flashinfer", "run", "summarize"))
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/out")
    p.add_argument("--gpus", type=int, default=2, help="GPUs present (nvidia-smi -L | wc -l)")
    p.add_argument("--tps", default="2,4,8", help="TP sizes, those up to --gpus run")
    p.add_argument("--budget", type=float, default=540, help="seconds, when --deadline is not given")
    p.add_argument("--deadline", type=float, default=None, help="epoch seconds by which every step ends")
    p.add_argument("--build-log", default=None)
    p.add_argument("--build-done", default=None)
    p.add_argument("--steps", default="functional,timed", help="comma list: functional, timed")
    p.add_argument("--max-configs", type=int, default=None, help="only the first N (H, quant) of the order")
    p.add_argument("--dry-run", action="store_true")
    opts = p.parse_args(argv)
    opts.tps = [int(t) for t in opts.tps.split(",") if t.strip()]
    if opts.step == "build-flashinfer":
        return build_flashinfer()
    out = pathlib.Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if opts.step == "run":
        rnd = Round(opts)
        steps = set(opts.steps.split(","))
        if "functional" in steps:
            rnd.functional()
        if "timed" in steps:
            log = pathlib.Path(opts.build_log or out / "fi-build.log")
            rnd.timed(log, pathlib.Path(opts.build_done or str(log) + ".done"))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = summarize(out)
    hw = out / "hardware.txt"
    machine = "".join(f"    {ln}\n" for ln in hw.read_text().splitlines()[:9]) if hw.exists() else ""
    (out / "bench-summary.md").write_text(f"# arnorm bench on several GPUs, {stamp}\n\n{machine}\n{text}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
