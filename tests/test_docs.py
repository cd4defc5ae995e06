"""The docs are executable: Python snippets run; every pasted output is produced again and compared;
writing-a-backend.md's plugin installs and passes."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Documents whose ```python blocks run as scripts (writing-a-backend.md: as a plugin, below).
SCRIPTED = ["README.md", "docs/configuration.md", "docs/troubleshooting.md", "docs/integrations.md"]
#: Every document, for the rule on pasted outputs.
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
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


#: A fenced block that shows what a program printed: the comment before it names what produced it,
#: ``<!-- output of: [VAR=value ...] arnorm <args> -->`` (the CLI) or
#: ``<!-- output of the block above -->`` (the last ```python block before it, run as a script).
#: A block of another kind that is no output says so: ``<!-- not output: <what it is> -->``.
OUTPUT = re.compile(
    r"(?:^[ \t]*<!-- (?:output of(?P<of>: [^\n]*?| the block above) |not output: (?P<not>[^\n]*?) )-->\n)?"
    r"^[ \t]*```(?P<lang>\w*)\n(?P<body>.*?)```",
    re.S | re.M,
)
#: Fenced blocks of these languages are code, run or shown; any other block is an output.
CODE_LANGS = {"python", "toml", "bash"}


def output_blocks(doc: str) -> list[tuple[int, str | None, str, str | None]]:
    """``(line, producer, expected, code_above)`` for each output block of ``doc``: ``producer`` is
    the command after "output of:", ``None`` for "the block above" (then ``code_above`` is that
    block) or for a block with no marker at all (an untested output)."""
    text = (ROOT / doc).read_text()
    found = []
    last_python = None
    for m in OUTPUT.finditer(text):
        if m["lang"] == "python":
            last_python = m["body"]
        if m["lang"] in CODE_LANGS or m["not"]:
            continue
        line = text.count("\n", 0, m.start("body")) + 1
        if m["of"] and m["of"].startswith(": "):
            found.append((line, m["of"][2:].strip(), m["body"], None))
        else:
            found.append((line, None, m["body"], last_python if m["of"] else None))
    return found


def matches(expected: str, got: str) -> bool:
    """Whether ``got`` is what ``expected`` shows: runs of spaces are one space, a line ``...`` stands
    for any lines (none included), and ``...`` inside a line for any text (versions, paths, times)."""

    def norm(line: str) -> str:
        return " ".join(line.split())

    pattern = []
    for line in expected.strip("\n").splitlines():
        if line.strip() == "...":
            pattern.append(r"(?:[^\n]*\n)*?")
        else:
            pattern.append(".*?".join(map(re.escape, norm(line).split("..."))) + r"\n")
    text = "".join(norm(line) + "\n" for line in got.strip("\n").splitlines())
    return re.fullmatch("".join(pattern), text, re.S) is not None


def _documented_setup() -> str | None:
    """Why this machine cannot reproduce the pasted outputs, or ``None``: they were made on CPU with
    neither FlashInfer nor AITER installed and the example plugin installed, as CI runs."""
    for module in ("flashinfer", "aiter"):
        if importlib.util.find_spec(module) is not None:
            return f"{module} is installed: the pasted outputs show it not installed"
    if importlib.util.find_spec("arnorm_example") is None:
        return "the example plugin (backends/arnorm-example) is not installed"
    return None


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARNORM_") and k != "TRITON_INTERPRET"}
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


#: The output each snippet printed, as pasted after it: ``{(doc, code): expected}``.
SNIPPET_OUTPUTS = {
    (doc, above): expected
    for doc in SCRIPTED
    if (ROOT / doc).exists()
    for _, producer, expected, above in output_blocks(doc)
    if producer is None and above is not None
}
COMMANDS = [
    pytest.param(doc, command, expected, id=f"{doc}:{line}")
    for doc in DOCS
    for line, command, expected, _ in output_blocks(doc)
    if command is not None
]


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    """What ``argv`` prints, stdout and stderr in the order a terminal shows them."""
    done = subprocess.run(
        argv, cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    return f"{done.stdout.rstrip()}\n[exit status {done.returncode}]"


@pytest.mark.parametrize(("doc", "line", "code"), SNIPPETS)
def test_python_snippet_runs(doc, line, code, tmp_path):
    """Each ```python block of the user docs runs as a script, as a reader would paste it, and prints
    what the docs show after it (when they show it)."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    out = _run([sys.executable, str(script)], tmp_path, _env())
    assert out.endswith("[exit status 0]"), f"{doc}:{line} failed:\n{out}"
    expected = SNIPPET_OUTPUTS.get((doc, code))
    if expected is not None:
        if (why := _documented_setup()) is not None:
            pytest.skip(why)
        printed = out.rsplit("\n[exit status", 1)[0]
        assert matches(expected, printed), f"{doc}:{line} printed:\n{printed}\nthe docs show:\n{expected}"


@pytest.mark.parametrize(("doc", "command", "expected"), COMMANDS)
def test_pasted_command_output_matches(doc, command, expected, tmp_path):
    """Each pasted transcript of ``arnorm ...`` is what the command prints today (with the exit status
    when the docs show one: ``[exit status N]``)."""
    if (why := _documented_setup()) is not None:
        pytest.skip(why)
    first, _, rest = expected.partition("\n")
    if first.startswith("$ "):  # the prompt line a reader types: the same command
        assert first == f"$ {command}", f"{doc}: the block shows `{first}` under 'output of: {command}'"
        expected = rest
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == "arnorm", f"{doc}: 'output of: {command}' runs no arnorm command"
    out = _run([sys.executable, "-m", "arnorm", *words[1:]], tmp_path, _env(**env))
    if "[exit status" not in expected:
        out = out.rsplit("\n[exit status", 1)[0]
    assert matches(expected, out), f"{doc}: `{command}` printed:\n{out}\nthe docs show:\n{expected}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_pasted_output_is_compared(doc):
    """A block of program output either names what printed it (and a test above compares it) or is
    not in the docs: nothing pasted can go stale unseen."""
    untested = [line for line, producer, _, above in output_blocks(doc) if producer is None and above is None]
    assert untested == [], (
        f"{doc}: output blocks at lines {untested} name no producer (needs <!-- output of: -->)"
    )
    if doc not in SCRIPTED:
        above = [line for line, producer, _, code in output_blocks(doc) if producer is None]
        assert above == [], f"{doc}: its ```python blocks are not run, so 'the block above' is not compared"


def test_output_matching_rules():
    assert matches("a  b\n...\nz", "a b\nx\ny\nz\n")
    assert matches("arnorm ...\nok", "arnorm 0.3.0\nok")
    assert matches("a\n...\nb", "a\nb")
    assert not matches("a\nb", "a\nx\nb")
    assert not matches("a ... c", "a b d")


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
