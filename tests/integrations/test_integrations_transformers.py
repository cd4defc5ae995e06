"""arnorm.integrations.transformers.fuse(): tensor-parallel Hugging Face decoders, fused and restored."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import integ_hf_models as hm  # noqa: E402
import torch  # noqa: E402

import arnorm  # noqa: E402
from arnorm.integrations.transformers import fuse  # noqa: E402
from arnorm.testing import run_ranks  # noqa: E402

#: Quiet, offline ranks: transformers' progress bars and notices would bury a failure.
RANK_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every family saved once (float32) for loading with tp_plan."""
    root = tmp_path_factory.mktemp("hf-models")
    return {name: hm.build(name, str(root)) for name in hm.FAMILIES}


def _suite(world, folders, extras):
    import integ_hf_ranks

    return run_ranks(world, integ_hf_ranks.suite, folders, "reference", extras, env=RANK_ENV, timeout=240)[0]


@pytest.mark.slow
def test_every_family_at_tp2(saved):
    """TP 2, each family: fp32 within 1e-4 of the unfused TP and single-process models with the same greedy
    tokens; bf16 bitwise the unfused TP run; above max_tokens unfused; refusals; backward raises."""
    reports = _suite(2, saved, extras=True)
    for name in hm.FAMILIES:
        assert reports[name]["backends"] == ["reference"], name
        assert reports[name]["bitwise"], name
        sandwich = name in ("gemma2", "gemma3")
        assert (reports[name]["residual_free_ops"] > 0) == sandwich, name
    refused = reports["_refusals"]
    assert any(r.startswith("tp_group: arnorm.LOCAL for model.layers.0.self_attn.o_proj sharded over 2 ranks")
               for r in refused["local_for_sharded"])  # fmt: skip
    assert any(r.startswith("model.layers.0.self_attn.o_proj: not sharded (needs a model loaded with")
               for r in refused["group_for_whole"])  # fmt: skip
    assert refused["quant"] == (
        "quant: 'fp8_static' (needs None: the model's linear layers read the normed activation "
        "in the model's dtype)",
    )
    assert reports["_backward"].startswith("backward: reached a model rewired by arnorm")


@pytest.mark.slow
def test_gemma3_at_tp4(saved):
    """TP 4, Gemma3 (sandwich norms): fp32 within 1e-4 and the same greedy tokens; bf16 no less accurate
    against the fp32 model than the unfused TP run (RMS logit error, 5% slack: the unfused all-reduce rounds
    in bf16 at every step, arnorm's once, and the difference propagates through the layers)."""
    reports = _suite(4, {"gemma3": saved["gemma3"]}, extras=False)
    assert reports["gemma3"]["backends"] == ["reference"]
    assert not reports["gemma3"]["bitwise"]  # the unfused all-reduce rounds at every step; arnorm once


# -- a single process: arnorm.LOCAL ---------------------------------------------------------------


@pytest.fixture(autouse=True)
def _test_backends():
    """The reference and the tests' fused backend only: results do not depend on what is installed."""
    import integ_fakes

    integ_fakes.install_registry()


@pytest.mark.parametrize("family", list(hm.FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_fuse_is_bitwise_the_model(family, dtype):
    """With arnorm.LOCAL (no TP) the fused model's logits and greedy tokens are bitwise the model's own."""
    model = hm.make(family, dtype=dtype)
    ids = torch.tensor([[5, 17, 3, 42, 8, 11]])
    with torch.no_grad():
        want = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=3, do_sample=False)
        with fuse(model, arnorm.LOCAL, max_tokens=16) as handle:
            got = model(ids).logits
            assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), tokens)
            # Gemma2/3's sandwich norms have neither an all-reduce nor a residual here: the model's own.
            sandwich = family in ("gemma2", "gemma3")
            assert set(handle.backends(6).values()) == ({"fused", "unfused"} if sandwich else {"fused"})
        assert torch.equal(got, want)
        assert torch.equal(model(ids).logits, want)


