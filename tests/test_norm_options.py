"""The norm-option table (``arnorm/_norm.py``): every fact of an option read from one place, and the
modules that still spell an option's name, each with why."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

import pytest

from arnorm._norm import NORM_OPTIONS
from arnorm.plugin import Capabilities, Problem, RMSNorm, add_rmsnorm, check_capabilities

from source_census import BACKEND_PACKAGES, modules_where

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The files a new option touches (docs/architecture.md, "Adding a norm option"): its record, its
#: field in RMSNorm, the reference arithmetic, and its definition bit for bit; then, for each
#: backend that serves it, its declaration and its kernel (for triton: ``_plugin.py``'s
#: ``norm_options`` and the epilogue's constexpr of the same name in capitals, ``_kernels.py``,
#: passed along by ``symm/_kernels.py``). Everything else iterates over the table.
FILES_A_NEW_OPTION_TOUCHES = (
    "arnorm/_norm.py",
    "arnorm/_types.py",
    "arnorm/_reference.py",
    "docs/numerics.md",
)

#: The core modules a new option touches, each spelling every option.
OPTION_MODULES = {
    "arnorm/_norm.py": "the table itself",
    "arnorm/_types.py": "RMSNorm's field per option",
    "arnorm/_reference.py": "the reference arithmetic: a keyword and its arithmetic per option",
}
#: The core modules that spell an option's name in code (docstrings and comments aside), and why.
CORE_MODULES_NAMING_OPTIONS = {
    **OPTION_MODULES,
    # The judge's tolerance where an option rounds twice (an option with no such effect adds nothing).
    "arnorm/testing/_compare.py": "the two-rounding order's allowed neighbours (round_before_weight)",
    # Clients: which option a library's norms compute (another room's knowledge of another library).
    "arnorm/integrations/_hf_inspect.py": "the rounding order of Hugging Face's norm classes",
    "arnorm/integrations/_vllm_norms.py": "the arithmetics vLLM's norms are probed against",
    "arnorm/integrations/vllm.py": "the unfused fallback computes the probed vLLM arithmetic",
    "arnorm/integrations/_vllm_pass_op.py": "the arithmetic of the seam ops the compile pass replaces",
}

#: The backends' modules that spell an option's name: what each serves, and its kernels.
BACKEND_MODULES_NAMING_OPTIONS = {
    "arnorm_triton/_plugin.py": "the options the epilogue serves (norm_options)",
    "arnorm_triton/_kernels.py": "the epilogue's constexpr per option (its name in capitals)",
    "arnorm_triton/symm/_kernels.py": "the same constexprs, passed to the shared epilogue",
    "backends/arnorm-example/arnorm_example/_plugin.py": "the option the example serves",
}


def _words(node: ast.AST, docstrings: set[int]) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
        return [node.value]
    return []


def _spells_an_option(node: ast.AST, docstrings: set[int]) -> bool:
    return any(name in word.lower() for word in _words(node, docstrings) for name in NORM_OPTIONS)


def _modules_naming_options(*packages: str, root: pathlib.Path = ROOT) -> set[str]:
    """Modules with a name, attribute, keyword, parameter or string (docstrings left out) that holds
    an option's name in any case (``ROUND_BEFORE_WEIGHT`` too)."""
    return modules_where(root, packages, _spells_an_option)


def test_core_modules_naming_options():
    assert _modules_naming_options("arnorm") == set(CORE_MODULES_NAMING_OPTIONS)


def test_backend_modules_naming_options():
    assert _modules_naming_options(*BACKEND_PACKAGES) == set(BACKEND_MODULES_NAMING_OPTIONS)


def test_a_new_option_touches_three_core_files_and_the_numerics():
    assert len(FILES_A_NEW_OPTION_TOUCHES) <= 4
    assert set(OPTION_MODULES) <= set(FILES_A_NEW_OPTION_TOUCHES)


