"""Config(batch_invariant=True) / ARNORM_BATCH_INVARIANT: only declaring backends are selected, one per
op, with the reasons in explain; construction says when nothing can keep the guarantee."""

from __future__ import annotations

import pytest
import torch

import arnorm
from arnorm.plugin import Capabilities
from arnorm.registry._capabilities import BATCH_INVARIANCE_REASON

CPU_INV = Capabilities(platforms=frozenset({"cpu", "cuda"}), batch_invariant=True)


def _install():
    import fake_backends as fb

    return fb.install(
        fb.spec("fast", 50, "AllReduceBackend"),
        fb.spec("small", 60, "SmallBackend", caps=CPU_INV),
        fb.spec("inv", 40, "AllReduceBackend", caps=CPU_INV),
    )


def _op(max_tokens: int = 8, **kw) -> arnorm.AllReduceNorm:
    return arnorm.AllReduceNorm(arnorm.LOCAL, hidden_size=64, dtype=torch.bfloat16, norm=arnorm.RMSNorm(),
                                max_tokens=max_tokens, device="cpu", **kw)  # fmt: skip


def test_off_by_default_and_read_from_the_environment(clean_env):
    assert arnorm.Config().batch_invariant is False
    clean_env.setenv("ARNORM_BATCH_INVARIANT", "1")
    assert arnorm.Config().batch_invariant is True
    clean_env.setenv("ARNORM_BATCH_INVARIANT", "maybe")
    with pytest.raises(arnorm.ConfigError, match=r"ARNORM_BATCH_INVARIANT: 'maybe' \(needs a boolean"):
        arnorm.Config()


def test_default_mode_chains_backends_by_priority(clean_env):
    _install()
    op = _op()
    assert op.explain().chain == ("small", "fast")
    assert not op.problem.batch_invariant


def test_only_declaring_backends_serve_and_one_serves_the_whole_table(clean_env):
    """fast does not declare; small declares but serves 4 of 8 token counts, and a second backend
    above it might round differently: inv serves every count alone."""
    _install()
    op = _op(config=arnorm.Config(batch_invariant=True))
    expl = op.explain()
    assert expl.chain == ("inv",)
    assert op.problem.batch_invariant and "batch-invariant" in op.problem.short()
    assert expl.verdict("fast").status == "incompatible"
    assert expl.verdict("fast").reasons == (BATCH_INVARIANCE_REASON,)
    assert BATCH_INVARIANCE_REASON == (
        "batch invariance: not declared (needs batch_invariant=True in Capabilities, asked by "
        "ARNORM_BATCH_INVARIANT)"
    )
    small = expl.verdict("small")
    assert small.status == "setup_failed"
    assert small.reasons[0].startswith("tokens: serves 1 to 4 of 1 to 8 (needs every count: batch invariance")
    assert "batch invariance: not declared" in str(expl)
    # The reference of this fake registry does not declare either.
    assert expl.verdict("reference").reasons == (BATCH_INVARIANCE_REASON,)


def test_the_environment_switch_is_the_same_switch(clean_env):
    _install()
    clean_env.setenv("ARNORM_BATCH_INVARIANT", "1")
    assert _op().explain().chain == ("inv",)


def test_nothing_declaring_is_a_clear_construction_error(clean_env):
    import fake_backends as fb

    fb.install(fb.spec("fast", 50, "AllReduceBackend"))
    with pytest.raises(arnorm.NoEligibleBackendError) as err:
        _op(config=arnorm.Config(batch_invariant=True))
    text = str(err.value)
    assert "batch-invariant" in text and BATCH_INVARIANCE_REASON in text, text
    assert "leave it off (ARNORM_BATCH_INVARIANT / Config.batch_invariant)" in text, text
    with pytest.raises(arnorm.NoEligibleBackendError) as err:
        _op(backend="fast", config=arnorm.Config(batch_invariant=True))
    assert "leave batch invariance off (ARNORM_BATCH_INVARIANT / Config.batch_invariant)" in str(err.value)


def test_in_tree_declarations(clean_env):
    """reference, triton and triton_symm declare; flashinfer and aiter do not (docs/numerics.md says why)."""
    declared = {i.name: i.spec.capabilities.batch_invariant for i in arnorm.backends() if i.spec is not None}
    assert declared["reference"] and declared["triton"] and declared["triton_symm"]
    assert declared.get("flashinfer") is not True and declared.get("aiter") is not True


def test_reference_serves_a_batch_invariant_op_with_its_elementwise_statistic(clean_env):
    """Rows of 40000 elements: torch's CPU mean splits a lone row over threads (not 2+ rows), the
    reference's invariant statistic does not."""
    from arnorm._reference import add_rmsnorm

    g = torch.Generator().manual_seed(0)
    h = 40000
    x = torch.randn(9, h, generator=g).to(torch.bfloat16)
    w = torch.ones(h, dtype=torch.bfloat16)
    _, batch = add_rmsnorm(x, None, w, 1e-6, 0.0, batch_invariant=True)
    rows = [add_rmsnorm(x[i : i + 1], None, w, 1e-6, 0.0, batch_invariant=True)[1] for i in range(9)]
    alone = torch.cat(rows)
    assert torch.equal(batch.view(torch.int16), alone.view(torch.int16))
    op = arnorm.AllReduceNorm(arnorm.LOCAL, hidden_size=64, dtype=torch.bfloat16, norm=arnorm.RMSNorm(),
                              max_tokens=8, device="cpu", backend="reference",
                              config=arnorm.Config(batch_invariant=True))  # fmt: skip
    assert op.problem.batch_invariant


def test_explain_notes_the_mode(clean_env):
    """The explanation says the op is batch invariant and that backends run their invariant path."""
    _install()
    text = str(_op(config=arnorm.Config(batch_invariant=True)).explain())
    assert "batch-invariant" in text.splitlines()[0]
    assert "batch invariance (ARNORM_BATCH_INVARIANT): only backends declaring it are considered" in text
    assert "batch invariance (ARNORM_BATCH_INVARIANT)" not in str(_op().explain())
