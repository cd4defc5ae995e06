"""Which modules of the packages spell a name in code, docstrings left out: the censuses of
``tests/test_formats.py`` (format names) and ``tests/test_norm_options.py`` (norm options)."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Callable

#: Every backend's package in the repository, arnorm's own and the example plugin.
BACKEND_PACKAGES = (
    "arnorm_triton",
    "arnorm_flashinfer",
    "arnorm_aiter",
    "backends/arnorm-example/arnorm_example",
)


def docstring_ids(tree: ast.AST) -> set[int]:
    """``id`` of every docstring's constant in ``tree`` (module, class and function docstrings)."""
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }


def modules_where(
    root: pathlib.Path, packages: tuple[str, ...], spells: Callable[[ast.AST, set[int]], bool]
) -> set[str]:
    """The ``.py`` files under ``root / package`` (as posix paths relative to ``root``) in which some
    node ``spells(node, docstring_ids)``."""
    found = set()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            docstrings = docstring_ids(tree)
            if any(spells(node, docstrings) for node in ast.walk(tree)):
                found.add(path.relative_to(root).as_posix())
    return found
