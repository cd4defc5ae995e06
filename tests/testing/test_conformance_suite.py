"""The conformance suite fails what it should fail and skips only what is merely ineligible here.

One pytest subprocess runs the suite against the fixture backends of tests/plugins/conformance
(``cf_*`` and the planted ``pl_*``), each wrong in one known way, found through their entry point
on PYTHONPATH; the outcome and message of every test are read from its JUnit XML report.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from suite_report import suite_report

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "plugins" / "conformance"

SUITES = """
from arnorm.testing import ConformanceSuite


class TestGood(ConformanceSuite):
    backend = "cf_good"
    world_sizes = (1, 2)


class TestUnrounded(ConformanceSuite):
    backend = "cf_unrounded"
    world_sizes = (2,)


class TestScaled(ConformanceSuite):
    backend = "cf_scaled"
    world_sizes = (1,)


class TestQuantOff(ConformanceSuite):
    backend = "cf_quant_off"
    world_sizes = (1,)


class TestBadImport(ConformanceSuite):
    backend = "cf_bad_import"
    world_sizes = (1,)


class TestProbeRaises(ConformanceSuite):
    backend = "cf_probe_raises"
    world_sizes = (1,)


class TestCreateFails(ConformanceSuite):
    backend = "cf_create_fails"
    world_sizes = (1,)


class TestIncompatible(ConformanceSuite):
    backend = "cf_incompatible"
    world_sizes = (1,)


class TestIncompatibleRequired(ConformanceSuite):
    backend = "cf_incompatible"
    world_sizes = (1,)
    require = True


class TestNotInstalled(ConformanceSuite):
    backend = "cf_not_installed"
    world_sizes = (1,)


class TestNotInstalledRequired(ConformanceSuite):
    backend = "cf_not_installed"
    world_sizes = (1,)
    require = True


class TestUnregistered(ConformanceSuite):
    backend = "cf_no_such_backend"
    world_sizes = (1,)


class TestPlantedCorrect(ConformanceSuite):
    backend = "pl_correct"
    world_sizes = (1,)


class TestWritesInput(ConformanceSuite):
    backend = "pl_writes_input"
    world_sizes = (1,)


class TestContiguousRows(ConformanceSuite):
    backend = "pl_contiguous_rows"
    world_sizes = (1,)


class TestWritesPacked(ConformanceSuite):
    backend = "pl_writes_packed"
    world_sizes = (1,)


class TestQuantizesResidual(ConformanceSuite):
    backend = "pl_quantizes_residual"
    world_sizes = (1,)


class TestReturnsTuple(ConformanceSuite):
    backend = "pl_returns_tuple"
    world_sizes = (1,)


class TestReturnsNone(ConformanceSuite):
    backend = "pl_returns_none"
    world_sizes = (1,)


class TestUndeclaredWorld(ConformanceSuite):
    backend = "pl_only_four_ranks"
    world_sizes = (1, 2)


class TestIgnoresOut(ConformanceSuite):
    backend = "pl_ignores_out"
    world_sizes = (1,)


class TestUndeclaredWorldRequired(ConformanceSuite):
    backend = "pl_only_four_ranks"
    world_sizes = (1, 2)
    require = True


class TestInvariant(ConformanceSuite):
    backend = "pl_invariant"
    world_sizes = (1, 2)


class TestSizeGated(ConformanceSuite):
    backend = "pl_size_gated"
    world_sizes = (1, 2)


class TestInPlace(ConformanceSuite):
    backend = "pl_in_place"
    world_sizes = (1, 2)


class TestSeparateInPlace(ConformanceSuite):
    backend = "pl_separate_in_place"
    world_sizes = (1,)
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """``{"TestClass.test_name[param]": (outcome, message)}`` from one run of SUITES."""
    return suite_report(tmp_path_factory.mktemp("suite"), SUITES, {}, [str(FIXTURES)])


def _outcomes(report, cls: str) -> dict[str, str]:
    return {k.split(".", 1)[1]: v[0] for k, v in report.items() if k.startswith(cls + ".")}


def _message(report, key: str) -> str:
    return report[key][1]


