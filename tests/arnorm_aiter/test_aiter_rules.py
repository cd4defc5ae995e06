"""The limits read from AITER's source and vLLM's 1-stage rule, as pure functions."""

from __future__ import annotations

import importlib.metadata
import itertools

import pytest
from aiter_fake import problem
from hypothesis import given
from hypothesis import strategies as st

from arnorm_aiter import _rules

# -- versions ---------------------------------------------------------------------------------


def test_version_order_follows_pep440():
    ordered = [
        "0.1.12",
        "0.1.17.dev3",
        "0.1.17rc1",
        "0.1.17",
        "0.1.17.post1.dev2",
        "0.1.17.post1",
        "0.1.18",
        "0.1.19",
        "0.1.19.post1",
        "0.1.19.post2.dev5+g1a2b3c",
        "0.1.20",
        "0.1.20.post1",
        "v0.2",
        "1.0",
    ]
    keys = [_rules.parse_version(v) for v in ordered]
    assert all(a < b for a, b in itertools.pairwise(keys))


@pytest.mark.parametrize(("a", "b"), [("0.1.20", "0.1.20.0"), ("0.1.19.post1", "0.1.19.post1+rocm7.0")])
def test_equal_versions(a, b):
    assert _rules.parse_version(a) == _rules.parse_version(b)


def test_unparsable_version_never_qualifies():
    assert _rules.parse_version("main-abcdef") is None
    assert not _rules.at_least("main-abcdef", _rules.MIN_VERSION)


def test_installed_version_reads_metadata_only(monkeypatch):
    seen = []

    def version(dist):
        seen.append(dist)
        if dist == "aiter":
            return "0.1.20"
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert _rules.installed_version() == "0.1.20"
    assert seen == ["amd-aiter", "aiter"]
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda d: (_ for _ in ()).throw(importlib.metadata.PackageNotFoundError(d)),
    )
    assert _rules.installed_version() is None


# -- static rules -------------------------------------------------------------------------------

FLOOR = (
    "aiter version: {v} (needs >= 0.1.19.post1: older 1-stage kernels lack their final cross-rank "
    "barrier, ROCm/aiter#4346)"
)


@pytest.mark.parametrize(
    ("overrides", "version", "expected"),
    [
        ({}, "0.1.19.post1", []),
        ({"weight_offset": 1.0, "quant": "fp8_per_token"}, "0.1.20.post1", []),
        ({"gfx_arch": "gfx942:sramecc+:xnack-"}, "0.1.20", []),
        ({"dtype": "float16", "quant": "fp8_per_token", "hidden_size": 8192}, "0.1.20", []),
        (
            {},
            None,
            ["aiter version: unknown, no metadata for amd-aiter or aiter (needs amd-aiter >= 0.1.19.post1)"],
        ),
        ({}, "0.1.19", [FLOOR.format(v="0.1.19")]),
        ({}, "0.1.19.post1.dev4", [FLOOR.format(v="0.1.19.post1.dev4")]),
        (
            {"weight_offset": 1.0},
            "0.1.16",
            [
                FLOOR.format(v="0.1.16"),
                "aiter version: 0.1.16 (needs >= 0.1.17 for a Gemma norm: gemma_norm)",
            ],
        ),
        ({"weight_offset": 1.0}, "0.1.18", [FLOOR.format(v="0.1.18")]),
        (
            {"quant": "fp8_per_token"},
            "0.1.17",
            [
                FLOOR.format(v="0.1.17"),
                "aiter version: 0.1.17 (needs >= 0.1.18 for fp8_per_token with normed_output: emit_bf16)",
            ],
        ),
        ({"quant": "fp8_per_token", "normed_output": False}, "0.1.17", [FLOOR.format(v="0.1.17")]),
        ({"gfx_arch": "gfx90a"}, "0.1.20", ["gpu arch: gfx90a (needs gfx942 or gfx950)"]),
        ({"gfx_arch": "gfx1250"}, "0.1.20", ["gpu arch: gfx1250 (needs gfx942 or gfx950)"]),
        ({"gfx_arch": None}, "0.1.20", ["gpu arch: unknown (needs gfx942 or gfx950)"]),
        (
            {"gfx_arch": "gfx942", "quant": "fp8_per_token"},
            "0.1.20",
            [
                "quant: fp8_per_token on gfx942 (needs gfx950: gfx942 writes e4m3fnuz, max 240, "
                "not arnorm's e4m3fn)"
            ],
        ),
        (
            {"quant": "fp8_per_token", "hidden_size": 8200},
            "0.1.20",
            ["hidden size: 8200 (needs <= 8192 for fp8_per_token)"],
        ),
        ({"hidden_size": 16384}, "0.1.20", []),
    ],
)
def test_problem_reasons(overrides, version, expected):
    assert _rules.problem_reasons(problem(**overrides), version) == expected


# -- 1-stage / 2-stage --------------------------------------------------------------------------


def vllm_use_1stage(tokens: int, hidden: int, item: int, world: int) -> bool:
    """vllm/_aiter_ops.py ``_rocm_aiter_fused_allreduce_rmsnorm_impl`` as written there (fully connected)."""
    total_bytes = tokens * hidden * item
    pack_size = 16 // item
    hidden_ok = hidden % pack_size == 0 and hidden // pack_size <= 1024
    token_ok = tokens <= 80
    if world == 2:
        size_ok = True
    elif world <= 4:
        size_ok = total_bytes < 256 * 1024
    elif world <= 8:
        size_ok = total_bytes < 128 * 1024
    else:
        size_ok = False
    return hidden_ok and token_ok and size_ok


