"""arnorm's vLLM compile pass in a real GPU engine: a tiny Llama, ``LLM(..., tensor_parallel_size=2)``, -O2.

    python benchmarks/vllm_pass_gpu.py            # needs 2 GPUs, vllm==0.33.0 and arnorm installed

Builds a random-weight Llama checkpoint locally (4 layers, hidden 1024, eps 1e-5; no hub), then runs
vLLM's engine on it in one process per setting: without arnorm's plugin (``VLLM_PLUGINS=none``),
with it under ``ARNORM_VLLM_PASS=after`` (vLLM's FlashInfer pass first, where it is on) and ``take``
(arnorm serves every seam). Each prints, and writes to ``$OUT/vllm_pass_gpu.json``: the greedy token
ids, what served the seams in each worker (``served_calls()``: ``vllm_compile_pass`` counts the
compiled seams arnorm served), what the pass did to each graph, and the decode time. Expect the
same tokens in every setting (logprobs may differ in the last bits where vLLM's FlashInfer pass
served a seam: it normalizes the rounded sum), a fused backend (``flashinfer``, ``triton_symm`` or
``triton``) with non-zero counts under ``take`` on both workers, and under ``after`` counts only
where vLLM's pass is off (SM 80, or the compile range above FlashInfer's size cap).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SETTINGS = {"vllm": {"VLLM_PLUGINS": "none"}, "after": {"ARNORM_VLLM_PASS": "after"},
            "take": {"ARNORM_VLLM_PASS": "take"}}  # fmt: skip
PROMPTS = [[3, 17, 92, 5, 41, 8], [100, 2, 77, 64], [9]]


def checkpoint(root: str) -> str:
    import torch
    import transformers

    path = os.path.join(root, "tiny-llama")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048,
                                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=256, rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _report(worker: object) -> dict:
    from arnorm.integrations import vllm as av

    return {"served": av.served_calls(), "graphs": av.compile_pass_reports()}


def run_one(path: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, skip_tokenizer_init=True, tensor_parallel_size=2, dtype="bfloat16",
              optimization_level=2, max_model_len=256, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=32, detokenize=False, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm.generate(prompts, params)  # warm
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    workers = llm.collective_rpc(_report) if os.environ.get("VLLM_PLUGINS") != "none" else []
    return {"tokens": [list(o.outputs[0].token_ids) for o in out], "seconds": seconds, "workers": workers}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print("RESULT " + json.dumps(run_one(sys.argv[2]), default=str))
        return
    out_dir = os.environ.get("OUT", ".")
    path = checkpoint(os.path.join(out_dir, "models"))
    results = {}
    for name, env in SETTINGS.items():
        environ = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1", **env)
        proc = subprocess.run([sys.executable, __file__, "--one", path], env=environ, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        results[name] = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-4000:]}
        arnorm_lines = [line for line in proc.stderr.splitlines() if "arnorm:" in line]
        results[name]["log"] = arnorm_lines[:4]
        print(name, json.dumps(results[name], default=str)[:2000])
    same = len({json.dumps(r.get("tokens")) for r in results.values()}) == 1
    print("tokens identical in every setting:", same)
    with open(os.path.join(out_dir, "vllm_pass_gpu.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
