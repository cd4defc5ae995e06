"""The format table (``arnorm/_formats.py``): codes that never move, facts read from one place."""

from __future__ import annotations

import ast
import math
import pathlib
import typing

import pytest

from arnorm import _formats
from arnorm._formats import FORMAT_SPECS

from source_census import BACKEND_PACKAGES, modules_where

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Every code ever given to a format. Append a new format's line here when it joins the table;
#: never edit or remove a line: compiled kernels branch on these numbers and tuned launch tables
#: (``arnorm_triton/_launch_measured.py``) are keyed on them, so a renumbered format would take
#: another format's kernel branch and warp counts.
PINNED_CODES = {
    "fp8_static": 1,
    "fp8_per_token": 2,
    "nvfp4": 3,
    "mxfp8": 4,
    "fp8_per_group": 5,
    "fp8_per_group_64": 6,
    "fp8_per_group_ue8m0": 7,
    "fp8_per_group_64_ue8m0": 8,
    "mxfp4": 9,
}
#: Codes of formats that left the table: never given again.
RETIRED_CODES: frozenset[int] = frozenset()

#: The core files a new format touches (docs/architecture.md, "Adding a format"): its record in the
#: table, its codec's module, and the codec's registration. Every other core module reads the table.
FILES_A_NEW_FORMAT_TOUCHES = ("arnorm/_formats.py", "arnorm/quant/_<format>.py", "arnorm/quant/__init__.py")

#: The core modules that spell a format's name in code (docstrings and comments aside), and why.
CORE_MODULES_NAMING_FORMATS = {
    "arnorm/_formats.py": "the table itself",
    "arnorm/quant/__init__.py": "the codec registry: one encode / decode pair per format",
    # The vLLM integration's entry points (another room's files): vLLM's own name of each format's
    # key (``KEY_NAMES``; a format vLLM does not name keeps the caller's key, so a new format needs
    # no line there), and the mxfp8 entry point vLLM's model code calls by that format.
    "arnorm/integrations/_vllm_types.py": "vLLM's key names of the formats vLLM has",
    "arnorm/integrations/vllm.py": "vLLM's per-format entry points",
    "arnorm/integrations/_vllm_pass_table.py": "the quant ops vLLM's graphs emit after a norm, per format",
}

#: The backends' modules that spell a format's name: what each serves and its kernels per format.
#: A fact of a format (block size, scales, packing, codes) is read from the table instead.
BACKEND_MODULES_NAMING_FORMATS = {
    "arnorm_triton/_plugin.py": "the formats its kernels' quantizer branches on",
    "arnorm_triton/_kernels.py": "the quantizer's branch per format, on the format's code by name",
    "arnorm_triton/_launch_table.py": "the tuned two-pass rule, for nvfp4's code",
    "arnorm_flashinfer/_plugin.py": "the formats served, and nvfp4's narrower dtypes and arch",
    "arnorm_flashinfer/_api.py": "FlashInfer's fusion pattern per format",
    "arnorm_flashinfer/_preflight.py": "the formats MNNVL's kernels are not checked for",
    "arnorm_flashinfer/_rules.py": "the formats FlashInfer instantiates for 16-bit inputs only",
    "arnorm_aiter/_rules.py": "the one format AITER serves (FP8_FORMAT)",
    "backends/arnorm-example/arnorm_example/_plugin.py": "the formats the example serves",
}


def _modules_naming_formats(*packages: str) -> set[str]:
    """Modules with a string constant that is a format's name, docstrings left out."""
    names = set(FORMAT_SPECS)

    def spells(node: ast.AST, docstrings: set[int]) -> bool:
        return isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings

    return modules_where(ROOT, packages, spells)


def _pin_problems(codes: dict[str, int]) -> list[str]:
    """How a table's ``{format: code}`` breaks the pins."""
    owner = {c: n for n, c in PINNED_CODES.items()}
    problems = []
    for n, c in codes.items():
        if n not in PINNED_CODES:
            problems.append(f"{n}: not pinned (needs its code appended to PINNED_CODES)")
        elif c != PINNED_CODES[n]:
            problems.append(f"{n}: code {c} (needs {PINNED_CODES[n]}, its pinned code)")
        if owner.get(c, n) != n:
            problems.append(f"{n}: code {c} (needs a code of its own: {c} is {owner[c]}'s)")
        if c in RETIRED_CODES or c < 1:
            problems.append(f"{n}: code {c} (needs a new code >= 1, never a retired one)")
    values = list(codes.values())
    problems += [f"code {c}: given twice" for c in sorted(set(values)) if values.count(c) > 1]
    return problems


