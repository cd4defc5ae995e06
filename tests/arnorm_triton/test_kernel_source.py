"""What the Triton interpreter runs but the compiler refuses, caught on CPU.

CI runs the kernels under ``TRITON_INTERPRET=1``, which executes them as Python: ``QUANT in (A, B)``
works there and fails to compile on a GPU ("'In' object has no attribute '__name__'"), as every
triton test did on an H100 on 2026-12-06 until the test below existed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "arnorm_triton"


def _jit_functions() -> list[tuple[Path, ast.FunctionDef]]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            if any("jit" in ast.unparse(d) for d in node.decorator_list):
                found.append((path, node))
    return found


def test_the_kernels_are_found():
    names = {fn.name for _, fn in _jit_functions()}
    assert {"fused_add_rmsnorm_quant_kernel", "norm_quant_apply", "norm_quant_epilogue"} <= names


@pytest.mark.parametrize("op", [ast.In, ast.NotIn], ids=lambda o: o.__name__)
def test_no_kernel_compares_with_an_operator_the_compiler_lacks(op):
    bad = [
        f"{path.relative_to(ROOT.parent)}:{node.lineno} in {fn.name}: {ast.unparse(node)}"
        for path, fn in _jit_functions()
        for node in ast.walk(fn)
        if isinstance(node, ast.Compare) and any(isinstance(o, op) for o in node.ops)
    ]
    assert not bad, "Triton compiles no `in` in a kernel (use == and or):\n" + "\n".join(bad)
