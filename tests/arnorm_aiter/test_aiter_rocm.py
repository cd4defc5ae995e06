"""Conformance on AMD hardware: real aiter against the reference backend (skipped elsewhere).

Needs a ROCm build of torch, two or more GPUs of one node and aiter >= 0.1.19.post1. Run with
``pytest -m rocm -s tests/arnorm_aiter`` to see the measured deviations next to the tolerances.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from arnorm.testing import run_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.rocm,
    pytest.mark.skipif(
        not (getattr(torch.version, "hip", None) and GPUS >= 2 and importlib.util.find_spec("aiter")),
        reason="needs ROCm torch, two or more AMD GPUs and aiter",
    ),
]
WORLDS = [w for w in (2, 4, 8) if w <= GPUS]


def _gfx() -> str:
    return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0] if GPUS else ""


def _cases() -> list[dict]:
    bf16, fp16 = torch.bfloat16, torch.float16
    cases = [
        {"dtype": bf16, "offset": 0.0, "quant": None, "hidden": 4096, "tokens": [1, 16, 80, 81, 512]},
        {"dtype": bf16, "offset": 1.0, "quant": None, "hidden": 5120, "tokens": [1, 33, 200]},
        {"dtype": fp16, "offset": 0.0, "quant": None, "hidden": 8192, "tokens": [1, 64, 300]},
        {"dtype": bf16, "offset": 1.0, "quant": None, "hidden": 12288, "tokens": [1, 40]},
        {"dtype": bf16, "offset": 1.0, "quant": None, "hidden": 2048, "tokens": [8, 128], "inplace": False},
    ]
    if _gfx() == "gfx950":  # gfx942's fp8 is e4m3fnuz: the backend rejects fp8 there
        cases += [
            {"dtype": bf16, "offset": 1.0, "quant": "fp8_per_token", "hidden": 4096, "tokens": [1, 80, 200]},
            {
                "dtype": fp16,
                "offset": 0.0,
                "quant": "fp8_per_token",
                "hidden": 7168,
                "tokens": [3, 100],
                "normed": False,
                "inplace": False,
            },
        ]
    return cases


@pytest.mark.parametrize("world", WORLDS)
def test_conformance(world):
    from aiter_hw import rank_conformance

    results = run_ranks(world, rank_conformance, _cases(), backend="nccl", timeout=900)
    for rank, rows in enumerate(results):
        for row in rows:
            print(
                f"tp={world} rank={rank} case={row['case']} tokens={row['tokens']} "
                f"{'1-stage' if row['one_stage'] else '2-stage'}: {row['dev']}"
            )
            assert row["problems"] == [], row
    # Every rank computes the whole row in the same order: the ranks' outputs agree.
    assert all([r["dev"] for r in rows] == [r["dev"] for r in results[0]] for rows in results)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_cuda_graph_replay(zero_copy):
    from aiter_hw import rank_graph

    for per_replay in run_ranks(2, rank_graph, 4096, 16, zero_copy, backend="nccl", timeout=900):
        assert per_replay == [[], [], []]
