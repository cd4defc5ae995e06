"""The entry point's target: the backend's descriptor.

arnorm imports this module when it discovers plugins, in every process that builds an op, so it
imports neither torch nor any kernel; the class in ``_backend.py`` is loaded by name only when
the backend may serve an op.
"""

from pydantic import Field

from arnorm.plugin import BackendSettings, BackendSpec, Capabilities, hookimpl


class ExampleSettings(BackendSettings):
    """``ARNORM_EXAMPLE_*``: read from the environment, agreed across ranks, handed to ``create``."""

    compile: bool = Field(
        default=True,
        description="Compile the norm with torch.compile on GPUs (ARNORM_EXAMPLE_COMPILE=0: eager).",
    )


@hookimpl
def arnorm_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="example",
            # Auto mode tries higher priorities first: below triton (100), above the reference (0).
            priority=10,
            # Checked against every op before the class is imported: a mismatch becomes a reason
            # such as "quant: nvfp4 (needs fp8_per_token, fp8_static or none)". A field left out
            # declares its default (every dtype, any world size and hidden size).
            capabilities=Capabilities(
                platforms=frozenset({"cpu", "cuda"}),
                quant=frozenset({"none", "fp8_static", "fp8_per_token"}),
                # The options of RMSNorm this backend computes, by name (arnorm.plugin.NORM_OPTIONS
                # lists them). The reference arithmetic serves every option, so an example built on
                # it could declare them all; it declares one to show the spelling.
                norm_options=frozenset({"round_before_weight"}),
            ),
            loader="arnorm_example._backend:ExampleBackend",
            distribution="arnorm-example",
            settings=ExampleSettings,
            description="all-reduce in fp32, then add + RMSNorm (+ fp8) compiled with torch.compile",
        )
    ]
