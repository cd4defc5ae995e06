"""Descriptors of backends that pass or fail the conformance suite in one known way each."""

from arnorm.plugin import BackendSpec, Capabilities, hookimpl

CAPS = Capabilities(
    platforms=frozenset({"cpu", "cuda"}), dtypes=frozenset({"bfloat16"}), round_before_weight=True
)
MODULE = "arnorm_conformance_fixtures.backends"


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
    ]