@pytest.mark.parametrize(
    ("tokens", "hidden", "world", "one_stage"),
    [
        (80, 8192, 2, True),
        (81, 4096, 2, False),
        (1, 8200, 2, False),
        (31, 4096, 4, True),
        (32, 4096, 4, False),  # exactly 256 KiB
        (15, 4096, 8, True),
        (16, 4096, 8, False),  # exactly 128 KiB
        (80, 7168, 8, False),
    ],
)
def test_one_stage_table(tokens, hidden, world, one_stage):
    assert _rules.use_one_stage(tokens, hidden, 2, world) is one_stage


@given(
    tokens=st.integers(1, 300),
    hidden=st.integers(1, 2100).map(lambda k: 8 * k),
    world=st.sampled_from([2, 4, 8]),
)
def test_one_stage_is_vllms_rule(tokens, hidden, world):
    assert _rules.use_one_stage(tokens, hidden, 2, world) == vllm_use_1stage(tokens, hidden, 2, world)


# -- per-token checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_tokens", "hidden", "dtype", "pool"),
    [
        (256, 4096, "bfloat16", 2 << 20),
        (1, 64, "bfloat16", 1 << 20),  # the floor keeps AITER's meta buffer >= 2 MiB
        (300, 4096, "float16", 3 << 20),  # 2.34 MiB rounded up
        (100_000, 16384, "bfloat16", 64 << 20),  # capped
    ],
)
def test_pool_bytes(max_tokens, hidden, dtype, pool):
    assert _rules.pool_bytes(problem(max_tokens=max_tokens, hidden_size=hidden, dtype=dtype)) == pool


@pytest.mark.parametrize(
    ("overrides", "tokens", "expected"),
    [
        ({}, 1, []),
        ({}, 256, []),
        ({}, 0, ["tokens: 0 (needs >= 1)"]),
        ({}, 257, ["tokens: 257 (needs <= 256: AITER's registered input buffer holds 2 MiB)"]),
        (
            {"max_tokens": 100_000, "hidden_size": 16384},
            2049,
            ["tokens: 2049 (needs <= 2048: AITER's registered input buffer holds 64 MiB)"],
        ),
        ({"hidden_size": 256}, 80, []),
        (
            {"hidden_size": 256},
            81,
            [
                "tokens: 81 at hidden size 256 (needs <= 80 tokens for the 1-stage kernel; "
                "the 2-stage kernel needs a hidden size >= 512)"
            ],
        ),
        ({"hidden_size": 4104}, 82, []),
        (
            {"hidden_size": 4104},
            81,
            [
                "tokens: 81 at hidden size 4104 (needs <= 80 tokens for the 1-stage kernel, "
                "or tokens x hidden / 8 divisible by the world size 2 for the 2-stage kernel)"
            ],
        ),
        (
            {"hidden_size": 4104, "world_size": 8},
            17,
            [
                "tokens: 17 at hidden size 4104 (needs <= 80 tokens and < 128 KiB per rank for the 1-stage "
                "kernel, or tokens x hidden / 8 divisible by the world size 8 for the 2-stage kernel)"
            ],
        ),
        ({"hidden_size": 4104, "world_size": 8}, 16, []),  # 2-stage: 16 * 513 is a multiple of 8
        ({"hidden_size": 4104, "world_size": 8}, 8, []),
        ({"hidden_size": 12288}, 5, []),  # 2-stage only (hidden / 8 > 1024); 5 * 1536 is even
        ({"quant": "fp8_per_token", "hidden_size": 2880}, 80, []),
        (
            {"quant": "fp8_per_token", "hidden_size": 2880},
            81,
            [
                "tokens: 81 at hidden size 2880 (needs <= 80 tokens for the 1-stage kernel; the 2-stage fp8 "
                "kernels need a hidden size that is a multiple of 256)"
            ],
        ),
        (
            {"quant": "fp8_per_token", "hidden_size": 2880, "world_size": 4},
            50,
            [
                "tokens: 50 at hidden size 2880 (needs <= 80 tokens and < 256 KiB per rank for the 1-stage "
                "kernel; the 2-stage fp8 kernels need a hidden size that is a multiple of 256)"
            ],
        ),
        ({"quant": "fp8_per_token", "hidden_size": 4096}, 200, []),
    ],
)
def test_token_reasons(overrides, tokens, expected):
    prob = problem(**overrides)
    assert _rules.token_reasons(prob, tokens, _rules.pool_bytes(prob)) == expected


def kernel_would_misbehave(prob, tokens) -> bool:
    """What the C++ launchers do wrong, from custom_all_reduce.cuh (independent of token_reasons)."""
    h, ws, pack = prob.hidden_size, prob.world_size, 8
    one = _rules.use_one_stage(tokens, h, 2, ws) and h // pack <= 1024
    if one:
        return False
    if prob.quant == "fp8_per_token":
        block = h // pack  # threads of one block in the 2-stage and split kernels
        return block % 32 != 0 or block % ws != 0 or (tokens * block) % ws != 0
    n_packs = h // pack
    return n_packs < 64 or n_packs > 2048 or (tokens * n_packs) % ws != 0


@given(
    tokens=st.integers(1, 400),
    hidden=st.integers(1, 2048).map(lambda k: 8 * k),
    world=st.sampled_from([2, 4, 8]),
    fp8=st.booleans(),
)
def test_accepted_tokens_never_hit_a_kernel_limit(tokens, hidden, world, fp8):
    if fp8 and hidden > 8192:
        return  # rejected by problem_reasons
    prob = problem(
        hidden_size=hidden, world_size=world, quant="fp8_per_token" if fp8 else None, max_tokens=400
    )
    if not _rules.token_reasons(prob, tokens, _rules.pool_bytes(prob)):
        assert not kernel_would_misbehave(prob, tokens)
