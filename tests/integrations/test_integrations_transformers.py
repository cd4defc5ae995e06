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


# -- after fuse(): the model changed under the handle ----------------------------------------------

IDS = torch.tensor([[5, 17, 3, 42, 8, 11]])


def _stack(model):
    return model.model


def _after_fuse(family, change, dtype=torch.bfloat16):
    """``(logits of the unfused model changed by change(), logits of the fused model changed alike)``."""
    unfused, fused = hm.make(family, dtype=dtype), hm.make(family, dtype=dtype)
    with torch.no_grad():
        change(unfused)
        want = unfused(IDS).logits
        with fuse(fused, arnorm.LOCAL, max_tokens=16):
            change(fused)
            got = fused(IDS).logits
    return got, want


def _truncate(model):
    _stack(model).layers = torch.nn.ModuleList(list(_stack(model).layers)[:1])
    model.config.num_hidden_layers = 1


def _reorder(model):
    _stack(model).layers = torch.nn.ModuleList(list(_stack(model).layers)[::-1])


def _hook_norm(model):
    # A forward hook on a norm module (monitoring, steering): its output changed.
    _stack(model).layers[0].post_attention_layernorm.register_forward_hook(lambda m, i, o: o * 2)
    _stack(model).layers[1].input_layernorm.register_forward_hook(lambda m, i, o: o + 1)


def _replace_norm(model):
    layer = _stack(model).layers[0]
    new = type(layer.post_attention_layernorm)(64, eps=1e-6).to(layer.post_attention_layernorm.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(layer.post_attention_layernorm.weight * 0.5)
    layer.post_attention_layernorm = new
    _stack(model).layers[1].input_layernorm = type(new)(64, eps=1e-6).to(new.weight.dtype)


def _change_eps(model):
    for layer in _stack(model).layers:
        for attr in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, attr)
            if hasattr(norm, "variance_epsilon"):
                norm.variance_epsilon = 0.5
            else:
                norm.eps = 0.5
    norm = _stack(model).norm
    setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", 0.5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize(
    "change", [_truncate, _reorder, _hook_norm, _replace_norm, _change_eps],
    ids=["truncate", "reorder", "norm-hook", "replace-norm", "eps"],
)  # fmt: skip
def test_a_model_changed_after_fuse_keeps_its_own_numerics(family, change):
    """After fuse(): truncating or reordering the decoder layers changed the logits (0.81 / 0.97), a
    forward hook on a norm module was skipped, a replaced norm module or a changed epsilon ignored
    (2.9 / 2.5). Now each site checks its norm module at each call: bitwise the changed model."""
    got, want = _after_fuse(family, change)
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("changes", [False, True], ids=["watching-hook", "changing-hook"])
def test_a_norm_hook_registered_before_fuse_runs_as_unfused(family, changes):
    """A forward hook on a norm module registered before fuse(), one that only looks (monitoring)
    or one that changes the output (steering): fuse() never runs it on its own test rows (it used
    to, twice, or refused the changing one as a norm it cannot reproduce); at each call of the fused
    model it runs as in the unfused model, sees the same tensors, and the logits are bitwise the
    unfused model's."""
    seen: dict[str, list[torch.Tensor]] = {"unfused": [], "fused": []}

    def hook(key):
        def fn(module, args, out):
            seen[key].append(out.clone())
            return out * 2 if changes else None

        return fn

    unfused, fused = hm.make(family, dtype=torch.bfloat16), hm.make(family, dtype=torch.bfloat16)
    for key, model in (("unfused", unfused), ("fused", fused)):
        _stack(model).layers[0].post_attention_layernorm.register_forward_hook(hook(key))
        _stack(model).layers[1].input_layernorm.register_forward_hook(hook(key))
    with torch.no_grad():
        want = unfused(IDS).logits
        with fuse(fused, arnorm.LOCAL, max_tokens=16):
            got = fused(IDS).logits
    assert torch.equal(got, want)
    assert len(seen["fused"]) == len(seen["unfused"]) == 2
    assert all(torch.equal(a, b) for a, b in zip(seen["fused"], seen["unfused"], strict=True))


def test_a_fused_model_refuses_deepcopy_and_torch_save(tmp_path):
    """deepcopy of a fused model ran the original model's layers; torch.save failed with a pickle
    AttributeError. Both are refused with an arnorm error naming them; after close() both work."""
    import copy

    model = hm.make("llama")
    handle = fuse(model, arnorm.LOCAL, max_tokens=16)
    with pytest.raises(arnorm.InvalidInputError, match=r"^copy\.deepcopy: a model fused by arnorm"):
        copy.deepcopy(model)
    with pytest.raises(arnorm.InvalidInputError, match=r"^torch\.save / pickle: a model fused by arnorm"):
        torch.save(model, tmp_path / "m.pt")
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, model(IDS).logits)  # still usable
    handle.close()
    twin = copy.deepcopy(model)
    torch.save(model, tmp_path / "m.pt")
    with torch.no_grad():
        assert torch.equal(twin(IDS).logits, model(IDS).logits)


@pytest.mark.slow
def test_fuse_at_tp2_refuses_a_down_proj_hook_and_a_lone_rank(saved):
    """TP 2: a hook on down_proj registered before fuse() used to see per-rank partial sums, fuse()
    not refusing; fuse() on one rank only blocked until the process group's timeout and failed with
    gloo's errors. Now the hook is refused on every rank, naming it; the lone rank gets PeerError
    after peer_timeout (3 s here), and the rank that calls fuse() after it gave up learns that at
    once; fuse() on every rank afterwards works."""
    import integ_hf_ranks

    results = run_ranks(2, integ_hf_ranks.fuse_attacks, saved["llama"], env=RANK_ENV, timeout=240)
    for r in results:
        assert any(
            x.startswith("model.layers.0.mlp.down_proj: a forward hook (needs none at TP: ")
            for x in r["down_proj_hook"]
        ), r["down_proj_hook"]
        assert r["then_fused_close"], r
    alone, late = results[0]["alone"], results[1]["late"]
    assert alone[:2] == ("error", "PeerError"), alone
    assert alone[2].startswith(
        "fuse: peers: rank 1 did not reach calling fuse() #2 on group [0, 1] within 3 s"
    ), alone
    assert results[0]["seconds"] < 10, results[0]
    assert late[:2] == ("error", "PeerError"), late
    assert late[2].startswith("fuse: peers: rank 0 gave up on calling fuse() #2 on group [0, 1] at "), late
    assert results[1]["seconds"] < 2, results[1]


@pytest.mark.slow
def test_hooks_added_after_fuse_at_tp2_see_what_they_see_unfused(saved):
    """TP 2: a hook added after fuse() on a down_proj (or on the mlp holding it) saw this rank's
    partial sum, and a hook changing the mlp's output changed a partial sum. Now a layer whose
    row-parallel linears or their holders are hooked runs unfused for that call: the hooks see the
    reduced output, and the logits are the unfused model's with the same hooks."""
    import integ_hf_ranks

    for r in run_ranks(2, integ_hf_ranks.hooks_after_fuse, saved["llama"], env=RANK_ENV, timeout=240):
        assert r == {"calls": [1, 1], "seen_close": True, "logits_close": True}, r
