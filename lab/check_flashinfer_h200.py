"""What the flashinfer backend can show on one GPU: import, probe, the TP 1 rejection, the comm JIT build.

A single GPU cannot run the fused all-reduce (it needs 2+ ranks with peer access), so this checks
everything up to it:

1. environment: torch, CUDA device, compute capability, the FlashInfer knobs in the environment;
2. ``import flashinfer.comm`` (timed), its version, whether it has the MXFP8 fusion patterns;
3. ``FlashInferBackend.probe`` on this device's architecture for eligible and rejected problems
   (nvfp4 on SM90, fp32 with nvfp4, world sizes 1 and 3), each reason in arnorm's grammar;
4. the rejection at TP 1 through arnorm's selection (``AllReduceNorm`` without a group), auto
   and strict (``backend="flashinfer"``), with ``explain()``;
5. the JIT build of FlashInfer's ``trtllm_comm`` module (``trtllm_ar.get_trtllm_comm_module()``,
   timed: minutes on a cold cache);
6. (``--two-procs``, default on) two processes sharing this GPU over gloo: arnorm's setup must
   refuse identically on both ranks ("share GPU") without hanging; then FlashInfer's own
   ``create_allreduce_fusion_workspace(backend="trtllm")`` and one fused call are tried directly,
   under a watchdog, to learn whether its IPC path works on one device.

Writes ``flashinfer-h200-check.md`` and ``.json`` to ``--out`` (default ``benchmarks/results``)
and to ``$OUT`` when that is set. Run from the repository root (``PYTHONPATH`` must reach
``arnorm``, FlashInfer and pydantic)::

    python lab/check_flashinfer_h200.py [--skip-jit] [--no-two-procs] [--deadline 560]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time
import traceback
from typing import Any

START = time.monotonic()
REPORT: dict[str, Any] = {"steps": {}}


def step(name: str):
    """Run a check, record its result or its exception and its duration; never raise."""

    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.monotonic()
            try:
                result = fn(*args, **kwargs)
                entry = {"ok": True, "result": result}
            except BaseException as exc:  # the report must survive any failure, even SystemExit
                entry = {
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc(),
                }
            entry["seconds"] = round(time.monotonic() - t0, 2)
            REPORT["steps"][name] = entry
            print(
                f"[{time.monotonic() - START:7.1f}s] {name}: {'ok' if entry['ok'] else entry['error']}",
                flush=True,
            )
            return entry

        return run

    return wrap


@step("environment")
def environment() -> dict[str, Any]:
    import torch

    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("FLASHINFER_", "ARNORM_", "CUDA_")) or k == "MAX_JOBS"
    }
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "env": env}
    out["cuda"] = torch.version.cuda
    out["devices"] = torch.cuda.device_count()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(
            name=props.name,
            capability=list(torch.cuda.get_device_capability(0)),
            sms=props.multi_processor_count,
        )
        out["memory_gib"] = round(props.total_memory / 2**30, 1)
    return out


@step("import flashinfer.comm")
def import_flashinfer() -> dict[str, Any]:
    t0 = time.monotonic()
    import flashinfer
    import flashinfer.comm as fc

    return {
        "version": getattr(flashinfer, "__version__", "?"),
        "path": os.path.dirname(flashinfer.__file__),
        "import_seconds": round(time.monotonic() - t0, 2),
        "mxfp8_patterns": hasattr(fc.AllReduceFusionPattern, "kARResidualRMSNormMXFP8Quant"),
    }


def _problem(arch, **kw):
    from arnorm._problem import Problem

    fields = dict(
        world_size=2,
        hidden_size=4096,
        dtype="bfloat16",
        eps=1e-6,
        weight_offset=0.0,
        quant=None,
        scale_layout=None,
        max_tokens=8192,
        normed_output=True,
        inplace=True,
        device_type="cuda",
        platform="cuda",
        arch=arch,
    )
    fields.update(kw)
    return Problem(**fields)


@step("probe")
def probe() -> dict[str, Any]:
    import torch

    from arnorm.registry._capabilities import check_capabilities
    from arnorm_flashinfer._backend import FlashInferBackend
    from arnorm_flashinfer._plugin import CAPABILITIES

    arch = tuple(torch.cuda.get_device_capability(0))
    cases = {
        "tp2 bf16": {},
        "tp2 fp8_static": {"quant": "fp8_static"},
        "tp2 fp8_per_token fp16": {"quant": "fp8_per_token", "dtype": "float16"},
        "tp2 mxfp8 linear": {"quant": "mxfp8", "scale_layout": "linear"},
        "tp2 nvfp4 swizzled": {"quant": "nvfp4", "scale_layout": "swizzled_128x4"},
        "tp2 nvfp4 fp32": {"quant": "nvfp4", "scale_layout": "linear", "dtype": "float32"},
        "tp8 fp32": {"world_size": 8, "dtype": "float32"},
        "tp1": {"world_size": 1},
        "tp3": {"world_size": 3},
        "tp2 hidden 8200": {"hidden_size": 8200},
    }
    out = {}
    for name, kw in cases.items():
        problem = _problem(arch, **kw)
        t0 = time.monotonic()
        out[name] = {
            "static": list(check_capabilities(CAPABILITIES, problem)),
            "probe": list(FlashInferBackend.probe(problem)),
            "probe_ms": round((time.monotonic() - t0) * 1e3, 1),
        }
    return out


def _use_registry() -> None:
    from arnorm.registry import _builtin
    from arnorm.registry._discovery import Registry, reset_registry
    from arnorm_flashinfer import _plugin

    registry = Registry()  # explicit: a source tree on PYTHONPATH has no entry points installed
    registry.add_from_hook("arnorm", _builtin.arnorm_backends)
    registry.add_from_hook("flashinfer", _plugin.arnorm_backends)
    reset_registry(registry)


@step("selection at tp 1")
def selection_tp1() -> dict[str, Any]:
    import torch

    import arnorm

    _use_registry()
    dev = torch.device("cuda", 0)
    out: dict[str, Any] = {}
    with arnorm.AllReduceNorm(hidden_size=4096, dtype=torch.bfloat16, quant="fp8_static", device=dev) as op:
        out["auto_backend"] = op.backend
        out["explain"] = str(op.explain())
        out["flashinfer_reasons"] = list(op.explain().rejections().get("flashinfer", ()))
        x = torch.randn(4, 4096, dtype=torch.bfloat16, device=dev)
        r, w = torch.randn_like(x), torch.ones(4096, dtype=torch.bfloat16, device=dev)
        q = op(x, r, w, torch.tensor([0.05], device=dev)).quant
        out["call"] = f"{tuple(q.data.shape)} {q.data.dtype}"
    try:
        arnorm.AllReduceNorm(hidden_size=4096, dtype=torch.bfloat16, device=dev, backend="flashinfer")
        out["strict"] = "no error (unexpected)"
    except arnorm.ArnormError as exc:
        out["strict"] = f"{type(exc).__name__}: {exc}"
    return out


@step("jit build trtllm_comm")
def jit_build() -> dict[str, Any]:
    import importlib

    import torch

    t0 = time.monotonic()
    with torch.cuda.device(0):
        importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()
    seconds = round(time.monotonic() - t0, 1)
    out: dict[str, Any] = {"build_or_load_seconds": seconds}
    try:
        from flashinfer.jit import env as jit_env

        out["jit_dir"] = str(jit_env.FLASHINFER_JIT_DIR)
    except Exception as exc:  # the path is informational only
        out["jit_dir"] = f"unknown ({type(exc).__name__})"
    return out


# -- two processes on one GPU --------------------------------------------------------------------


def _child(rank: int, port: int, queue: Any) -> None:
    result: dict[str, Any] = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        import arnorm

        _use_registry()
        dev = torch.device("cuda", 0)
        try:
            arnorm.AllReduceNorm(
                hidden_size=4096, dtype=torch.bfloat16, device=dev, backend="flashinfer", max_tokens=64
            )
            result["arnorm"] = "built (unexpected on one GPU)"
        except arnorm.ArnormError as exc:
            result["arnorm"] = f"{type(exc).__name__}: {exc}"
        queue.put(dict(result, stage="arnorm"))
        import flashinfer.comm as fc
        from flashinfer.comm.mnnvl import TorchDistBackend

        ws = fc.create_allreduce_fusion_workspace(
            backend="trtllm",
            world_size=2,
            rank=rank,
            max_token_num=64,
            hidden_dim=4096,
            dtype=torch.bfloat16,
            comm_backend=TorchDistBackend(group=dist.group.WORLD),
            group=dist.group.WORLD,
        )
        result["workspace"] = f"created ({type(ws).__name__})"
        queue.put(dict(result, stage="workspace"))
        g = torch.Generator().manual_seed(0)
        parts = [torch.randn(8, 4096, generator=g).to(torch.bfloat16) for _ in range(2)]
        res = torch.randn(8, 4096, generator=g).to(torch.bfloat16)
        x, r = parts[rank].to(dev), res.to(dev)
        w = torch.ones(4096, dtype=torch.bfloat16, device=dev)
        norm = torch.empty_like(x)
        fc.allreduce_fusion(
            input=x,
            workspace=ws,
            pattern=fc.AllReduceFusionPattern.kARResidualRMSNorm,
            launch_with_pdl=False,
            output=x,
            residual_out=x,
            norm_out=norm,
            residual_in=r,
            rms_gamma=w,
            rms_eps=1e-6,
            use_oneshot=True,
            fp32_acc=True,
        )
        torch.cuda.synchronize()
        expect = ((parts[0].float() + parts[1].float()).to(torch.bfloat16).float() + res.float()).to(
            torch.bfloat16
        )
        result["fused_call_residual_bitwise"] = bool(torch.equal(x.cpu(), expect))
        ws.destroy()
        dist.barrier()
        dist.destroy_process_group()
        queue.put(dict(result, stage="done"))
    except BaseException as exc:  # report, never hang the parent
        queue.put(
            dict(result, stage="error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        )


@step("two processes on one GPU")
def two_procs(timeout: float) -> dict[str, Any]:
    import multiprocessing as mp
    import queue as queue_mod

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, store.port, q)) for r in range(2)]
    for p in procs:
        p.start()
    last: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(
        last.get(r, {}).get("stage") in ("done", "error") for r in (0, 1)
    ):
        try:
            item = q.get(timeout=1.0)
            last[item["rank"]] = item
        except queue_mod.Empty:
            pass
    hung = [r for r in (0, 1) if last.get(r, {}).get("stage") not in ("done", "error")]
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    messages = {last.get(r, {}).get("arnorm") for r in (0, 1)}
    return {
        "ranks": last,
        "hung_after_stage": {r: last.get(r, {}).get("stage", "start") for r in hung},
        "arnorm_same_error_on_both": len(messages) == 1 and None not in messages,
    }


def write(out_dirs: list[pathlib.Path]) -> None:
    REPORT["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    REPORT["total_seconds"] = round(time.monotonic() - START, 1)
    lines = [f"# flashinfer backend on one GPU ({REPORT['date']})", ""]
    for name, entry in REPORT["steps"].items():
        status = "ok" if entry["ok"] else "FAILED"
        lines += [f"## {name}: {status} ({entry['seconds']} s)", "", "```"]
        body = entry["result"] if entry["ok"] else entry["error"] + "\n" + entry["trace"]
        lines += [body if isinstance(body, str) else json.dumps(body, indent=2, default=str), "```", ""]
    text = "\n".join(lines)
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / "flashinfer-h200-check.md").write_text(text)
        (d / "flashinfer-h200-check.json").write_text(json.dumps(REPORT, indent=2, default=str))
        print(f"wrote {d / 'flashinfer-h200-check.md'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="report directory")
    parser.add_argument("--skip-jit", action="store_true", help="do not build the trtllm_comm JIT module")
    parser.add_argument("--no-two-procs", action="store_true", help="skip the two-process experiment")
    parser.add_argument(
        "--deadline", type=float, default=560.0, help="seconds after which optional steps are skipped"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    environment()
    imported = import_flashinfer()
    probe()
    selection_tp1()
    if imported["ok"] and not args.skip_jit:
        jit_build()
    left = args.deadline - (time.monotonic() - START)
    if not args.no_two_procs and imported["ok"]:
        if left > 60:
            two_procs(timeout=min(left - 15, 180))
        else:
            REPORT["steps"]["two processes on one GPU"] = {
                "ok": False,
                "error": "skipped: deadline",
                "trace": "",
                "seconds": 0,
            }
    dirs = [pathlib.Path(args.out)]
    if os.environ.get("OUT"):
        dirs.append(pathlib.Path(os.environ["OUT"]))
    write(dirs)
    return 0 if all(e["ok"] for e in REPORT["steps"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
