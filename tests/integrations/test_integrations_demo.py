"""arnorm.cli._demo_model: the model demo behind `arnorm demo --model`, run for real on CPU ranks."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from arnorm.cli._demo_model import run_model_demo


@pytest.mark.slow
def test_gemma3_demo_at_tp2_prints_sites_and_agrees(capsys):
    """Gemma3, bf16, TP 2, the reference: every site named, bitwise equal, greedy tokens agree, exit 0."""
    assert run_model_demo("gemma3", 2, "cpu", dtype="bfloat16", backend="reference", max_tokens=4) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("arnorm demo --model gemma3: a tiny random Gemma3ForCausalLM (2 layers")
    assert "bfloat16, TP=2 on CPU (gloo)" in out[0]
    rows = [line.split() for line in out[3:5]]
    assert rows == [[str(i), "reference", "reference", "reference", "/", "reference", "0"] for i in (0, 1)]
    assert out[5] == "logits: max|fused - unfused| = 0 (bitwise equal)"
    assert out[7] == "greedy decode of 4 tokens: fused and unfused agree"
    assert out[-1].endswith("-> OK")


@pytest.mark.slow
def test_llama_demo_at_tp1_fuses_the_unsharded_model(capsys):
    """TP 1 (transformers does not shard at tp_size 1): the demo fuses with arnorm.LOCAL and
    exits 0 (it raised 'not sharded' for every site until 2026-12-03)."""
    assert run_model_demo("llama", 1, "cpu", dtype="bfloat16", max_tokens=4) == 0
    out = capsys.readouterr().out
    assert "TP=1 on CPU" in out and out.rstrip().endswith("-> OK")


def test_unknown_model_is_exit_2(capsys):
    """A model name the demo does not build ends with one line naming the choices, exit 2."""
    assert run_model_demo("gpt2", 2, "cpu") == 2
    assert capsys.readouterr().err == "arnorm demo: --model 'gpt2' (needs one of llama, gemma3)\n"
