"""The conformance suite run on the in-tree reference and the out-of-tree example plugin."""

from __future__ import annotations

from arnorm.testing import ConformanceSuite


class TestReferenceConformance(ConformanceSuite):
    """The reference against itself: proves the suite's own plumbing at 1, 2 and 4 ranks."""

    backend = "reference"
    world_sizes = (1, 2, 4)


class TestExampleConformance(ConformanceSuite):
    """The example plugin from backends/arnorm-example, installed by CI."""

    backend = "example"
    world_sizes = (1, 2)
