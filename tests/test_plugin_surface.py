"""The plugin surface: what arnorm.plugin exports, and that backends use nothing else of the core."""

from __future__ import annotations

import ast
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
