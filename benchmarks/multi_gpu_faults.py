"""Faults on real links: two ranks on two GPUs (NCCL + symmetric memory, ``triton_symm``), one of
them killed mid-call or stalled, and what the other saw, within a bound.

Scenarios (each a fresh pair of processes, rank r on GPU r):

- ``kill``: after three good calls, rank 1 launches a fourth and exits at once (``os._exit``, its
  kernel in flight on a GPU; on CPU it dies before its collective). Rank 0 goes on calling.
- ``stall``: after three good calls, rank 1 sleeps ``--stall`` seconds before its fourth call.
- ``stall_build``: rank 1 sleeps ``--stall`` seconds before building the op. Needs the peer-timeout
  setting of the fault-integrity work (a ``Config`` field named ``*peer*timeout*``, set through its
  ``ARNORM_`` variable); without it the scenario is skipped, saying so.

Rank 0 records every call: returned (and whether its residual output is right: every partial is
seeded by rank, so rank 0 knows the sum), raised (type, message, seconds since the fault), and,
for ``triton_symm``, what ``check()`` (the spin-limit word, docs/triton-symm.md "Bounded waits")
says afterwards. A rank still running at ``--bound`` seconds is killed and reported as unbounded.
The worst outcome, a wrong result with no error anywhere, is reported as ``SILENTLY WRONG``.

From the repository root (``PYTHONPATH`` reaching ``arnorm``)::

    python benchmarks/multi_gpu_faults.py --out "$OUT"              # two GPUs: nccl, triton_symm
    python benchmarks/multi_gpu_faults.py --device cpu --bound 40    # CPU dry run: gloo, reference

Exit status 0: every scenario ended within its bound with no silent wrong result; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any

SCENARIOS = ("kill", "stall", "stall_build")
GOOD_CALLS = 3
AFTER_CALLS = 3
HIDDEN, TOKENS = 1024, 4


def peer_timeout_setting() -> tuple[str | None, str]:
    """``(environment variable, why)`` of the peer-timeout setting, read from ``arnorm.Config``'s
    fields (its final name is not fixed yet); ``(None, reason)`` where this arnorm has none."""
    import arnorm

    fields = list(getattr(arnorm.Config, "model_fields", {}))
    found = [f for f in fields if "peer" in f and "timeout" in f]
    if not found:
        return None, (
            "arnorm.Config: no peer-timeout field (needs the fault-integrity work's bounded waits, "
            f"e.g. peer_timeout / ARNORM_PEER_TIMEOUT; fields here: {', '.join(fields)})"
        )
    return f"ARNORM_{found[0].upper()}", f"Config.{found[0]}"


# -- one rank -------------------------------------------------------------------------------------


class Log:
    """Events appended to a JSON file after each one, so a rank killed later still leaves them."""

    def __init__(self, path: str) -> None:
        self.path, self.t0 = path, time.monotonic()
        self.events: list[dict[str, Any]] = []

    def add(self, **event: Any) -> None:
        event["t_s"] = round(time.monotonic() - self.t0, 3)
        self.events.append(event)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.events, f)
        os.replace(tmp, self.path)


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)[:400]}


def rank_main(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import arnorm
    from arnorm.plugin import add_rmsnorm

    rank, world, cuda = args.rank, 2, args.device == "cuda"
    log = Log(args.log)
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=args.pg_timeout),
    )
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def partial_of(r: int) -> Any:
        g = torch.Generator().manual_seed(100 + r)
        return torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)

    residual = (torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7)) * 0.5).to(
        torch.bfloat16
    )
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16)
    total = sum((partial_of(r).float() for r in range(world)), torch.zeros(TOKENS, HIDDEN))
    want_h, _ = add_rmsnorm(total.to(torch.bfloat16), residual, weight, 1e-6, 0.0)
    mine = partial_of(rank).to(device)
    residual, weight = residual.to(device), weight.to(device)

    def call(i: int) -> None:
        res = residual.clone()
        out = op(mine.clone(), res, weight, None)
        sync()
        got = out.residual if out.residual is not None else res
        right = torch.allclose(got.float().cpu(), want_h.float(), rtol=2e-2, atol=2e-2)
        log.add(call=i, outcome="returned", right=bool(right))

    def check() -> None:
        impl = getattr(op, "_chain", [None])[0]  # the strict backend's instance (introspection)
        if not hasattr(impl, "check"):
            return
        try:
            impl.check()
            log.add(check="clean")
        except BaseException as exc:
            log.add(check="raised", **_error(exc))

    if args.scenario == "stall_build" and rank == 1:
        time.sleep(args.stall)
    log.add(phase="build")
    try:
        op = arnorm.AllReduceNorm(
            dist.group.WORLD,
            hidden_size=HIDDEN,
            dtype=torch.bfloat16,
            norm=arnorm.RMSNorm(1e-6),
            max_tokens=TOKENS,
            device=device,
            backend=args.backend,
        )
    except BaseException as exc:
        log.add(phase="build failed", **_error(exc))
        os._exit(0)
    log.add(phase="built", backend=op.backend_for(TOKENS))
    for i in range(GOOD_CALLS if args.scenario != "stall_build" else 1):
        call(i)
    if rank == 1 and args.scenario == "kill":
        log.add(phase="exiting mid-call")
        if cuda:  # the kernel is queued, maybe running: the process dies under it
            op(mine.clone(), residual.clone(), weight, None)
        os._exit(9)
    if rank == 1 and args.scenario == "stall":
        time.sleep(args.stall)
    log.add(phase="fault")
    for i in range(GOOD_CALLS, GOOD_CALLS + AFTER_CALLS):
        try:
            call(i)
        except BaseException as exc:
            log.add(call=i, outcome="raised", **_error(exc))
            break
    check()
    log.add(phase="done")
    os._exit(0)  # no process-group teardown: it may wait on a dead peer


# -- the parent ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def judge(scenario: str, events: list[dict[str, Any]], finished: bool, bound: float) -> tuple[str, str]:
    """``(verdict, one line)`` from rank 0's events after the fault: ``ok`` (it ended within the
    bound with no silent wrong result), ``SILENTLY WRONG`` (a wrong result and no error anywhere),
    ``UNBOUNDED`` (still running at the bound)."""
    marker = "build" if scenario == "stall_build" else "fault"
    start = next((i for i, e in enumerate(events) if e.get("phase") == marker), len(events))
    fault = events[start]["t_s"] if start < len(events) else 0.0
    after = [e for e in events[start + 1 :] if e.get("phase") != "done"]
    raised = [e for e in after if e.get("outcome") == "raised" or e.get("check") == "raised" or "error" in e]
    wrong = [e for e in after if e.get("outcome") == "returned" and not e.get("right")]
    seen = "; ".join(
        f"{'call ' + str(e['call']) if 'call' in e else e.get('phase') or 'check'}"
        + (": " if "phase" not in e or "error" in e else "")
        + (f"{e['error']}: {e['message'][:160]}" if "error" in e else e.get("outcome") or e.get("check", ""))
        + ("" if e.get("right", True) else " (WRONG result)")
        + f" at +{e['t_s'] - fault:.1f} s"
        for e in after
    )
    failed = next((e for e in events if e.get("phase") == "build failed"), None)
    if scenario != "stall_build" and failed is not None:
        return "NOT RUN", f"the op was not built: {failed['error']}: {failed['message'][:300]}"
    if not finished:
        return "UNBOUNDED", f"rank 0 still running after {bound:g} s (killed); saw: {seen or 'nothing'}"
    if wrong and not raised:
        return "SILENTLY WRONG", seen
    return "ok", seen or "nothing after the fault"


def run_scenario(
    name: str, opts: argparse.Namespace, env: dict[str, str], folder: pathlib.Path
) -> dict[str, Any]:
    port = _free_port()
    logs = [str(folder / f"faults-{name}-rank{r}.json") for r in range(2)]
    procs = []
    for r in range(2):
        cmd = [sys.executable, __file__, "--rank", str(r), "--port", str(port), "--scenario", name]
        cmd += ["--log", logs[r], "--device", opts.device, "--backend", opts.backend]
        cmd += ["--stall", str(opts.stall), "--pg-timeout", str(opts.pg_timeout)]
        out = open(folder / f"faults-{name}-rank{r}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT), out))
    t0 = time.monotonic()
    while time.monotonic() - t0 < opts.bound and procs[0][0].poll() is None:
        time.sleep(0.2)
    finished = procs[0][0].poll() is not None
    for p, out in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        out.close()
    events = json.loads(pathlib.Path(logs[0]).read_text()) if os.path.exists(logs[0]) else []
    verdict, line = judge(name, events, finished, opts.bound)
    return {"scenario": name, "verdict": verdict, "seen": line, "seconds": round(time.monotonic() - t0, 1),
            "rank0_exit": procs[0][0].returncode, "rank0_events": events}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--backend", default=None, help="strict backend (default: triton_symm on cuda, reference on cpu)"
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--stall", type=float, default=20.0, help="seconds a stalled rank sleeps (default 20)")
    p.add_argument(
        "--bound", type=float, default=60.0, help="seconds rank 0 may take per scenario (default 60)"
    )
    p.add_argument(
        "--peer-timeout", type=float, default=5.0, help="the peer-timeout setting, when arnorm has one"
    )
    p.add_argument(
        "--spin-limit", type=int, default=1 << 20, help="ARNORM_TRITON_SYMM_SPIN_LIMIT (default 2**20)"
    )
    p.add_argument("--pg-timeout", type=float, default=30.0, help="the process group's own timeout, seconds")
    p.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for faults.json / faults.txt")
    # One rank (internal).
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--scenario", default="kill", help=argparse.SUPPRESS)
    p.add_argument("--log", default="", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    opts.backend = opts.backend or ("triton_symm" if opts.device == "cuda" else "reference")
    if opts.rank is not None:
        rank_main(opts)
        return 0
    folder = pathlib.Path(opts.out)
    folder.mkdir(parents=True, exist_ok=True)
    var, why = peer_timeout_setting()
    env = dict(os.environ, ARNORM_TRITON_SYMM_SPIN_LIMIT=str(opts.spin_limit), PYTHONUNBUFFERED="1")
    if var:
        env[var] = f"{opts.peer_timeout:g}"
    head = (
        f"faults: 2 ranks, {opts.device} ({'nccl' if opts.device == 'cuda' else 'gloo'}), "
        f"backend {opts.backend}, "
        f"H {HIDDEN} T {TOKENS} bf16, stall {opts.stall:g} s, bound {opts.bound:g} s per scenario, "
        f"ARNORM_TRITON_SYMM_SPIN_LIMIT={opts.spin_limit}, "
        + (f"{var}={opts.peer_timeout:g} ({why})" if var else f"no peer timeout: {why}")
    )
    lines, results = [head], []
    for name in [s.strip() for s in opts.scenarios.split(",") if s.strip()]:
        if name not in SCENARIOS:
            print(f"--scenarios: {name!r} (needs one of {', '.join(SCENARIOS)})", file=sys.stderr)
            return 2
        if name == "stall_build" and var is None:
            results.append({"scenario": name, "verdict": "skipped", "seen": why})
        else:
            results.append(run_scenario(name, opts, env, folder))
        r = results[-1]
        lines.append(
            f"fault {name}: {r['verdict']}"
            + (f" in {r['seconds']} s" if "seconds" in r else "")
            + f"; {r['seen']}"
        )
        print(lines[-1], flush=True)
    (folder / "faults.json").write_text(json.dumps({"head": head, "results": results}, indent=1))
    (folder / "faults.txt").write_text("\n".join(lines) + "\n")
    print(head)
    return 0 if all(r["verdict"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