def test_a_site_unfused_by_autocast_says_why(monkeypatch):
    """Under bf16 autocast an fp32 fused model's partial sums are bf16: every site runs the model's own
    path (bitwise the model) and one ArnormWarning names the dtype found and the dtype needed."""
    from arnorm.integrations import _common

    monkeypatch.setattr(_common, "_WARNED", set())
    model = hm.make("llama")
    ids = torch.tensor([[5, 17, 3, 42, 8, 11]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(ids).logits
        with (
            fuse(model, arnorm.LOCAL, max_tokens=16, backend="reference"),
            pytest.warns(arnorm.ArnormWarning) as said,
        ):
            got = model(ids).logits
    assert torch.equal(got, want)
    messages = [str(w.message) for w in said if issubclass(w.category, arnorm.ArnormWarning)]
    assert messages == [
        "arnorm.integrations.transformers: a site ran unfused: partial sum: dtype torch.bfloat16 (needs "
        "torch.float32, the dtype of the fused model; autocast changes the linear layers' output dtype)"
    ]


def test_sites_and_ops_of_a_sandwich_model():
    """Gemma3 with arnorm.LOCAL: sandwich norms run as the model's own, the adds + norms share one op."""
    model = hm.make("gemma3")
    handle = fuse(model, arnorm.LOCAL, max_tokens=8)
    try:
        assert (
            handle.layer_backends(4)
            == [
                {
                    "attention": "unfused",
                    "mlp": "unfused",
                    "pre_feedforward": "fused",
                    "mlp_residual": "fused",
                }
            ]
            * 2
        )
        assert len(handle.ops) == 1 and "serves 4 site(s)" in handle.explain(4)
        assert handle.backends(9)["model.layers.1.mlp_residual"] == "unfused"  # above max_tokens
        assert handle.explain(9).startswith("9 tokens: above max_tokens=8, every site runs unfused")
    finally:
        handle.close()
    handle.close()  # idempotent
    assert handle.closed and "closed" in repr(handle)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_backward_through_a_fused_model_raises():
    """Inference only: a backward pass through the fused model raises InferenceOnlyError."""
    model = hm.make("llama")
    with fuse(model, arnorm.LOCAL, max_tokens=8):
        loss = model(torch.tensor([[1, 2, 3]])).logits.sum()
        with pytest.raises(arnorm.InferenceOnlyError, match=r"^backward: reached a model rewired by arnorm"):
            loss.backward()


def _reasons(model, **kw):
    with pytest.raises(arnorm.InvalidInputError) as info:
        fuse(model, arnorm.LOCAL, **{"max_tokens": 8, **kw})
    assert str(info.value).startswith("fuse: the model was left unchanged; ")
    return info.value.reasons


def test_refusals_name_each_reason_and_change_nothing():
    """An unknown architecture, a training-mode model, a model fused twice, a norm arnorm does not
    reproduce: each is refused before any change, every reason in the grammar."""
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    )
    assert _reasons(gpt2.eval()) == (
        "model: 0 decoder stacks (none) (needs exactly one module with .layers and .norm)",
    )

    llama = hm.make("llama")
    llama.train()
    assert _reasons(llama) == (
        "model: in training mode (needs model.eval(): the fused path is inference only)",
    )
    llama.eval()

    llama.model.layers[1].post_attention_layernorm.variance_epsilon = 0.5  # another eps: another op
    with fuse(llama, arnorm.LOCAL, max_tokens=8) as handle:
        assert len(handle.ops) == 2
        assert _reasons(llama) == ("model: already fused by arnorm (needs handle.close() first)",)

    class Shifted(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.weight, self.variance_epsilon = inner.weight, inner.variance_epsilon

        def forward(self, x):
            return x * self.weight

    llama.model.layers[0].input_layernorm = Shifted(llama.model.layers[0].input_layernorm)
    assert _reasons(llama) == (
        "model.layers.0.input_layernorm: Shifted (needs one of LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, "
        "Qwen3RMSNorm, GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm)",
    )
    assert not any("forward" in m.__dict__ for m in llama.modules())


def test_a_norm_whose_arithmetic_changed_is_refused(monkeypatch):
    """A known norm class whose output is not arnorm's formula (a future transformers) is refused."""
    model = hm.make("qwen3", dtype=torch.bfloat16)
    norm_cls = type(model.model.norm)
    monkeypatch.setattr(norm_cls, "forward", lambda self, x: (x.float() * self.weight.float()).to(x.dtype))
    reasons = _reasons(model)
    assert reasons[0] == (
        "model.layers.0.input_layernorm: Qwen3RMSNorm output differs from arnorm.RMSNorm(eps=1e-06, "
        "weight_offset=0, round_before_weight=True) (needs a norm arnorm reproduces bit for bit)"
    )


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_max_tokens_must_be_a_positive_int(bad):
    """max_tokens is checked first, named in the error."""
    with pytest.raises(arnorm.InvalidInputError, match=r"^max_tokens: "):
        fuse(hm.make("llama"), arnorm.LOCAL, max_tokens=bad)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "backend"), [("llama", "reference"), ("gemma2", "reference"), ("qwen3", "triton")]
)
def test_batch_invariant_fuse_at_tp2(saved, family, backend):
    """TP 2, Config(batch_invariant=True): every fused site gives each row the same bits alone and in
    batches of 3, 8, 9 and 19 (max_tokens 8: above it the op runs in chunks, not the unfused path), and
    the logits of a sequence alone and in a batch agree wherever the unfused model's do."""
    import integ_hf_ranks

    report = run_ranks(2, integ_hf_ranks.batch_invariance, saved[family], backend, env=RANK_ENV,
                       timeout=600)[0]  # fmt: skip
    assert report["sites"] == (8 if family == "gemma2" else 4), report
    assert report["backends"] == [backend], report
    assert report["explain_above"] == (
        "19 tokens: above max_tokens=8, every site runs its op in chunks of 8 (batch invariant)"
    )
    assert report["fused_invariant"] or not report["unfused_invariant"], report
