"""The layout's rules (docs/architecture.md): no import loop of any kind but the named ones, rooms
that import downwards only, one table of formats, no reference to a design document outside
the repository, no history in the package sources, and figures (not transcripts) in
benchmarks/results/."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import typing

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("arnorm", "arnorm_triton", "arnorm_flashinfer", "arnorm_aiter")


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _imports(path: pathlib.Path) -> list[str]:
    """Every first-party name ``path`` imports: at module level, inside functions (deferred) and
    under ``TYPE_CHECKING`` (type-only) alike. A deferred or type-only edge still ties the two
    modules' designs together, and a loop of them is the same knot, only harder to see."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.extend(f"{node.module}.{a.name}" for a in node.names)
    return names


def _import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for name in _imports(path):
            target = resolve(name)
            # A package importing its own submodules to re-export them is its own room, not a loop.
            if target and target != mod and not target.startswith(mod + "."):
                graph[mod].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return found


#: The import loops the house keeps, each with its reason (docs/architecture.md, "The rooms").
ALLOWED_LOOPS: dict[frozenset[str], str] = {}


def test_no_import_loop_of_any_kind_but_the_named_ones():
    """Module-level, deferred (in-function) and type-only imports all count."""
    loops = {frozenset(c) for c in _cycles(_import_graph())}
    assert loops - set(ALLOWED_LOOPS) == set(), "an import loop that docs/architecture.md does not name"
    assert set(ALLOWED_LOOPS) - loops == set(), (
        "a named loop is gone: drop it from ALLOWED_LOOPS and the docs"
    )