def _failed_cases(message: str) -> set[str]:
    """The ids of the cases a test_matches_reference failure lists (its lines ``<case id>: ...``)."""
    return {line.split(": ", 1)[0] for line in message.splitlines() if line.startswith("bfloat16-")}


def test_correct_backend_passes_on_one_and_two_ranks(report):
    """A correct backend passes every test at its world sizes; undeclared world sizes skip."""
    assert _outcomes(report, "TestGood") == {
        "test_declares_and_loads": "passed",
        "test_matches_reference[1]": "passed",
        "test_matches_reference[2]": "passed",
        "test_matches_reference[4]": "skipped",
        "test_bad_inputs_raise_everywhere_and_leave_op_usable": "passed",
        # cf_good does not declare batch_invariant: nothing to check.
        "test_batch_invariant[1]": "skipped",
        "test_batch_invariant[2]": "skipped",
        "test_batch_invariant[4]": "skipped",
    }, report


def test_unrounded_sum_fails_with_element_error_and_the_rounding_hint(report):
    """Skipping the first rounding fails at 2 ranks; the message has ulps, |err|, the element and the hint."""
    outcome, message = report["TestUnrounded.test_matches_reference[2]"]
    assert outcome == "failed", message
    assert "residual: " in message and " ulp off at [" in message, message
    assert "(got " in message and ", expected " in message and "|err| " in message, message
    assert "round the reduced sum to the dtype before the residual add" in message, message


def test_wrong_normed_values_fail_with_ulps_abs_error_and_element(report):
    """A normed output 3% off fails, naming the worst element's ulps, values and absolute error."""
    outcome, message = report["TestScaled.test_matches_reference[1]"]
    assert outcome == "failed", message
    assert "normed: " in message and " ulp off at [" in message and "allowed 1 ulp" in message, message
    assert "|err| " in message and "max |err| " in message and "elements differ" in message, message
    assert report["TestScaled.test_bad_inputs_raise_everywhere_and_leave_op_usable"][0] == "failed"


def test_wrong_quant_codes_fail_with_the_code_and_element(report):
    """Codes that are not arnorm.quant of the backend's own normed output fail with the worst code."""
    outcome, message = report["TestQuantOff.test_matches_reference[1]"]
    assert outcome == "failed", message
    assert "quant codes: " in message and "step(s) off at [" in message and "got code 0x" in message, message
    assert "quant scales differ from arnorm.quant's: " in message and "first at [" in message, message


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        ("TestBadImport", "import: ImportError: arnorm_conformance_fixtures: compiled for another torch"),
        ("TestProbeRaises", "probe: raised RuntimeError: probe crashed while reading the topology"),
        ("TestCreateFails", "setup_failed: "),
    ],
)
def test_broken_backend_is_a_failure_not_a_skip(report, cls, expected):
    """A module that fails to import, a probe that raises or a create() that fails fails the suite."""
    outcome, message = report[f"{cls}.test_matches_reference[1]"]
    assert outcome == "failed" and expected in message, message
    assert report[f"{cls}.test_bad_inputs_raise_everywhere_and_leave_op_usable"][0] == "failed"
    # (test_batch_invariant skips them: they do not declare the property.)
    outcomes = _outcomes(report, cls).items()
    assert "skipped" not in {o for k, o in outcomes if k.endswith("[1]") and "batch_invariant" not in k}


def test_import_failure_fails_the_load_test_too(report):
    """test_declares_and_loads imports the backend class and fails with the import error."""
    outcome, message = report["TestBadImport.test_declares_and_loads"]
    assert outcome == "failed", message
    assert "ImportError" in message and "compiled for another torch" in message, message


def test_incompatible_backend_skips_with_its_reason(report):
    """A backend merely ineligible here skips, and the skip message carries the probe's reason."""
    outcome, message = report["TestIncompatible.test_matches_reference[1]"]
    assert outcome == "skipped", message
    assert "topology: this machine (needs one that does not exist)" in message, message
    assert report["TestIncompatible.test_bad_inputs_raise_everywhere_and_leave_op_usable"][0] == "skipped"


