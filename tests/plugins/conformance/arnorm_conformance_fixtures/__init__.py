"""Descriptors of backends that pass or fail the conformance suite in one known way each."""

from arnorm.plugin import BackendSpec, Capabilities, hookimpl

CAPS = Capabilities(
    platforms=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"bfloat16"}),
    norm_options=frozenset({"round_before_weight"}),
)
MODULE = "arnorm_conformance_fixtures.backends"
PLANTED = "arnorm_conformance_fixtures.planted"
#: Capabilities of the planted backends: bf16, no quant, any world size, unless a backend widens them.
PLANTED_CAPS = Capabilities(platforms=frozenset({"cpu", "cuda"}), dtypes=frozenset({"bfloat16"}))
INVARIANT_QUANT = frozenset({"none", "fp8_per_token"})
BOTH = frozenset({"separate", "in_place"})


def _spec(name: str, cls: str, caps: Capabilities = CAPS, module: str = MODULE, **kw) -> BackendSpec:
    # Priority below the reference's: auto mode never picks these in the process that discovers them.
    return BackendSpec(name=name, priority=-100, capabilities=caps, loader=f"{module}:{cls}", **kw)


@hookimpl
def arnorm_backends():
    return [
        _spec("cf_good", "Good"),
        _spec("cf_unrounded", "Unrounded"),
        _spec("cf_scaled", "Scaled"),
        _spec("cf_quant_off", "QuantOff", CAPS.model_copy(update={"quant": frozenset({"fp8_per_token"})})),
        _spec("cf_bad_import", "BadImport", module="arnorm_conformance_fixtures.broken_import"),
        _spec("cf_probe_raises", "ProbeRaises"),
        _spec("cf_create_fails", "CreateFails"),
        _spec("cf_incompatible", "Incompatible"),
        _spec("cf_not_installed", "Good", requires=("arnorm_conformance_no_such_module",), extra="nothing"),
        *_planted_specs(),
    ]


def _planted(name: str, cls: str, **caps: object) -> BackendSpec:
    return _spec(name, cls, PLANTED_CAPS.model_copy(update=caps), PLANTED)


def _planted_specs() -> list[BackendSpec]:
    """The backends of :mod:`.planted`, one planted bug each."""
    return [
        _planted("pl_correct", "Planted", quant=frozenset({"none", "fp8_per_token"}), strided_rows=True),
        _planted("pl_writes_input", "WritesInput"),
        _planted("pl_contiguous_rows", "ContiguousRows", strided_rows=True),
        _planted("pl_writes_packed", "WritesPacked", strided_rows=True),
        _planted("pl_quantizes_residual", "QuantizesResidual", quant=frozenset({"none", "fp8_per_token"})),
        _planted("pl_returns_tuple", "ReturnsTuple"),
        _planted("pl_returns_none", "ReturnsNone"),
        _planted("pl_only_four_ranks", "OnlyFourRanks", world_sizes=frozenset({4})),
        _planted("pl_ignores_out", "IgnoresOut", caller_outputs=True),
        _planted("pl_invariant", "Invariant", quant=INVARIANT_QUANT, batch_invariant=True),
        _planted("pl_size_gated", "SizeGated", batch_invariant=True),
        _planted("pl_in_place", "InPlace", quant=frozenset({"none", "fp8_per_token"}), output_layouts=BOTH),
        _planted(
            "pl_separate_in_place",
            "SeparateInPlace",
            quant=frozenset({"none", "fp8_per_token"}),
            output_layouts=BOTH,
        ),
    ]
