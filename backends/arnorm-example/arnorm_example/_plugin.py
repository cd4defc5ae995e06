"""The entry point: a cheap descriptor; the implementation loads only when probed."""

from arnorm.plugin import BackendSpec, Capabilities, hookimpl


@hookimpl
def arnorm_backends():
    return [
        BackendSpec(
            name="example",
            priority=10,
            capabilities=Capabilities(
                platforms=frozenset({"cpu", "cuda"}),
                dtypes=frozenset({"bfloat16", "float16", "float32"}),
                quant=frozenset({"none", "fp8_static", "fp8_per_token"}),
            ),
            loader="arnorm_example._backend:ExampleBackend",
            distribution="arnorm-example",
            description="all-reduce in fp32, then add + RMSNorm (+ fp8) compiled with torch.compile",
        )
    ]
