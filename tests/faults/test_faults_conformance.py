"""The conformance suite catches what the op cannot (issue 41, item 4): a backend that writes inputs
it does not own (the caller's residual, its weight), one that skips its collective on one rank, and
one that declares batch_invariant and is not. One pytest subprocess runs the suite against the
planted backends of faults_conformance.py (served through an entry point written here); each test
reads its outcome and message from the JUnit XML report.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from suite_report import suite_report

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PLANTED = {
    "arnorm_faults_conformance-0.1.dist-info/METADATA": (
        "Metadata-Version: 2.1\nName: arnorm-faults-conformance\nVersion: 0.1\n"
    ),
    "arnorm_faults_conformance-0.1.dist-info/entry_points.txt": (
        "[arnorm.backends]\nfaults_conformance = faults_conformance\n"
    ),
}
SUITES = """
from arnorm.testing import ConformanceSuite


class TestWritesResidual(ConformanceSuite):
    backend = "fc_writes_residual"
    world_sizes = (1,)


class TestWritesWeight(ConformanceSuite):
    backend = "fc_writes_weight"
    world_sizes = (1,)


class TestSkipsOnRankOne(ConformanceSuite):
    backend = "fc_skips_on_one"
    world_sizes = (2,)
    timeout = 240.0


class TestNotInvariant(ConformanceSuite):
    backend = "fc_not_invariant"
    world_sizes = (1,)
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("suite")
    paths = [str(HERE), str(HERE.parent / "plugins" / "conformance")]
    return suite_report(root, SUITES, PLANTED, paths, "matches_reference or batch_invariant")


@pytest.mark.parametrize(("cls", "says"), [
    ("TestWritesResidual", "residual: written by the call (needs it unchanged"),
    ("TestWritesWeight", "weight: written by the call (needs it unchanged)"),
])  # fmt: skip
def test_a_backend_writing_an_input_it_does_not_own_fails(report, cls, says):
    outcome, message = report[f"{cls}.test_matches_reference[1]"]
    assert outcome == "failed" and says in message, message


def test_a_backend_skipping_its_collective_on_one_rank_fails_naming_it(report):
    outcome, message = report["TestSkipsOnRankOne.test_matches_reference[2]"]
    assert outcome == "failed", message
    assert "skipped its collective" in message and "rank 1" in message, message


def test_a_backend_declaring_batch_invariance_it_lacks_fails(report):
    outcome, message = report["TestNotInvariant.test_batch_invariant[1]"]
    assert outcome == "failed", message