def test_codes_are_pinned_and_append_only():
    assert _pin_problems({name: spec.code for name, spec in FORMAT_SPECS.items()}) == []


def test_a_renumbered_reused_or_unpinned_code_is_refused():
    codes = {name: spec.code for name, spec in FORMAT_SPECS.items()}
    # A format inserted before nvfp4 that pushed it and mxfp8 down one, as position-derived codes did.
    shifted = {"fp8_static": 1, "fp8_per_token": 2, "int8": 3, "nvfp4": 4, "mxfp8": 5}
    assert _pin_problems(shifted) == [
        "int8: not pinned (needs its code appended to PINNED_CODES)",
        "int8: code 3 (needs a code of its own: 3 is nvfp4's)",
        "nvfp4: code 4 (needs 3, its pinned code)",
        "nvfp4: code 4 (needs a code of its own: 4 is mxfp8's)",
        "mxfp8: code 5 (needs 4, its pinned code)",
        "mxfp8: code 5 (needs a code of its own: 5 is fp8_per_group's)",
    ]
    assert _pin_problems({**codes, "int8": 2}) == [
        "int8: not pinned (needs its code appended to PINNED_CODES)",
        "int8: code 2 (needs a code of its own: 2 is fp8_per_token's)",
        "code 2: given twice",
    ]
    with pytest.raises(AssertionError, match="codes"):  # the table itself refuses a code given twice
        _formats._check_codes([*FORMAT_SPECS.values(), FORMAT_SPECS["nvfp4"]])


def test_core_modules_naming_formats():
    assert _modules_naming_formats("arnorm") == set(CORE_MODULES_NAMING_FORMATS)


def test_backend_modules_naming_formats():
    assert _modules_naming_formats(*BACKEND_PACKAGES) == set(BACKEND_MODULES_NAMING_FORMATS)


def test_a_new_format_touches_three_core_files():
    touched = [f for f in CORE_MODULES_NAMING_FORMATS if not f.startswith("arnorm/integrations/")]
    assert len(FILES_A_NEW_FORMAT_TOUCHES) <= 3
    assert set(touched) <= set(FILES_A_NEW_FORMAT_TOUCHES)


@pytest.mark.parametrize("name", list(FORMAT_SPECS))
def test_hidden_multiple_covers_blocks_and_packing(name):
    spec = FORMAT_SPECS[name]
    assert spec.hidden_multiple % (spec.block_size or 1) == 0
    assert spec.hidden_multiple % spec.elements_per_byte == 0
    assert spec.hidden_multiple == math.lcm(spec.block_size or 1, spec.elements_per_byte)


def test_a_packed_format_without_blocks_needs_an_even_hidden_size():
    packed = _formats.FormatSpec("fp4_per_token", 99, None, False, "uint8", 2, "float32", None)
    assert packed.hidden_multiple == 2
    assert packed.layouts == ()


@pytest.mark.parametrize("name", [n for n, s in FORMAT_SPECS.items() if s.block_size])
def test_layouts_default_first(name):
    spec = FORMAT_SPECS[name]
    assert spec.layouts[0] == spec.default_layout
    assert set(spec.layouts) <= set(_formats.LAYOUTS)
    assert len(set(spec.layouts)) == len(spec.layouts)
    if not spec.scale_layouts:  # the block formats' own two layouts, unless the record names others
        assert sorted(spec.layouts) == ["linear", "swizzled_128x4"]


def test_every_layout_serves_some_format():
    assert {x for s in FORMAT_SPECS.values() for x in s.layouts} == set(_formats.LAYOUTS)


def test_one_quant_name_type_and_one_dtype_triple():
    assert typing.get_args(_formats.QuantChoice) == (_formats.NO_QUANT, *_formats.QUANT_FORMATS)
    assert typing.get_args(_formats.DtypeName) == _formats.DTYPES
    from arnorm.registry import _capabilities

    assert not hasattr(_capabilities, "QuantName")
    assert _capabilities.Capabilities(platforms=frozenset({"cpu"})).dtypes == frozenset(_formats.DTYPES)


def test_dtype_bytes_cover_the_dtypes():
    import torch

    assert tuple(_formats.DTYPE_BYTES) == _formats.DTYPES
    assert all(getattr(torch, d).itemsize == n for d, n in _formats.DTYPE_BYTES.items())
