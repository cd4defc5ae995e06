"""The docs are executable: Python snippets run; writing-a-backend.md's plugin installs and passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Documents whose ```python blocks run as scripts (writing-a-backend.md: as a plugin, below).
SCRIPTED = ["README.md", "docs/configuration.md", "docs/troubleshooting.md", "docs/integrations.md"]
BLOCK = re.compile(
    r"(?:(?P<marker><!-- not run: [^>]+-->\n)|(?P<ranks><!-- on 2 gloo ranks: [^>]+-->\n))?"
    r"```(?P<lang>\w+)\n(?P<body>.*?)```",
    re.S,
)
#: How a block marked "on 2 gloo ranks" runs: inside arnorm.testing.run_ranks, given the names an
#: engine has at that point (its TP group and one step's tensors).
RANKS_HARNESS = """
import torch
import torch.distributed as dist

from arnorm.testing import run_ranks

CODE = {code!r}


def rank(rank, world):
    g = torch.Generator().manual_seed(rank)
    names = {{
        "tp_group": dist.group.WORLD,
        "hidden_states": torch.randn(4, 4096, generator=g).bfloat16(),
        "residual": torch.randn(4, 4096, generator=torch.Generator().manual_seed(7)).bfloat16(),
        "weight": torch.randn(4096, generator=torch.Generator().manual_seed(8)).bfloat16(),
        "scale": torch.tensor([0.05]),
    }}
    exec(CODE, names)
    return "ok"


if __name__ == "__main__":
    assert run_ranks(2, rank, timeout=600) == ["ok", "ok"]
"""


def blocks(doc: str, lang: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, why_not_run)`` for each fenced block of ``lang`` in ``doc``; a block marked
    "on 2 gloo ranks" comes back wrapped in :data:`RANKS_HARNESS`."""
    text = (ROOT / doc).read_text()
    found = []
    for m in BLOCK.finditer(text):
        if m["lang"] == lang:
            line = text.count("\n", 0, m.start("body")) + 1
            code = RANKS_HARNESS.format(code=m["body"]) if m["ranks"] else m["body"]
            found.append((line, code, m["marker"]))
    return found


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARNORM_")}
    env.update(extra)
    return env


SNIPPETS = [
    pytest.param(
        doc, line, code, marks=[pytest.mark.skip(reason=marker)] if marker else [], id=f"{doc}:{line}"
    )
    for doc in SCRIPTED
    if (ROOT / doc).exists()
    for line, code, marker in blocks(doc, "python")
]


@pytest.mark.parametrize(("doc", "line", "code"), SNIPPETS)
def test_python_snippet_runs(doc, line, code, tmp_path):
    """Each ```python block of the user docs runs as a script, as a reader would paste it."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{doc}:{line} failed:\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("doc", SCRIPTED)
def test_snippets_that_build_an_op_close_it(doc):
    """A reader copies the snippet into a loop: every op it builds is closed (or used in a with block)."""
    text = (ROOT / doc).read_text()
    unclosed = [
        f"{doc}:{text.count(chr(10), 0, m.start('body')) + 1}"
        for m in BLOCK.finditer(text)
        if m["lang"] == "python" and re.search(r"^\w+ = arnorm\.AllReduceNorm\(", m["body"], re.M)
        if not re.search(r"^\w+\.close\(\)", m["body"], re.M)
    ]
    assert unclosed == []


def _write_plugin(root: Path) -> None:
    """The files of writing-a-backend.md, each written where its first comment line says."""
    doc = "docs/writing-a-backend.md"
    for lang in ("python", "toml"):
        for _, code, _ in blocks(doc, lang):
            first = code.splitlines()[0] if code.strip() else ""
            m = re.match(r"# (\S+\.(?:py|toml))", first)
            if m is None:
                continue
            path = root / m[1]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(code)


@pytest.mark.slow
def test_the_plugin_of_writing_a_backend_installs_and_passes_conformance(tmp_path):
    """The doc's pyproject installs as written; arnorm finds mine, selects it, and the suite passes."""
    src = tmp_path / "mine-src"
    _write_plugin(src)
    assert (src / "pyproject.toml").exists() and (src / "mine" / "_backend.py").exists()
    site = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stderr
    env = _env(PYTHONPATH=os.pathsep.join([str(site), str(src), os.environ.get("PYTHONPATH", "")]))
    check = textwrap.dedent(
        """
        import torch, arnorm
        info = {i.name: i for i in arnorm.backends()}["mine"]
        print(info.status, info.version)
        kw = dict(hidden_size=64, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6), device="cpu")
        with arnorm.AllReduceNorm(arnorm.LOCAL, **kw) as op:
            print(op.backend, dict(dict(op.explain().settings)["mine"]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", check], env=_env(ARNORM_DISABLE="triton", **{k: v for k, v in env.items()}),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["available 0.1.0", "mine {'max_tokens': 2048}"]
    suite = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(src / "tests" / "test_mine.py")],
        cwd=src, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert suite.returncode == 0, suite.stdout[-4000:]
    assert " passed" in suite.stdout and " failed" not in suite.stdout
