"""What ptxas makes of ``triton``'s fused kernel, without a GPU: instructions, barriers, registers.

Compiles ``fused_add_rmsnorm_quant_kernel`` of a kernel module (``arnorm_triton/_kernels.py`` or a
copy, as lab/lab_kernel_variants.py takes them) for an NVIDIA target with the Triton that is
importable (its bundled ``ptxas`` and ``cuobjdump``), as the triton backend specializes it (bf16,
16-byte aligned pointers and strides, PDL on), and counts the SASS of each configuration:

    python lab/sass_census.py [--kernels PATH] [--hidden 4096,8192] [--warps 8,16,32]
        [--quant none,fp8_static,nvfp4] [--normed 0,1] [--arch 90]
    python lab/sass_census.py --symm 1,2,4,8 [--hidden ...] [--quant ...]

``--symm WORLDS`` counts ``triton_symm``'s kernel instead (the ``arnorm_triton`` importable, at each
world size, with the warps its launcher takes for the row and the normed output), adding the
stack bytes per thread (ptxas' spills: nonzero means registers ran out).

A barrier (``BAR``) is a whole program waiting; at decode sizes each is on the critical path, so
this is a quick screen of a kernel edit or a warp count before a GPU run measures it. Counts differ
between Triton versions (the H200 machine has 3.6: ``pip download triton==3.6.0 --no-deps`` and
put it first on ``PYTHONPATH`` to see what runs there).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from typing import Any

from lab_kernel_variants import load_variant


def _count(compiled: Any) -> dict[str, int]:
    """Instructions, barriers, shuffles, registers and stack bytes of a compiled kernel."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump = os.path.join(tools, "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True)
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True)
    lines = [ln for ln in sass.stdout.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    regs = re.search(r"REG:(\d+)", res.stdout)
    stack = re.search(r"STACK:(\d+)", res.stdout)
    return {
        "instructions": len(lines),
        "BAR": sum(" BAR." in ln for ln in lines),
        "SHFL": sum(" SHFL." in ln for ln in lines),
        "registers": int(regs.group(1)) if regs else -1,
        "stack": int(stack.group(1)) if stack else -1,
    }


def symm_census(world: int, hidden: int, quant: str, arch: int) -> dict[str, int]:
    """:func:`census` of ``triton_symm``'s kernel as its launcher binds it (bf16, normed output,
    swizzled scales, 132 slots, synchronizing, PDL), at its default warps for the row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import arnorm_triton._kernels as K
    import arnorm_triton.symm._kernels as S
    from arnorm_triton._launch_table import default_num_warps

    fmt = None if quant == "none" else quant
    block, group, vec = K.row_shape(hidden, fmt, 2)
    const = {
        "HIDDEN": hidden, "BLOCK": block, "GROUP": group, "VEC": vec, "QUANT": K.QUANT_CODES[fmt],
        "SWIZZLED": fmt in ("nvfp4", "mxfp8"), "WRITE_NORMED": True, "ROUND_BEFORE_WEIGHT": False,
        "SOFT": False, "SOFT_FP8": False, "WORLD": world, "SLOTS": 132 // world * world, "SYNC": True,
        "STAGE": 0, "USE_PDL": arch >= 90,
    }  # fmt: skip
    fn = S.symm_allreduce_norm_kernel
    types = {"scale_ptr": "*fp32", "q_ptr": "*u8", "sf_ptr": "*u8", "peers_ptr": "*i64", "epochs_ptr": "*i32",
             "err_ptr": "*i32"}  # fmt: skip
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = types.get(name, "*bf16")
        elif name in ("eps", "weight_offset"):
            sig[name] = "fp32"
        else:  # addresses are 64-bit integers; the rest 32-bit
            sig[name] = "i64" if name == "my_base" or re.fullmatch(r"peer\d", name) else "i32"
    aligned = [
        i for i, n in enumerate(fn.arg_names) if (n.endswith("_ptr") and n != "scale_ptr") or "stride" in n
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    compiled = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": default_num_warps(block)})  # fmt: skip
    return {"warps": default_num_warps(block), **_count(compiled)}


def census(kernels: Any, hidden: int, quant: str, normed: bool, warps: int, arch: int) -> dict[str, int]:
    """``{"instructions", "BAR", "SHFL", "registers"}`` of one compiled configuration."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from arnorm.plugin import RMSNorm
    from arnorm_triton._launch import FusedLauncher

    fn = kernels.fused_add_rmsnorm_quant_kernel
    # The constexprs exactly as the backend's launcher binds them (bf16, TP 1, swizzled scales).
    const = FusedLauncher(
        hidden=hidden, itemsize=2, quant=None if quant == "none" else quant, layout="swizzled_128x4",
        write_normed=normed, num_partials=1, norm=RMSNorm(), soft=False, soft_fp8=False,
        pdl=arch >= 90,
    ).constexprs  # fmt: skip
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = {"scale_ptr": "*fp32", "q_ptr": "*u8", "sf_ptr": "*u8"}.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in ("eps", "weight_offset") else "i32"
    names = fn.arg_names
    aligned = [i for i, n in enumerate(names) if (n.endswith("_ptr") and n != "scale_ptr") or "stride" in n]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    compiled = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps})  # fmt: skip
    return _count(compiled)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--kernels", default=os.path.join(here, "..", "arnorm_triton", "_kernels.py"))
    p.add_argument("--hidden", default="4096,8192")
    p.add_argument("--warps", default="8,16,32")
    p.add_argument("--quant", default="none,fp8_static,nvfp4")
    p.add_argument("--normed", default="1,0")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--symm", default="", help="comma-separated world sizes: count triton_symm's kernel")
    args = p.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret
    import triton

    if args.symm:
        print(f"Triton {triton.__version__}, sm_{args.arch}, triton_symm\n")
        print("| world | H | format | warps | instructions | BAR | SHFL | registers | stack bytes |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
        for world in (int(x) for x in args.symm.split(",")):
            for h in (int(x) for x in args.hidden.split(",")):
                for quant in args.quant.split(","):
                    c = symm_census(world, h, quant, args.arch)
                    counts = " | ".join(
                        str(c[k]) for k in ("warps", "instructions", "BAR", "SHFL", "registers", "stack")
                    )
                    print(f"| {world} | {h} | {quant} | {counts} |", flush=True)
        return

    kernels = load_variant("census", args.kernels)
    print(f"Triton {triton.__version__}, sm_{args.arch}, {args.kernels}\n")
    print("| H | format | normed | warps | instructions | BAR | SHFL | registers |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for h in (int(x) for x in args.hidden.split(",")):
        for quant in args.quant.split(","):
            for normed in (bool(int(x)) for x in args.normed.split(",")):
                if quant == "none" and not normed:
                    continue
                for warps in (int(x) for x in args.warps.split(",")):
                    c = census(kernels, h, quant, normed, warps, args.arch)
                    counts = " | ".join(str(c[k]) for k in ("instructions", "BAR", "SHFL", "registers"))
                    print(f"| {h} | {quant} | {'yes' if normed else 'no'} | {warps} | {counts} |", flush=True)


if __name__ == "__main__":
    main()
