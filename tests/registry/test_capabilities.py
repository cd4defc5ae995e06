"""Static capability checks and their reason grammar."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arnorm import Capabilities
from arnorm._problem import Problem
from arnorm.registry._capabilities import check_capabilities

GRAMMAR = re.compile(r"^[a-z][a-z0-9 _.-]*: .+ \(needs .+\)$")


def problem(**kw) -> Problem:
    base = dict(
        world_size=2,
        hidden_size=4096,
        dtype="bfloat16",
        eps=1e-6,
        weight_offset=0.0,
        quant=None,
        scale_layout=None,
        max_tokens=8192,
        normed_output=True,
        inplace=True,
        device_type="cuda",
        platform="cuda",
        arch=(9, 0),
    )
    base.update(kw)
    return Problem(**base)


FI = Capabilities(
    platforms={"cuda"},
    dtypes={"bfloat16", "float16"},
    quant={"none", "fp8_static", "nvfp4"},
    world_sizes={2, 4, 8, 16},
    min_arch=(9, 0),
    quant_min_arch={"nvfp4": (10, 0)},
    hidden_multiple=8,
    max_hidden=16384,
    scale_layouts={"swizzled_128x4"},
)


def test_eligible_problem_has_no_reasons():
    """A problem inside every declared set passes."""
    assert check_capabilities(FI, problem()) == ()


def test_each_aspect_has_its_reason():
    """Every aspect outside the declaration gives exactly the documented reason."""
    cases = {
        "platform: cpu (needs cuda)": problem(platform="cpu", device_type="cpu", arch=None),
        "dtype: float32 (needs bfloat16 or float16)": problem(dtype="float32"),
        "quant: mxfp8 (needs fp8_static, none or nvfp4)": problem(quant="mxfp8", scale_layout="linear"),
        "world size: 3 (needs 2, 4, 8 or 16)": problem(world_size=3),
        "compute capability: 8.0 (needs >= 9.0)": problem(arch=(8, 0)),
        "compute capability: 9.0 (needs >= 10.0 for nvfp4)": problem(
            quant="nvfp4", scale_layout="swizzled_128x4"
        ),
        "hidden size: 4100 (needs a multiple of 8)": problem(hidden_size=4100),
        "hidden size: 32768 (needs <= 16384)": problem(hidden_size=32768),
        "scale layout: linear (needs swizzled_128x4)": problem(
            quant="nvfp4", scale_layout="linear", arch=(10, 0)
        ),
    }
    for reason, p in cases.items():
        assert reason in check_capabilities(FI, p), (reason, check_capabilities(FI, p))


def test_normalize_unrounded_is_declared_or_rejected():
    """RMSNorm(normalize_unrounded=True) is served only by a backend that declares it; the reason
    names the setting and the arithmetic the backend has instead."""
    p = problem(norm_options={"normalize_unrounded"})
    (reason,) = check_capabilities(FI, p)
    assert reason.startswith("norm input: normalize_unrounded=True (needs False")
    assert GRAMMAR.match(reason)
    assert check_capabilities(FI.model_copy(update={"norm_options": {"normalize_unrounded"}}), p) == ()
    # With no residual add the two arithmetics are one: nothing to reject.
    assert check_capabilities(FI, problem(norm_options={"normalize_unrounded"}, add_residual=False)) == ()


def test_builtin_declarations_of_normalize_unrounded():
    """reference, triton and triton_symm normalize the unrounded sum; FlashInfer's fused kernel and
    AITER's backend (its 2-stage and fp8 paths read the rounded sum) do not declare it."""
    from arnorm.registry._builtin import arnorm_backends
    from arnorm_aiter._plugin import CAPABILITIES as AITER
    from arnorm_flashinfer._plugin import CAPABILITIES as FLASHINFER
    from arnorm_triton._plugin import CAPABILITIES as TRITON
    from arnorm_triton.symm._plugin import CAPABILITIES as SYMM

    (reference,) = arnorm_backends()

    def serves(caps):
        return "normalize_unrounded" in caps.norm_options

    assert serves(reference.capabilities) and serves(TRITON) and serves(SYMM)
    assert not serves(FLASHINFER) and not serves(AITER)


@given(
    ws=st.integers(1, 64),
    h=st.integers(1, 40000),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    arch=st.tuples(st.integers(7, 12), st.integers(0, 9)),
)
def test_every_reason_follows_the_grammar(ws, h, dtype, arch):
    """Whatever the problem, each reason reads '<aspect>: <found> (needs <required>)'."""
    for r in check_capabilities(FI, problem(world_size=ws, hidden_size=h, dtype=dtype, arch=arch)):
        assert GRAMMAR.match(r), r


def test_capabilities_are_frozen_and_hashable():
    """Capabilities can key a cache; mutation is refused."""
    import pydantic
    import pytest

    assert hash(FI) == hash(FI.model_copy())
    with pytest.raises(pydantic.ValidationError):
        FI.hidden_multiple = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"world_sizes": {1, 2}, "min_world_size": 4},
         "world_sizes: [1, 2] all below min_world_size 4 (needs one size >= min_world_size"),
        ({"quant_dtypes": {"nvfp4": {"bfloat16"}}}, "quant_dtypes: nvfp4 (needs formats in quant, ['none'])"),
        ({"quant": {"nvfp4"}, "dtypes": {"bfloat16"}, "quant_dtypes": {"nvfp4": {"float16"}}},
         "quant_dtypes['nvfp4']: ['float16'] (needs a subset of dtypes, ['bfloat16'])"),
        ({"dtypes": set()}, "dtypes: empty (needs at least one value"),
        ({"min_hidden": 512, "max_hidden": 256}, "max_hidden: 256 (needs >= min_hidden 512)"),
    ],
)  # fmt: skip
def test_contradictory_capabilities_are_refused_where_declared(fields, reason):
    """Fields that contradict each other (a backend never choosable, or declaring what it does not
    serve) are refused at construction, and a plugin's failure says so on one line."""
    from pydantic import ValidationError

    from arnorm.registry._failure import plugin_failure

    with pytest.raises(ValidationError) as err:
        Capabilities(platforms=frozenset({"cpu"}), **fields)
    assert plugin_failure(err.value).startswith("Capabilities: " + reason), plugin_failure(err.value)


def test_a_misspelt_or_malformed_field_is_one_line_with_the_fix():
    """A typo names the valid fields; a bad value says what is needed (no multi-line pydantic text)."""
    from pydantic import ValidationError

    from arnorm.registry._failure import plugin_failure

    with pytest.raises(ValidationError) as err:
        Capabilities(platforms=frozenset({"cpu"}), platfrms=1)  # type: ignore[call-arg]
    assert plugin_failure(err.value).startswith(
        "Capabilities.platfrms: not a field (needs one of: platforms, "
    )
    with pytest.raises(ValidationError) as err:
        Capabilities(platforms=frozenset({"cpu"}), min_hidden="x")  # type: ignore[arg-type]
    assert plugin_failure(err.value) == "Capabilities.min_hidden: 'x' (needs an integer)"