def test_the_census_finds_a_planted_option(tmp_path):
    """A module that starts spelling an option (here as a kernel constexpr) is found; a docstring is not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text('"""round_before_weight in a docstring is not counted."""\n')
    (tmp_path / "pkg" / "k.py").write_text("def k(NORMALIZE_UNROUNDED):\n    return 0\n")
    assert _modules_naming_options("pkg", root=tmp_path) == {"pkg/k.py"}


# -- the table's facts, as everything reads them --------------------------------------------------

#: The rejection reasons docs and tests quote: the table must keep them exactly.
REASONS = {
    "round_before_weight": (
        "rounding order: round_before_weight=True (needs False: one rounding after the weight)"
    ),
    "normalize_unrounded": (
        "norm input: normalize_unrounded=True (needs False: this backend normalizes the residual rounded "
        "to the dtype)"
    ),
}


def _problem(**kw) -> Problem:
    base = dict(world_size=2, hidden_size=64, dtype="bfloat16", eps=1e-6, weight_offset=0.0, quant=None,
                scale_layout=None, max_tokens=8, normed_output=True, inplace=True, device_type="cpu",
                platform="cpu")  # fmt: skip
    return Problem(**{**base, **kw})


def test_reasons_are_exactly_the_quoted_ones():
    assert {n: o.reason for n, o in NORM_OPTIONS.items()} == REASONS
    bare = Capabilities(platforms={"cpu"})
    for name in NORM_OPTIONS:
        assert check_capabilities(bare, _problem(norm_options={name})) == (REASONS[name],)
        assert (
            check_capabilities(
                bare.model_copy(update={"norm_options": {name}}), _problem(norm_options={name})
            )
            == ()
        )
    assert check_capabilities(bare, _problem(norm_options=set(NORM_OPTIONS))) == tuple(REASONS.values())


def test_rmsnorm_fields_are_the_table():
    bools = [f.name for f in dataclasses.fields(RMSNorm) if f.type == "bool"]
    assert bools == list(NORM_OPTIONS)
    assert all(getattr(RMSNorm(), n) == o.default for n, o in NORM_OPTIONS.items())
    for name in NORM_OPTIONS:
        norm = RMSNorm(**{name: True})
        assert norm.options == {name}
        assert RMSNorm.with_options(norm.eps, norm.weight_offset, norm.options) == norm


@pytest.mark.parametrize("name", list(NORM_OPTIONS))
def test_every_option_is_a_keyword_of_the_reference_arithmetic(name):
    assert name in inspect.signature(add_rmsnorm).parameters


@pytest.mark.parametrize("name", list(NORM_OPTIONS))
def test_void_options_are_recorded_off(name):
    option = NORM_OPTIONS[name]
    for add_residual in (True, False):
        for dtype in ("bfloat16", "float16", "float32"):
            p = _problem(norm_options={name}, add_residual=add_residual, dtype=dtype)
            assert (name in p.norm_options) == (not option.is_void(add_residual, dtype))
    assert NORM_OPTIONS["normalize_unrounded"].is_void(False, "bfloat16")
    assert NORM_OPTIONS["normalize_unrounded"].is_void(True, "float32")
    assert not NORM_OPTIONS["round_before_weight"].is_void(False, "float32")


def test_an_op_records_void_options_off_and_agrees_on_each_option():
    import torch

    import arnorm
    from arnorm.op._args import build_problem
    from arnorm.registry._select import Preference, agreement_facts

    norm = RMSNorm(round_before_weight=True, normalize_unrounded=True)
    kw = dict(hidden_size=64, norm=norm, quant=None, scale_layout=None, max_tokens=8, normed_output=True,
              inplace=True, device=torch.device("cpu"))  # fmt: skip
    p = build_problem(1, dtype=torch.bfloat16, add_residual=True, **kw)
    assert p.norm_options == {"round_before_weight", "normalize_unrounded"}
    assert p.short().endswith("plain/round-before-weight/unrounded cpu")
    assert build_problem(1, dtype=torch.float32, add_residual=True, **kw).norm_options == {
        "round_before_weight"
    }
    assert build_problem(1, dtype=torch.bfloat16, add_residual=False, **kw).norm_options == {
        "round_before_weight"
    }
    facts = agreement_facts(p, Preference(None, "auto"), arnorm.Config(), {})
    assert "norm_options" not in facts
    assert {n: facts[n] for n in NORM_OPTIONS} == {"round_before_weight": True, "normalize_unrounded": True}


@pytest.mark.parametrize("name", list(NORM_OPTIONS))
def test_an_option_is_spelt_only_in_norm_options(name):
    """An option as a keyword of its own is refused; Capabilities's error names ``norm_options``
    (a plugin's descriptor meets it at discovery), and neither class reads an option as an attribute."""
    with pytest.raises(TypeError, match=name):
        _problem(**{name: True})
    with pytest.raises(ValueError, match=rf"{name}: True \(needs norm_options=\{{'{name}'\}}"):
        Capabilities(platforms={"cpu"}, **{name: True})
    assert not hasattr(_problem(norm_options={name}), name)
    assert not hasattr(Capabilities(platforms={"cpu"}, norm_options={name}), name)


def test_unknown_option_names_are_refused():
    with pytest.raises(ValueError, match="norm_options"):
        Capabilities(platforms={"cpu"}, norm_options={"round_after_weight"})
    with pytest.raises(ValueError, match="norm_options"):
        _problem(norm_options={"round_after_weight"})


def test_the_reference_serves_every_option():
    from arnorm.registry._builtin import arnorm_backends

    (spec,) = arnorm_backends()
    assert spec.capabilities.norm_options == set(NORM_OPTIONS)


def test_cli_explain_has_a_flag_per_option():
    from arnorm.cli._main import build_parser

    parser = build_parser()
    args = parser.parse_args(["explain", "--normalize-unrounded", "--round-before-weight"])
    assert all(getattr(args, n) for n in NORM_OPTIONS)


def test_fused_allreduce_norm_takes_each_option_by_name():
    import torch

    import arnorm

    x = torch.randn(2, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    out = arnorm.fused_allreduce_norm(x, x.clone(), w, group=arnorm.LOCAL, eps=1e-6, inplace=False,
                                      **dict.fromkeys(NORM_OPTIONS, True))  # fmt: skip
    h, y = add_rmsnorm(x, x, w, 1e-6, 0.0, **dict.fromkeys(NORM_OPTIONS, True))
    assert torch.equal(out.normed, y) and torch.equal(out.residual, h)
    with pytest.raises(arnorm.InvalidInputError, match="round_after_weight: not an argument"):
        arnorm.fused_allreduce_norm(x, x, w, group=arnorm.LOCAL, eps=1e-6, round_after_weight=True)
