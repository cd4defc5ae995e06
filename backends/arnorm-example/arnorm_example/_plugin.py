"""The entry point: a cheap descriptor; the implementation loads only when probed."""

from pydantic import Field

from arnorm.plugin import BackendSettings, BackendSpec, Capabilities, hookimpl


class ExampleSettings(BackendSettings):
    """``ARNORM_EXAMPLE_*``: read from the environment, agreed across ranks, handed to ``create``."""

    compile: bool = Field(
        default=True,
        description="Compile the norm with torch.compile on GPUs (ARNORM_EXAMPLE_COMPILE=0: eager).",
    )


@hookimpl
def arnorm_backends():
    return [
        BackendSpec(
            name="example",
            priority=10,
            capabilities=Capabilities(
                platforms=frozenset({"cpu", "cuda"}),
                quant=frozenset({"none", "fp8_static", "fp8_per_token"}),
                round_before_weight=True,
            ),
            loader="arnorm_example._backend:ExampleBackend",
            distribution="arnorm-example",
            settings=ExampleSettings,
            description="all-reduce in fp32, then add + RMSNorm (+ fp8) compiled with torch.compile",
        )
    ]
