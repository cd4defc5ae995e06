"""The plugin surface: what arnorm.plugin exports, that backends use nothing else of the core, and
that benchmarks/ uses the public API only."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import arnorm
import arnorm.plugin

ROOT = Path(__file__).resolve().parents[1]
BACKEND_DIRS = [ROOT / d for d in ("arnorm_triton", "arnorm_flashinfer", "arnorm_aiter")] + [
    ROOT / "backends" / "arnorm-example"
]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


@pytest.mark.parametrize("folder", BACKEND_DIRS, ids=lambda p: p.name)
def test_backends_import_only_the_public_plugin_surface(folder):
    """No module of a backend imports arnorm._* (or arnorm.quant._*): only arnorm.plugin / arnorm.quant."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted(folder.rglob("*.py"))
        for line, module in _imports(path)
        if module.startswith("arnorm.") and any(part.startswith("_") for part in module.split(".")[1:])
    ]
    assert offenders == [], "backends must use arnorm.plugin only:\n" + "\n".join(offenders)


BENCHMARKS = ROOT / "benchmarks"
#: The one benchmark allowed private modules: the launch-table tuner times arnorm_triton's own
#: launcher (``FusedLauncher``, its kernels' row shapes and codes) to write arnorm_triton's own table
#: (``_launch_measured.py``): a tool of that package's internals, not a user of arnorm. It may
#: import arnorm_triton's private modules and nothing else private.
TUNER = "tune_launch_table.py"
#: An import in a shell script's Python (``python3 - <<EOF`` blocks, ``python3 -c``).
_SHELL_IMPORT = re.compile(r"(?:^|[;\s])(?:from\s+([\w.]+)\s+import\s+([\w, ]+)|import\s+([\w.]+))", re.M)


def _private(module: str, names: tuple[str, ...] = ()) -> bool:
    """Whether importing ``names`` from ``module`` reaches past a first-party public surface."""
    parts = module.split(".")
    if not parts[0].startswith("arnorm"):
        return False
    return any(p.startswith("_") for p in parts[1:]) or any(
        n.strip().startswith("_") and not n.strip().startswith("__") for n in names
    )


def _benchmark_imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    text = path.read_text()
    if path.suffix == ".py":
        found = []
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((node.lineno, node.module, tuple(a.name for a in node.names)))
            elif isinstance(node, ast.Import):
                found += [(node.lineno, a.name, ()) for a in node.names]
        return found
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(1) or m.group(3), tuple((m.group(2) or "").split(",")))
        for m in _SHELL_IMPORT.finditer(text)
    ]


def _benchmark_files() -> list[Path]:
    return sorted(p for p in BENCHMARKS.iterdir() if p.suffix in {".py", ".sh"})


def test_benchmarks_import_only_public_apis():
    """benchmarks/ runs arnorm as users do: ``arnorm``, ``arnorm.plugin``, ``arnorm.testing``,
    ``arnorm.quant`` and the backends' public names; the tuner alone (``TUNER``) may import
    arnorm_triton's private modules."""
    offenders = []
    for path in _benchmark_files():
        for line, module, names in _benchmark_imports(path):
            if not _private(module, names):
                continue
            if path.name == TUNER and module.startswith("arnorm_triton."):
                continue
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {module} {', '.join(names)}".rstrip())
    assert offenders == [], "benchmarks must use public APIs:\n" + "\n".join(offenders)


def test_benchmarks_do_not_reach_into_tests():
    """No benchmark imports test code or puts ``tests/`` on its path: what a benchmark needs of the
    test helpers is public in ``arnorm.testing``."""
    reach = re.compile(
        r"sys\.path\.\w+\([^)]*tests|PYTHONPATH=[^\n]*/tests\b|^\s*(?:from|import)\s+tests\b", re.M
    )
    offenders = [
        f"{path.relative_to(ROOT)}: {m.group(0).strip()}"
        for path in _benchmark_files()
        for m in reach.finditer(path.read_text())
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("module", "names", "private"),
    [
        ("arnorm.testing._compare", ("ulp_distance",), True),
        ("arnorm.testing", ("ulp_distance",), False),
        ("arnorm.op", ("_plan",), True),
        ("arnorm_triton._kernels", (), True),
        ("arnorm.plugin", ("add_rmsnorm", "__doc__"), False),
        ("torch._dynamo", (), False),
    ],
)
def test_what_counts_as_private(module, names, private):
    assert _private(module, names) == private


def test_shell_scripts_imports_are_read(tmp_path):
    script = tmp_path / "x.sh"
    script.write_text("python3 - <<EOF\nimport arnorm\nfrom arnorm.testing._compare import ulps\nEOF\n")
    assert [(m, n) for _, m, n in _benchmark_imports(script)] == [
        ("arnorm", ("",)),
        ("arnorm.testing._compare", ("ulps",)),
    ]


def test_plugin_all_is_exactly_its_public_names():
    """arnorm.plugin.__all__ lists every public name it offers, lazily loaded ones included, and
    nothing else (no ``annotations``, ``Any`` or ``TYPE_CHECKING`` a plugin author could import)."""
    public = {n for n in vars(arnorm.plugin) if not n.startswith("_")}
    lazy = {"quantize", "dequantize", "empty_quantized"}
    assert set(arnorm.plugin.__all__) == public | lazy
    for name in lazy:
        assert callable(getattr(arnorm.plugin, name))


def test_importing_the_plugin_surface_imports_no_torch():
    """A descriptor module imports arnorm.plugin at discovery: that must stay cheap."""
    code = "import sys, arnorm.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_public_objects_say_arnorm_in_tracebacks():
    """Exceptions and classes exported by arnorm show the module users import them from."""
    for name in arnorm.__all__:
        obj = getattr(arnorm, name)
        if isinstance(obj, type):
            assert obj.__module__ == "arnorm", name


def test_writing_a_backend_documents_every_capabilities_field_and_its_default():
    """docs/writing-a-backend.md's table has one row per Capabilities field, with its real default."""
    import ast
    import re

    from pydantic_core import PydanticUndefined

    from arnorm.plugin import Capabilities

    text = (ROOT / "docs" / "writing-a-backend.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+?) \| .* \|$", text, re.M))
    fields = Capabilities.model_fields
    assert set(fields) <= set(rows), sorted(set(fields) - set(rows))
    for name, info in fields.items():
        default = info.get_default(call_default_factory=True)
        if default is PydanticUndefined:
            assert rows[name] == "required", name
        else:
            assert ast.literal_eval(rows[name].strip("`")) == default, name