def test_not_installed_backend_skips_with_the_fix(report):
    """A backend whose requirement is missing skips every test with the install command."""
    outcomes = _outcomes(report, "TestNotInstalled")
    assert set(outcomes.values()) == {"skipped"}, outcomes
    assert "pip install 'arnorm[nothing]'" in _message(report, "TestNotInstalled.test_declares_and_loads")


@pytest.mark.parametrize("cls", ["TestIncompatibleRequired", "TestNotInstalledRequired"])
def test_required_backend_fails_instead_of_skipping(report, cls):
    """With require = True, an absent or ineligible backend fails, saying that it must run here."""
    outcome, message = report[f"{cls}.test_matches_reference[1]"]
    assert outcome == "failed" and "require = True: it must run here" in message, message


def test_unregistered_backend_fails(report):
    """A misspelt or uninstalled backend name fails (it is not silently skipped)."""
    outcome, message = report["TestUnregistered.test_declares_and_loads"]
    assert outcome == "failed" and "'cf_no_such_backend' is not registered" in message, message


def test_planted_base_passes_every_variant(report):
    """The planted backends' correct base passes, with its not-in-place, no-normed and strided cases."""
    outcomes = _outcomes(report, "TestPlantedCorrect")
    assert outcomes["test_matches_reference[1]"] == "passed", report[
        "TestPlantedCorrect.test_matches_reference[1]"
    ]
    assert outcomes["test_bad_inputs_raise_everywhere_and_leave_op_usable"] == "passed", outcomes


def test_writing_hidden_states_of_an_op_not_in_place_fails(report):
    """A backend that writes the new residual into hidden_states on an inplace=False op fails (both
    inplace=False cases: with and without out=)."""
    outcome, message = report["TestWritesInput.test_matches_reference[1]"]
    assert outcome == "failed", message
    cases = _failed_cases(message)
    assert cases and all("-not-inplace" in c for c in cases), message
    assert {c.endswith("-out") for c in cases} == {True, False}, message  # with and without out=
    assert (
        "hidden_states: written by the call (needs it unchanged: the op was built with inplace=False)"
        in message
    )
    assert "Output.residual: hidden_states' memory (needs a new tensor" in message, message


def test_reading_strided_rows_as_contiguous_fails(report):
    """A backend declaring strided_rows that reads rows as if contiguous fails the strided case."""
    outcome, message = report["TestContiguousRows.test_matches_reference[1]"]
    assert outcome == "failed", message
    assert "-strided: residual: " in message and " ulp off at [" in message, message
    assert "(hint: read row i of hidden_states and residual at i * stride(0), not i * H)" in message
    assert {c.rsplit("-", 1)[1] for c in _failed_cases(message)} == {"strided"}, message


def test_writing_strided_rows_as_packed_fails(report):
    """Writing a strided hidden_states as packed rows fails: the padding of its buffer was written."""
    outcome, message = report["TestWritesPacked.test_matches_reference[1]"]
    assert outcome == "failed", message
    assert "-strided: hidden_states: written past its [" in message, message
    assert "(row stride " in message and "needs only the view's elements written)" in message, message
    assert {c.rsplit("-", 1)[1] for c in _failed_cases(message)} == {"strided"}, message


def test_quant_of_an_op_without_normed_output_is_judged(report):
    """A backend whose quant output is wrong only when built with normed_output=False fails."""
    outcome, message = report["TestQuantizesResidual.test_matches_reference[1]"]
    assert outcome == "failed", message
    assert "-no-normed-output: quant codes: " in message and "step(s) off at [" in message, message
    assert _failed_cases(message) and all(c.endswith("-no-normed-output") for c in _failed_cases(message))


@pytest.mark.parametrize(
    ("cls", "found"), [("TestReturnsTuple", "a tuple of 3 items"), ("TestReturnsNone", "None")]
)
def test_a_call_returning_something_else_than_an_output_fails_clearly(report, cls, found):
    """A __call__ returning a tuple or None fails naming the backend, what it returned and what it must
    (the op's own check of a backend's first result per token count raises it: issue 41, item 4)."""
    outcome, message = report[f"{cls}.test_matches_reference[1]"]
    backend = {"TestReturnsTuple": "pl_returns_tuple", "TestReturnsNone": "pl_returns_none"}[cls]
    assert outcome == "failed", message
    assert f"BackendBrokenError: backend {backend!r}: its call for " in message, message
    assert f" tokens returned {found} " in message, message
    assert "(needs an arnorm.plugin.Output(normed, residual, quant))" in message, message
    assert "AttributeError" not in message, message


