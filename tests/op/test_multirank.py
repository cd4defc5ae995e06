"""Several gloo ranks on CPU: agreement, identical errors, the reference across ranks."""

from __future__ import annotations

import pytest

from arnorm.testing import run_ranks

import ranks_fixtures as rf

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world", [2, 4])
def test_reference_across_ranks_is_bitwise_the_contract(world):
    """Reference on 2 and 4 ranks: residual and normed equal the contract bit for bit on every rank."""
    results = run_ranks(world, rf.reference_matches, 5, 64, None, "reference")
    assert results == [("reference", True, True, True)] * world


def test_ranks_disagreeing_on_disable_end_in_the_same_choice():
    """One rank disables 'small': every rank skips it and picks the same next backend."""
    envs = [{}, {"ARNORM_DISABLE": "small"}, {}, {}]
    results = run_ranks(4, rf.choice_under_env, env=envs)
    assert [r[0] for r in results] == ["fast"] * 4
    assert len({r[1] for r in results}) == 1  # the same explanation text everywhere
    assert "rank 1: disabled: listed in ARNORM_DISABLE" in results[0][1]


def test_setup_failure_on_one_rank_falls_back_everywhere():
    """A backend whose workspace fails on rank 1 is dropped on all ranks, with that rank's reason."""
    results = run_ranks(2, rf.fallback_after_setup_failure)
    assert results[0] == results[1]
    backend, status, reasons = results[0]
    assert (backend, status) == ("reference", "setup_failed")
    assert any(r.startswith("rank 1: setup: RuntimeError: workspace allocation failed") for r in reasons), (
        reasons
    )


def test_strict_setup_failure_raises_the_same_error_on_every_rank():
    """Named strictly, a backend failing setup on one rank makes every rank raise the same error."""
    results = run_ranks(2, rf.error_under_env, "flaky")
    assert results[0] == results[1]
    assert results[0][0] == "BackendSetupError"
    assert "rank 1: setup: RuntimeError: workspace allocation failed" in results[0][1]


def test_ranks_with_different_arguments_raise_the_same_error():
    """Ranks building the op with different hidden sizes all raise, naming the field."""
    results = run_ranks(2, rf.mismatched_hidden)
    assert results[0] == results[1] and results[0].startswith("ranks disagree on hidden_size")


def test_bad_call_on_every_rank_leaves_the_collective_usable():
    """Bad calls raise before any collective; the next good call completes on both ranks."""
    results = run_ranks(2, rf.bad_call_then_good)
    assert results[0] == results[1]
    messages, ok = results[0]
    assert ok and len(messages) == 3


def test_ranks_with_different_backend_options_raise_the_same_error():
    """Backend settings (which may pick the collective) must match; otherwise all ranks raise."""
    results = run_ranks(2, rf.mismatched_exact_mode)
    assert results[0] == results[1]
    assert results[0].startswith(
        "ranks disagree on settings of fast (rank 0: settings of fast={'exact': False}"
    )


def test_check_calls_mode_raises_the_same_error_on_every_rank_and_keeps_ranks_paired():
    """ARNORM_CHECK_CALLS=1 turns divergent calls (token counts, a rank-local rejection) into one error."""
    results = run_ranks(2, rf.check_calls_catches_divergence)
    assert results[0] == results[1]
    messages, paired = results[0]
    assert all(m.startswith("calls: differ across ranks or were rejected (rank 0: call ") for m in messages)
    assert "hidden_states [3, 32] torch.float32 cpu" in messages[0] and "hidden_states [4, 32]" in messages[0]
    assert "rejected: hidden_states: dtype torch.float64" in messages[1]
    assert paired


def test_token_budgets_and_check_tokens_errors_are_agreed_across_ranks():
    """Which backend serves each token count is the same on every rank, whatever each rank answered."""
    results = run_ranks(2, rf.rank_dependent_token_budget)
    assert results[0] == results[1]
    served, status, reasons = results[0]
    assert served == ["uneven", "uneven"] + ["reference"] * 6
    assert status == "setup_failed" and any("rank 1" in r and "budget lookup failed" in r for r in reasons), (
        reasons
    )


def test_groups_smaller_than_world_need_their_cpu_group_and_say_so():
    """A device TP group without cpu_group, a group this rank is not in, a foreign twin: clear errors."""
    results = run_ranks(4, rf.group_safety)
    for rank, out in enumerate(results):
        assert out["no twin"].startswith(
            "cpu_group: missing for a gloo group of 2 of 4 ranks (needs cpu_group="
        )
        assert out["not a member"].startswith("tp_group: does not include this process"), out
        assert out["wrong twin"].startswith("cpu_group: does not include this process"), (rank, out)
        assert out["with twin"] == 2


def test_a_malformed_setting_on_one_rank_fails_every_rank_the_same_way():
    """A bad variable on rank 1 only: the same ConfigError everywhere, not a rank blocked in a collective."""
    results = run_ranks(2, rf.malformed_setting_on_one_rank, timeout=60)
    assert results[0] == results[1]
    assert "ARNORM_PROBE_TIMEOUT" in results[0] and results[0].startswith("rank 1: ")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_closed_or_dropped_op_lets_go_of_its_groups_at_once(backend):
    """close() drops every reference to the TP group and the op's private communicator (its gloo
    threads end); an op dropped without close() does the same at once, without the cyclic collector.
    A group kept alive until interpreter exit aborted `arnorm bench` under torchrun now and then."""
    results = run_ranks(2, rf.group_references, backend)
    for out in results:
        assert out == {
            "while open": 1, "threads while open": 2, "closed": 0, "threads after close": 0,
            "dropped": 0, "threads after drop": 0,
        }, out  # fmt: skip


def test_the_gloo_twin_of_a_device_group_lives_no_longer_than_its_world():
    """arnorm's gloo twin of a device group over WORLD is let go with that WORLD: after
    destroy_process_group() and a new init, the next op gets a new twin and the right result."""
    assert run_ranks(2, rf.twin_after_reinit) == [(True, True, True)] * 2


def test_ops_left_open_on_a_destroyed_group_are_closed_at_exit(tmp_path):
    """An op (or a one-call op) still open when the process exits, its group already destroyed, is
    closed by arnorm's exit handler: the group's gloo threads end before the interpreter shuts down
    (a group alive then can abort the process, see the test above)."""
    report = str(tmp_path / "threads")
    run_ranks(2, rf.ops_open_at_exit, report)
    assert [(tmp_path / f"threads.{r}").read_text() for r in range(2)] == ["0", "0"]


def test_a_backend_closes_before_the_op_lets_go_of_its_groups():
    """op.close() closes the backends first: a plugin's close() may still read comm.group."""
    assert run_ranks(2, rf.groups_seen_by_close) == [[True]] * 2