def test_the_planted_loop_is_found():
    """The detector itself: a two-module loop is reported."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_deferred_and_type_only_imports_are_edges(tmp_path):
    """An import inside a function and one under ``TYPE_CHECKING`` count as much as a top-level one."""
    mod = tmp_path / "m.py"
    mod.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from arnorm.op._op import AllReduceNorm\n"
        "def f():\n    from arnorm.registry import _select\n    import arnorm.comm._comm\n"
    )
    assert _imports(mod) == [
        "typing.TYPE_CHECKING", "arnorm.op._op.AllReduceNorm", "arnorm.registry._select", "arnorm.comm._comm"
    ]  # fmt: skip


#: The ground floor: value types, errors, the format and norm-option tables and the problem, which
#: import nothing above them.
_FLOOR = ("arnorm._errors", "arnorm._formats", "arnorm._norm", "arnorm._problem", "arnorm._types")
#: Rooms and what each may import from the house, every kind of import counted: settings and
#: communication lie under the protocol, the registry and the op; the registry under the op.
_BELOW = {
    "arnorm._environment": ("arnorm._errors",),
    "arnorm._config": ("arnorm._environment", "arnorm._errors", "arnorm._problem"),
    "arnorm.comm": (*_FLOOR, "arnorm.comm"),
    "arnorm._protocol": (*_FLOOR, "arnorm._config", "arnorm.comm"),
    "arnorm.registry": (
        *_FLOOR,
        "arnorm._config",
        "arnorm._environment",
        "arnorm._protocol",
        "arnorm.comm",
        "arnorm.registry",
    ),
}


@pytest.mark.parametrize("room", sorted(_BELOW))
def test_rooms_import_downwards_only(room):
    graph = _import_graph()
    allowed = _BELOW[room]
    wrong = {
        f"{mod} -> {target}"
        for mod, targets in graph.items()
        if mod == room or mod.startswith(room + ".")
        for target in targets
        if not any(target == a or target.startswith(a + ".") for a in allowed)
    }
    assert wrong == set()


def test_format_names_derive_from_the_one_table():
    from arnorm import _formats, quant
    from arnorm.registry import _capabilities

    assert tuple(_formats.FORMAT_SPECS) == _formats.QUANT_FORMATS == typing.get_args(_formats.QuantName)
    assert set(quant._CODECS) == set(_formats.FORMAT_SPECS)
    assert set(typing.get_args(_capabilities.QuantChoice)) == {"none", *_formats.QUANT_FORMATS}
    import arnorm

    assert arnorm.QUANT_FORMATS == _formats.QUANT_FORMATS
    assert arnorm.SCALE_LAYOUTS == _formats.LAYOUTS


@pytest.mark.parametrize("name", ["fp8_static", "fp8_per_token", "nvfp4", "mxfp8"])
def test_format_flags(name):
    from arnorm._formats import FORMAT_SPECS

    spec = FORMAT_SPECS[name]
    assert spec.returns_input_scale == (name == "fp8_static")
    assert spec.keeps_global_scale == (name == "nvfp4")
    assert (spec.sample_scale is not None) == spec.takes_scale


#: The original design document, which stayed outside the repository (docs/architecture.md and
#: docs/numerics.md replace it); spelt in parts so this file does not cite it either.
_OUTSIDE_DOC = "DESIGN"


def test_nothing_cites_a_design_document_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    offenders = []
    for rel in files.stdout.split():
        if rel.startswith("benchmarks/results/"):
            continue
        path = REPO / rel
        if path.suffix not in {".py", ".md", ".sh", ".toml", ".c"} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if f"{_OUTSIDE_DOC}.md" in text or f"the {_OUTSIDE_DOC}" in text:
            offenders.append(rel)
    assert offenders == []


def test_the_top_level_is_the_design_cards():
    """docs/architecture.md's rooms: the core, the three first-party backends, and ``backends/``
    holding separately packaged plugin distributions, each installable on its own."""
    for name in ("arnorm", "backends", "arnorm_flashinfer", "arnorm_aiter", "arnorm_triton", "tests"):
        assert (REPO / name).is_dir(), f"{name}/ is missing from the top level"
    for name in ("pyproject.toml", "README.md"):
        assert (REPO / name).is_file(), f"{name} is missing from the top level"
    dists = [p for p in (REPO / "backends").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert any(p.name == "arnorm-example" for p in dists)
    for dist in dists:
        assert (dist / "pyproject.toml").is_file(), f"backends/{dist.name} is not a distribution"
    assert not (REPO / "examples").exists(), "plugin distributions live under backends/"


def _tracked(*folders: str) -> list[str]:
    files = subprocess.run(
        ["git", "ls-files", *folders], cwd=REPO, capture_output=True, text=True, check=True
    )
    return [rel for rel in files.stdout.split() if (REPO / rel).is_file()]


#: What the package sources may not cite: the round or issue a line came from ("round 3",
#: "Round-3's", "issue 44", "issues 14, 43"). Comments say why, not when: the history is git's.
_HISTORY = re.compile(r"\b(round|issue)s?[- ]?#?\d+", re.IGNORECASE)
#: Every package and plugin distribution the project ships.
_SOURCES = (*PACKAGES, "backends")


def _history_in(text: str) -> list[str]:
    return [m.group(0) for m in _HISTORY.finditer(text)]


def test_package_sources_cite_no_round_or_issue():
    offenders = [
        f"{rel}:{n}: {found}"
        for rel in _tracked(*_SOURCES)
        for n, line in enumerate((REPO / rel).read_text(errors="replace").splitlines(), start=1)
        for found in _history_in(line)
    ]
    assert offenders == [], "history in the package sources (say why, not when):\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "text",
    ["round 3's keyword", "Round-3 shim", "kept since ROUND3", "(issue 44)", "issues 14, 43", "issue #7"],
)
def test_a_cited_round_or_issue_is_found(text):
    assert _history_in(text)


@pytest.mark.parametrize("text", ["rounds to nearest", "round-trip", "round_before_weight", "issues a load"])
def test_rounding_and_issuing_are_not_history(text):
    assert _history_in(text) == []


def test_benchmark_results_hold_figures_not_transcripts():
    """Each file of benchmarks/results is a table (``.md``) or its data (``.json``), named with its
    date (and GPU where one ran it); test and run logs belong to the tree they ran on, and git keeps
    them. The README indexes the files."""
    results = "benchmarks/results"
    files = [pathlib.PurePosixPath(rel) for rel in _tracked(results)]
    stray = [str(p) for p in files if p.suffix not in {".md", ".json"}]
    assert stray == [], "only .md and .json files (figures) belong in benchmarks/results"
    undated = [str(p) for p in files if p.name != "README.md" and not re.search(r"\d{4}-\d{2}-\d{2}", p.name)]
    assert undated == [], "a result file names its date"
    index = (REPO / results / "README.md").read_text()
    unindexed = [p.name for p in files if p.name != "README.md" and p.stem.split("-20")[0] not in index]
    assert unindexed == []


def test_the_version_agrees_with_pyproject_and_the_changelog():
    """``arnorm.__version__``, pyproject.toml's version and CHANGELOG.md's newest entry are one."""
    import arnorm

    # tomllib is Python 3.11's; the project's own line is plain enough to read without it.
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    newest = re.search(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert newest is not None, "CHANGELOG.md has no release entry"
    assert arnorm.__version__ == version == newest.group(1)
