"""docs/catalogue.md has an entry for every verdict status, error class, quant format and reason aspect
the code can emit, and none for one it cannot.

The lists come from the code: statuses from ``arnorm.STATUSES``, errors from the subclasses of
``ArnormError`` and ``ArnormWarning``, formats from the format table, and reason aspects from the
norm-option table and from every string literal of the packages written in the reason grammar
``"<aspect>: <found> (needs <required>)"``. Adding a status, an error, a format or a reason therefore
fails this test until the catalogue has a row for it; the failure names what is missing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import arnorm
from arnorm._errors import ArnormError, ArnormWarning
from arnorm._formats import FORMAT_SPECS
from arnorm._norm import NORM_OPTIONS
from arnorm.registry._explain import STATUSES

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = ROOT / "docs" / "catalogue.md"
#: The packages whose messages the catalogue covers.
PACKAGES = ("arnorm", "arnorm_triton", "arnorm_flashinfer", "arnorm_aiter")
#: Sources whose messages it does not: the CLI's usage errors (one line on the terminal, exit status 2,
#: the flag named) and the conformance suite's failures (a backend author's test report; see
#: docs/writing-a-backend.md).
NOT_CATALOGUED = ("arnorm/cli/", "arnorm/testing/")
#: A placeholder in an aspect: ``{...}`` in code, ``<...>`` in the catalogue.
PLACEHOLDER = re.compile(r"\{[^}]*\}|<[^>]*>")


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Each string literal of ``tree`` with ``{}`` for its formatted parts; docstrings and asserts'
    messages (invariants of the code, never shown to a user) left out."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        if isinstance(node, ast.Assert):
            skip.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            found.append((node.lineno, str(text)))
    return found


def _key(aspect: str) -> str:
    return PLACEHOLDER.sub("{}", aspect).strip()


def code_aspects() -> dict[str, list[str]]:
    """Every reason aspect the packages can emit, with where: the text before the first ``": "`` of
    each message in the reason grammar. An aspect that is only a placeholder (an argument's name,
    ``f"{arg}: ..."``) is the argument's and is catalogued by argument, not listed here."""
    aspects: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(NOT_CATALOGUED):
                continue
            for line, text in _strings(ast.parse(path.read_text(), rel)):
                if " (needs " not in text:
                    continue
                head = text.split(" (needs ", 1)[0]
                if ": " not in head:
                    continue
                aspect = _key(head.split(": ", 1)[0])
                if aspect.strip("{}. ") and not aspect.startswith("{}"):
                    aspects.setdefault(aspect, []).append(f"{rel}:{line}")
    for option in NORM_OPTIONS.values():
        aspects.setdefault(_key(option.aspect), []).append(f"arnorm/_norm.py ({option.name})")
    return aspects


def error_classes() -> set[str]:
    """Every error and warning class of the packages: ``ArnormError``, ``ArnormWarning`` and every
    class defined in the sources that derives from one of them, directly or not (read from the
    sources, so that no module needs its optional dependency imported)."""
    bases: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                    bases.setdefault(node.name, set()).update(names)
    found = {ArnormError.__name__, ArnormWarning.__name__}
    grew = True
    while grew:
        more = {name for name, of in bases.items() if of & found} - found
        found |= more
        grew = bool(more)
    return found


def catalogue_rows(section: str) -> dict[str, list[str]]:
    """The table rows of ``## <section>`` (its ``###`` subsections included), by their first cell's
    code span, with every cell."""
    text = CATALOGUE.read_text()
    m = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"docs/catalogue.md: no section '## {section}'"
    rows = {}
    for line in m[1].splitlines():
        cell = re.match(r"^\| `([^`]+)` \|", line)
        if cell:
            assert cell[1] not in rows, f"docs/catalogue.md, {section}: {cell[1]!r} has two rows"
            rows[cell[1]] = [c.strip() for c in line.strip().strip("|").split("|")]
    return rows


def _compare(kind: str, in_code: set[str], in_docs: set[str], where: dict[str, list[str]] | None = None):
    missing = sorted(in_code - in_docs)
    stale = sorted(in_docs - in_code)
    lines = []
    for name in missing:
        at = f" (from {', '.join(where[name][:3])})" if where else ""
        lines.append(f"  no entry for {kind} `{name}`{at}: add a row to docs/catalogue.md")
    gone = "which the code no longer has: remove its row"
    lines.extend(f"  entry for {kind} `{name}`, {gone}" for name in stale)
    assert not lines, "docs/catalogue.md is out of date:\n" + "\n".join(lines)


def test_every_verdict_status_has_an_entry():
    _compare("status", set(STATUSES), set(catalogue_rows("Verdict statuses")))


def test_every_error_and_warning_class_has_an_entry():
    _compare("error class", error_classes(), set(catalogue_rows("Errors and warnings")))


def test_catalogued_public_errors_are_exported():
    """Every catalogued error of a public name is importable from ``arnorm``, where users catch it."""
    public = {name for name in catalogue_rows("Errors and warnings") if not name.startswith("_")}
    assert public <= set(arnorm.__all__), sorted(public - set(arnorm.__all__))


def test_every_quant_format_has_an_entry_with_its_facts():
    rows = catalogue_rows("Quantized formats")
    _compare("quant format", set(FORMAT_SPECS), set(rows))
    for name, spec in FORMAT_SPECS.items():
        cells = rows[name]
        scale = "yes" if spec.takes_scale else "no"
        assert cells[1] == str(spec.hidden_multiple), (
            f"{name}: hidden size multiple {cells[1]} (needs {spec.hidden_multiple})"
        )
        assert cells[2] == scale, f"{name}: input scale {cells[2]} (needs {scale})"


def test_every_reason_aspect_has_an_entry():
    aspects = code_aspects()
    documented = {_key(a) for a in catalogue_rows("Reasons")}
    _compare("reason aspect", set(aspects), documented, aspects)


def test_the_extraction_finds_what_it_should():
    """A guard on the extractor itself: known aspects of each kind are found."""
    aspects = code_aspects()
    known_aspects = (
        "platform",
        "dtype",
        "hidden size",
        "tokens",
        "setup",
        "rounding order",
        "op out of step on rank {}",
    )
    for known in known_aspects:
        assert known in aspects, known
    assert {"ArnormError", "PeerError", "StoreLostError", "ArnormWarning"} <= error_classes()