def test_undeclared_world_sizes_skip_and_fail_with_require(report):
    """World sizes the backend does not declare skip, and with require = True they fail instead."""
    for world in (1, 2):
        outcome, message = report[f"TestUndeclaredWorld.test_matches_reference[{world}]"]
        assert outcome == "skipped" and f"world size {world} is not declared (declares [4])" in message
        outcome, message = report[f"TestUndeclaredWorldRequired.test_matches_reference[{world}]"]
        assert outcome == "failed", message
        assert f"world size {world} is not declared (declares [4])" in message, message
        assert "require = True: it must run here" in message, message
    key = "TestUndeclaredWorldRequired.test_bad_inputs_raise_everywhere_and_leave_op_usable"
    assert report[key][0] == "failed", report[key]
    assert report["TestUndeclaredWorldRequired.test_declares_and_loads"][0] == "passed"


def test_a_backend_declaring_caller_outputs_that_ignores_out_fails(report):
    """Every backend is called with out= once; one that declares caller_outputs and returns new
    tensors fails that case, naming the buffer (the core's check raises in the call), and only it."""
    outcome, message = report["TestIgnoresOut.test_matches_reference[1]"]
    assert outcome == "failed", message
    assert "-not-inplace-out: the call raised" in message and "out.normed" in message, message
    assert "pl_ignores_out" in message, message
    assert {c.rsplit("-", 1)[1] for c in _failed_cases(message)} == {"out"}, message


def test_declared_batch_invariance_that_holds_passes(report):
    """A backend that declares batch_invariant and keeps it passes at 1 and 2 ranks."""
    outcomes = _outcomes(report, "TestInvariant")
    for world in (1, 2):
        key = f"test_batch_invariant[{world}]"
        assert outcomes[key] == "passed", report[f"TestInvariant.{key}"]
    assert outcomes["test_batch_invariant[4]"] == "skipped"


@pytest.mark.parametrize("world", [1, 2])
def test_declared_batch_invariance_that_breaks_above_a_size_fails(report, world):
    """A backend that declares batch_invariant but switches kernels above 64 tokens (its statistic then
    over the unrounded sum: within the contract's 1 ulp, so test_matches_reference cannot see it)
    fails, naming the batch size, the output, the row and the bits."""
    outcome, message = report[f"TestSizeGated.test_batch_invariant[{world}]"]
    assert outcome == "failed", message
    assert "is not batch invariant" in message, message
    assert "T=128: normed of " in message and "T=129: normed of " in message, message
    assert "T=7:" not in message and "T=1:" not in message, message
    assert "differs from the row computed alone" in message and "in the batch" in message, message
    assert "T=128: residual" not in message, message
    # The contract check alone cannot see it: every call is within 1 ulp of the reference.
    assert report[f"TestSizeGated.test_matches_reference[{world}]"][0] == "passed"


def test_a_backend_writing_the_in_place_layout_passes(report):
    """A backend declaring the in-place output layout and writing it passes every case."""
    outcomes = _outcomes(report, "TestInPlace")
    assert outcomes["test_matches_reference[1]"] == "passed", report["TestInPlace.test_matches_reference[1]"]
    assert outcomes["test_matches_reference[2]"] == "passed", report["TestInPlace.test_matches_reference[2]"]


def test_declaring_the_in_place_layout_and_writing_separate_outputs_fails(report):
    """A backend declaring the in-place layout that returns new tensors fails its in-place cases,
    and only those."""
    outcome, message = report["TestSeparateInPlace.test_matches_reference[1]"]
    assert outcome == "failed", message
    cases = _failed_cases(message)
    assert cases and all("-in-place" in c for c in cases), message
    assert "Output.residual: not residual itself (needs the new residual written over residual" in message
    assert "Output.normed: not hidden_states itself (needs the normed output written over" in message
