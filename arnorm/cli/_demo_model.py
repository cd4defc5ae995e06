"""``arnorm demo --model llama|gemma3``: a tiny random Hugging Face model, unfused vs fused at TP N.

The model is built from a config object with random weights (nothing is downloaded), saved to a
temporary folder, and loaded on every rank with transformers' own tensor parallelism. Each rank
runs it unfused, then rewired by :func:`arnorm.integrations.transformers.fuse`, and compares the
layer outputs, the logits and a greedy decode; rank 0's numbers are printed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

# Imported here, not lazily: the CLI turns a missing module into a one-line usage error at import.
import accelerate  # noqa: F401  (transformers' tensor-parallel loading needs it)
import transformers

__all__ = ["MODELS", "run_model_demo"]

#: Model name -> (config class, model class, extra config) of transformers.
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 8}),
}
#: Tiny but real: four heads shard over 2 and 4 ranks.
SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=256,
             initializer_range=0.1)  # fmt: skip
PROMPT = (2, 8)  # batch, tokens
#: fp32: the tolerance against the unfused model. Lower precision: the fused RMS logit error
#: against the fp32 model may exceed the unfused run's by this factor at most (TP > 2 reduces differently).
FP32_TOL, RMS_SLACK = 1e-4, 1.05
_QUIET = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _build(model: str, folder: str) -> str:
    import torch

    config_cls, model_cls, extra = MODELS[model]
    config = getattr(transformers, config_cls)(**SIZES, **extra)
    torch.manual_seed(0)
    net = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("norm.weight"):  # away from the ones / zeros init: the weight multiply matters
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    net.save_pretrained(folder)
    return folder


def _load(folder: str, dtype: Any, tp: int | None) -> Any:
    from transformers import AutoModelForCausalLM

    if tp is None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_plan="auto", tp_size=tp)
    return AutoModelForCausalLM.from_pretrained(folder, distributed_config=config, dtype=dtype).eval()


def _rank_main(rank: int, world: int, folder: str, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import arnorm
    from arnorm.integrations.transformers import fuse

    dtype = getattr(torch, opts["dtype"])
    device = torch.device("cuda", torch.cuda.current_device()) if opts["cuda"] else torch.device("cpu")
    batch, seq = PROMPT
    ids = ((torch.arange(batch * seq).view(batch, seq) * 7 + 3) % SIZES["vocab_size"]).to(device)
    single = _load(folder, torch.float32, None).to(device)
    model = _load(folder, dtype, world)
    if world == 1 and next(model.parameters()).device != device:
        # transformers places a TP model on the accelerator only when it shards it (tp_size > 1).
        model = model.to(device)
    outputs: list[Any] = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda mod, args, out: outputs.append(out.detach().clone()))
    new = opts["max_tokens"]

    def greedy(m: Any) -> Any:
        return m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    with torch.no_grad():
        want = single(ids).logits.float()
        unfused = model(ids).logits.float()
        unfused_layers, outputs[:] = list(outputs), []
        unfused_tokens = greedy(model)
        try:
            # At TP 1 transformers does not shard, and fuse() takes such a model with arnorm.LOCAL.
            group = arnorm.LOCAL if world == 1 else dist.group.WORLD
            handle = fuse(model, group, max_tokens=batch * seq, backend=opts["backend"])
        except arnorm.SelectionError as exc:  # raised alike on every rank: rank 0's message is the story
            return {"selection_error": f"{type(exc).__name__}: {exc}"}
        outputs.clear()
        fused = model(ids).logits.float()
        fused_layers = list(outputs)
        fused_tokens = greedy(model)
        sites = handle.layer_backends(batch * seq)
        handle.close()

    def rms(a: Any) -> float:
        return float((a - want).pow(2).mean().sqrt())

    return {
        "sites": sites,
        "layer_diffs": [
            float((f.float() - u.float()).abs().max())
            for f, u in zip(fused_layers, unfused_layers, strict=True)
        ],
        "logit_diff": float((fused - unfused).abs().max()),
        "bitwise": torch.equal(fused, unfused),
        "rms": (rms(unfused), rms(fused)),
        "tokens_agree": torch.equal(fused_tokens, unfused_tokens),
        # The first decode position where some sequence of the batch differs (None: none does).
        "first_difference": next(
            (i for i in range(new) if not torch.equal(fused_tokens[:, seq + i], unfused_tokens[:, seq + i])),
            None,
        ),
        "model_class": type(model).__name__,
    }


def _column(site: dict[str, str], *roles: str) -> str:
    names = [site[r] for r in roles if r in site]
    return " / ".join(names) if names else "-"


def run_model_demo(
    model: str,
    tp: int,
    device: str,
    *,
    dtype: str = "float32",
    backend: str | None = None,
    max_tokens: int = 64,
) -> int:
    """Run the demo; exit status 0: the fused model is as accurate as the unfused one, 1: it is not.

    fp32: logits within 1e-4 of the unfused model and the same greedy tokens. bf16 / fp16: an RMS
    logit error against the fp32 model no more than 5% above the unfused run's (tiny random models
    have near-ties, so the greedy tokens of two low-precision runs may differ: they are reported).

    ``model``: ``"llama"`` or ``"gemma3"``; ``tp``: ranks to spawn (gloo on CPU; NCCL when ``device``
    is ``"cuda"`` with at least ``tp`` GPUs, else gloo over CUDA tensors); ``backend``: arnorm
    backend name(s), strict, or None for auto; ``max_tokens``: tokens to generate greedily.
    """
    import torch

    from arnorm.testing import run_ranks

    if model not in MODELS:
        print(f"arnorm demo: --model {model!r} (needs one of {', '.join(MODELS)})", file=sys.stderr)
        return 2
    cuda = device == "cuda"
    comm = "nccl" if cuda and torch.cuda.device_count() >= tp else "gloo"
    env: list[dict[str, str]] = []
    for r in range(tp):
        # transformers binds a rank to the accelerator it sees, at LOCAL_RANK: hide GPUs for a CPU run.
        where = (
            {"LOCAL_RANK": str(r % max(torch.cuda.device_count(), 1))}
            if cuda
            else {"CUDA_VISIBLE_DEVICES": ""}
        )
        env.append({**_QUIET, **where})
    opts = {"dtype": dtype, "backend": backend, "cuda": cuda, "max_tokens": max_tokens}
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="arnorm-demo-") as tmp:
        folder = _build(model, os.path.join(tmp, model))
        print(
            f"arnorm demo --model {model}: a tiny random {MODELS[model][1]} "
            f"({SIZES['num_hidden_layers']} layers, hidden {SIZES['hidden_size']}, "
            f"vocab {SIZES['vocab_size']}), {dtype}, TP={tp} on "
            f"{'GPU' if cuda else 'CPU'} ({comm}), transformers {transformers.__version__}"
        )
        results = run_ranks(tp, _rank_main, folder, opts, backend=comm, env=env, timeout=300)
    first = results[0]
    if "selection_error" in first:
        print(f"arnorm demo: {first['selection_error']}", file=sys.stderr)
        return 1
    return _report(first, dtype, tp, max_tokens)


def _report(res: dict[str, Any], dtype: str, tp: int, max_tokens: int) -> int:
    batch, seq = PROMPT
    print(f"prompt {batch} x {seq} tokens; backend per site (all-reduce + add + norm, and local add + norm):")
    print(
        "layer  after attention  after MLP        local add+norm         max|fused - unfused| of its output"
    )
    for i, (site, diff) in enumerate(zip(res["sites"], res["layer_diffs"], strict=True)):
        local = _column(site, "pre_feedforward", "mlp_residual")
        print(f"{i:>5}  {site['attention']:<15}  {site['mlp']:<15}  {local:<21}  {diff:.3g}")
    unfused_rms, fused_rms = res["rms"]
    verdict = "bitwise equal" if res["bitwise"] else "not bitwise"
    print(f"logits: max|fused - unfused| = {res['logit_diff']:.3g} ({verdict})")
    print(
        f"        RMS error against the fp32 one-process model: "
        f"unfused {unfused_rms:.3g}, fused {fused_rms:.3g}"
    )
    agree = res["tokens_agree"]
    if agree:
        print(f"greedy decode of {max_tokens} tokens: fused and unfused agree")
    else:
        why = " (near-ties of a tiny random model in low precision)" if dtype != "float32" else ""
        print(
            f"greedy decode of {max_tokens} tokens: fused and unfused differ from position "
            f"{res['first_difference']} on{why}"
        )
    if dtype == "float32":
        ok = agree and res["logit_diff"] <= FP32_TOL
        rule = f"logits within {FP32_TOL:g} of the unfused model and the same greedy tokens"
    else:
        ok = fused_rms <= unfused_rms * RMS_SLACK
        rule = "no less accurate than the unfused model against the fp32 model"
    if not res["bitwise"] and tp == 2 and dtype != "float32":
        print(
            "note: at TP 2 a backend summing in fp32 in rank order is bitwise the unfused run; not this one"
        )
    print(f"{rule}: {'yes -> OK' if ok else 'NO -> MISMATCH'}")
    return 0 if ok else 1
