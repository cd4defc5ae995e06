"""The entry point of the in-tree ``reference`` backend: it registers like any third-party plugin."""

from __future__ import annotations

from arnorm._formats import QUANT_FORMATS
from arnorm._norm import NORM_OPTIONS
from arnorm.registry._capabilities import Capabilities
from arnorm.registry._spec import BackendSpec, hookimpl

__all__ = ["arnorm_backends"]


@hookimpl
def arnorm_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="reference",
            priority=0,
            capabilities=Capabilities(
                platforms=frozenset({"cpu", "cuda", "rocm"}),
                quant=frozenset({"none", *QUANT_FORMATS}),
                # Its arithmetic is every option's definition.
                norm_options=frozenset(NORM_OPTIONS),
                strided_rows=True,
                residual_free=True,
                # Rank-order sum, elementwise steps, and for batch-invariant ops a statistic by
                # elementwise adds (arnorm._reference.mean_square_rows): nothing depends on T.
                batch_invariant=True,
                output_layouts=frozenset({"separate", "in_place"}),
            ),
            loader="arnorm._reference:ReferenceBackend",
            requires=("torch",),
            distribution="arnorm",
            install_hint="pip install arnorm",
            description="pure torch: all-gather + fp32 rank-order sum + add + RMSNorm + quant",
        )
    ]
