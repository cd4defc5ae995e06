"""One engine run of the lane: ``python -m arnorm_vllm_lane.engine --model plain --tp 2 --dtype bfloat16``.

Builds (once) a tiny random-weight checkpoint of the lane's test model locally (transformers'
Llama, norms perturbed, saved as safetensors; no hub), runs vLLM's own ``LLM(...)`` on it from
prompt token ids (greedy, with logprobs), and prints one JSON line: the generated token ids and
logprobs, and each worker's report of what served vLLM's helpers (``collective_rpc``). Which vLLM
plugins load is the caller's ``VLLM_PLUGINS``; ``ARNORM_VLLM`` is read by arnorm's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

#: Tiny: 2 layers, hidden 256 (4 heads of 64, 2 KV heads so TP 2 splits them), vocab 128.
CONFIG = dict(
    vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=128, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)  # fmt: skip
PROMPTS = ([3, 17, 92, 5, 41, 8], [100, 2, 77, 64], [9])
MAX_TOKENS = 6
#: One seed per model, so the two models' weights differ.
SEEDS = {"plain": 0, "gemma": 1}
LOGPROBS = 4


def checkpoint(root: str, model: str, dtype: str, norm_dtype: str | None) -> str:
    """The checkpoint directory for this model (written once): random weights, the model's seed."""
    import torch
    import transformers

    name = f"{model}-seed{SEEDS[model]}-{dtype}" + (f"-norms-{norm_dtype}" if norm_dtype else "")
    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    arch = {"plain": "ArnormLanePlainForCausalLM", "gemma": "ArnormLaneGemmaForCausalLM"}[model]
    config = transformers.LlamaConfig(**CONFIG, architectures=[arch])
    if norm_dtype:
        config.arnorm_lane_norm_dtype = norm_dtype
    torch.manual_seed(SEEDS[model])
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                # Gemma norms hold the raw weight (1 + w multiplies); plain ones w itself.
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if model == "gemma" else 1.0))
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
    hf.to(getattr(torch, dtype)).save_pretrained(path)
    # save_pretrained writes the class it saved (LlamaForCausalLM): name the lane's model instead.
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved.update(architectures=[arch], torch_dtype=dtype)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=1)
    return path


def worker_report(worker: Any) -> dict[str, Any]:
    """Run in each worker (``collective_rpc``): which functions the model module holds, and what
    served vLLM's helpers there (arnorm's per-process tally, when arnorm's plugin routed them;
    reset, so each run reports its own calls)."""
    import torch.distributed as dist

    import arnorm_vllm_lane.models as m

    held = {
        "fused_allreduce_rms_norm": m.fused_allreduce_rms_norm,
        "fused_allreduce_gemma_rms_norm": m.fused_allreduce_gemma_rms_norm,
    }
    report: dict[str, Any] = {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "pid": os.getpid(),
        "helpers": {name: f"{fn.__module__}.{fn.__qualname__}" for name, fn in held.items()},
    }
    if "arnorm.integrations.vllm" in sys.modules:
        from arnorm.integrations import vllm as av

        report["served"] = av.served_calls(reset=True)
    return report


def generate(path: str, tp: int, dtype: str) -> dict[str, Any]:
    """vLLM's own engine on the checkpoint: greedy tokens and their logprobs, and each worker's report."""
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        seed=0,
        distributed_executor_backend="mp" if tp > 1 else None,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS, detokenize=False, ignore_eos=True
    )
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params, use_tqdm=False)
    tokens, logprobs = [], []
    for out in outputs:
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        logprobs.append(
            [{str(t): lp.logprob for t, lp in sorted(step.items())} for step in completion.logprobs]
        )
    workers = llm.collective_rpc(worker_report)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {"tokens": tokens, "logprobs": logprobs, "workers": workers}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--runs",
        default="plain:bfloat16",
        help="comma list of model:dtype[:norm weight dtype], e.g. plain:bfloat16,gemma:float16:float32",
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--root", default=os.path.join(os.getcwd(), ".vllm-lane-venv", "lane-models"))
    args = parser.parse_args()
    # collective_rpc ships worker_report (a function) to the workers by pickle.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny model needs little
    for spec in args.runs.split(","):
        model, dtype, *rest = spec.split(":")
        norm_dtype = rest[0] if rest else None
        path = checkpoint(args.root, model, dtype, norm_dtype)
        result = {"model": model, "tp": args.tp, "dtype": dtype, "norm_dtype": norm_dtype,
                  "plugins": os.environ.get("VLLM_PLUGINS"), "arnorm_vllm": os.environ.get("ARNORM_VLLM"),
                  **generate(path, args.tp, dtype)}  # fmt: skip
        print("ARNORM_LANE_RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # vLLM's engine shutdown on CPU can linger; the results are out


if __name__ == "__main__":
    main()
