"""bench_public_op's verdicts compare each arnorm eager row with the FlashInfer call that has the
same outputs: out= against FlashInfer writing into a preallocated output, the allocating call
against FlashInfer plus a torch.empty of its output, and no allocating verdict for `none`, where
FlashInfer writes into its inputs."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("bench_public_op", _BENCH / "bench_public_op.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _eager(fmt: str, rows: dict[str, float]) -> list[dict]:
    key = {"H": 4096, "format": fmt, "normed": fmt == "none"}
    return [key | {"path": path, "us": us} for path, us in rows.items()]


def test_eager_verdicts_compare_like_for_like():
    """out= is judged against FlashInfer preallocated, the allocating call against FlashInfer plus
    torch.empty; a ratio above 1.2 is MISSED; `none`'s allocating row has no rival."""
    eager = _eager(
        "fp8_static",
        {
            "arnorm.AllReduceNorm (triton)": 9.6,
            "arnorm.AllReduceNorm out= (triton)": 9.0,
            "flashinfer (output preallocated)": 7.0,
            "flashinfer + torch.empty of its output": 11.0,
        },
    )
    eager += _eager(
        "none",
        {
            "arnorm.AllReduceNorm (triton)": 9.1,
            "arnorm.AllReduceNorm out= (triton)": 7.0,
            "flashinfer (output preallocated)": 5.9,
            "flashinfer + torch.empty of its output": 5.9,
        },
    )
    report = {"eager": eager, "graph": []}
    bench.judge(report, 4.2e12)
    verdicts = {(r["format"], r["path"]): r["verdict"] for r in eager}
    assert verdicts[("fp8_static", "arnorm.AllReduceNorm (triton)")] == "0.87x fi + torch.empty met"
    assert verdicts[("fp8_static", "arnorm.AllReduceNorm out= (triton)")] == "1.29x fi MISSED (target 1.2x)"
    assert verdicts[("none", "arnorm.AllReduceNorm out= (triton)")] == "1.19x fi met"
    assert "out= row is like for like" in verdicts[("none", "arnorm.AllReduceNorm (triton)")]
    assert verdicts[("none", "flashinfer (output preallocated)")] == ""


def test_focused_run_splits_tokens_and_checks_formats():
    """--tokens splits at 128 into the decode and the large group; an unknown format is rejected."""
    args = bench.parse_args(
        ["--no-eager", "--hidden", "8192", "--tokens", "128,1024,2048", "--formats", "none"]
    )
    assert (args.small_tokens, args.large_tokens, args.hidden, args.formats) == (
        [128],
        [1024, 2048],
        [8192],
        ["none"],
    )
    assert args.no_eager
    default = bench.parse_args([])
    assert (default.small_tokens, default.large_tokens) == ([1, 16, 128], [1024, 8192])
    with pytest.raises(SystemExit):
        bench.parse_args(["--formats", "none,fp4"])


def test_graph_verdict_compares_with_flashinfer_at_every_t():
    """Graph rows at T 1024 get a FlashInfer ratio (issue 43), judged against 1.0x."""
    key = {"T": 1024, "H": 8192, "format": "none", "normed": True, "bytes": 64 << 20}
    graph = [
        key | {"impl": "arnorm (triton)", "us": 20.1},
        key | {"impl": "fi_fused_add_rmsnorm", "us": 17.0},
    ]
    bench.judge({"eager": [], "graph": graph}, 3.0e12)
    assert graph[0]["verdict"] == "1.18x fi MISSED (target <= 1.0x)"


def test_buffer_sets_exceed_the_l2_between_two_uses():
    """Cold cells cycle through enough buffer sets that the others touched between two uses of one
    set hold at least COLD_L2_MULTIPLE times the L2; at least 2 sets, at most max_sets."""
    l2 = 50 << 20
    for set_bytes in (32 << 10, 1 << 20, 16 << 20, 48 << 20, 32 << 20, 512 << 20):
        n = bench.buffer_sets(l2, set_bytes, max_sets=1 << 20)
        assert n >= 2
        assert (n - 1) * set_bytes >= bench.COLD_L2_MULTIPLE * l2 or (n == 2 and set_bytes >= 2 * l2)
        assert (n - 2) * set_bytes < bench.COLD_L2_MULTIPLE * l2  # no more sets than needed
    assert bench.buffer_sets(l2, 16 << 10) == bench.MAX_SETS  # a decode cell: capped
    assert bench.buffer_sets(0, 1 << 20) == 2
    with pytest.raises(ValueError):
        bench.buffer_sets(l2, 0)


@pytest.mark.parametrize("l2_mib", [40, 50, 60, 96])
def test_buffer_sets_for_the_16_mib_cells(l2_mib):
    """T 1024 H 8192 unquantized with the normed output: 48 MiB touched in the separate layout,
    32 MiB in place; between two uses of a set, the others fill twice the L2 in both."""
    l2 = l2_mib << 20
    for layout, touched in (("separate", 48), ("in_place", 32)):
        fp = bench.footprint(1024, 8192, "none", True, layout)
        assert fp == (touched << 20) + 8192 * 2  # plus the weight
        n = bench.buffer_sets(l2, fp)
        assert (n - 1) * fp >= 2 * l2


def test_footprint_is_bytes_moved_less_the_tensors_written_over():
    """The new residual goes over an input in both layouts; the in-place layout moves the same
    bytes through one [T, H] tensor fewer where there is a normed output."""
    row = 2048 * 4096 * 2
    for fmt in bench.FORMATS:
        for normed in (True, False):
            moved = bench.bytes_moved(2048, 4096, fmt, normed)
            assert bench.footprint(2048, 4096, fmt, normed) == moved - row
            less = row if normed else 0
            assert bench.footprint(2048, 4096, fmt, normed, "in_place") == moved - row - less


def test_rotation_cycles_and_calls_per_graph_are_whole_turns():
    seen: list[int] = []
    call = bench.rotation([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        call()
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    assert bench.calls_per_graph(20, 3) == 21
    assert bench.calls_per_graph(20, 4096) == 4096
    assert bench.calls_per_graph(20, 1) == 20


def test_l2_modes_and_layouts_parse_in_report_order():
    args = bench.parse_args(["--l2", "hot,cold", "--layouts", "in_place,separate"])
    assert (args.l2, args.layouts) == (["cold", "hot"], ["separate", "in_place"])
    default = bench.parse_args([])
    assert (default.l2, default.layouts, default.max_sets) == (["cold", "hot"], ["separate"], bench.MAX_SETS)
    assert bench.parse_args(["--l2", "hot"]).l2 == ["hot"]
    for bad in (["--l2", "warm"], ["--layouts", "inplace"], ["--l2", ""]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def _graph_rows() -> list[dict]:
    key = {"T": 1024, "H": 8192, "format": "none", "normed": True, "bytes": 64 << 20}
    rows = []
    for mode, arnorm_us, in_place_us, fi_us in (("cold", 22.0, 21.9, 22.4), ("hot", 20.3, 17.0, 17.1)):
        common = key | {"l2": mode, "sets": 4 if mode == "cold" else 1}
        rows += [
            common
            | {"impl": "arnorm (triton)", "layout": "separate", "footprint": 48 << 20, "us": arnorm_us},
            common
            | {"impl": "arnorm (triton)", "layout": "in_place", "footprint": 32 << 20, "us": in_place_us},
            common
            | {"impl": "fi_fused_add_rmsnorm", "layout": "in_place", "footprint": 32 << 20, "us": fi_us},
        ]
    return rows


def test_graph_verdicts_compare_cold_with_cold_and_hot_with_hot():
    graph = _graph_rows()
    bench.judge({"eager": [], "graph": graph}, 3.0e12)
    verdicts = {(r["l2"], r["layout"], r["impl"]): r["verdict"] for r in graph}
    assert verdicts[("cold", "separate", "arnorm (triton)")] == "0.98x fi met"
    assert verdicts[("hot", "separate", "arnorm (triton)")] == "1.19x fi MISSED (target <= 1.0x)"
    assert verdicts[("hot", "in_place", "arnorm (triton)")] == "0.99x fi met"
    assert verdicts[("hot", "in_place", "fi_fused_add_rmsnorm")] == ""


def test_tables_render_cold_first_with_the_l2_size():
    """The markdown has the L2 size in its head, the cold table before the hot one, and a layout,
    MB touched and buffer-set column on every graph row."""
    graph = _graph_rows()
    report = {
        "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-07", "torch": "2.13", "triton": "3.6",
        "flashinfer": "0.6", "copy_bw": {"triton_copy": 3.0e12}, "copy_bw_best": 3.0e12, "smoke": False,
        "checks": {"H=8192 none normed=True": "ok"}, "errors": {}, "skipped": [], "eager": [], "graph": graph,
        "iters": 1, "eager_rounds": 1, "calls": 20, "replays": 7, "seconds": 1.0, "l2_bytes": 50 << 20,
        "l2_source": "torch.cuda.get_device_properties",
    }  # fmt: skip
    bench.judge(report, 3.0e12)
    text = bench.markdown(report)
    assert "L2: 50 MiB (torch.cuda.get_device_properties)" in text
    assert "NVIDIA H100 80GB HBM3 (2026-12-07)" in text
    cold, hot = text.index("L2 cold"), text.index("L2 hot")
    assert cold < hot
    assert "more than 2x the L2 (50 MiB)" in text
    assert "| 1024 | 8192 | none | yes | in_place | arnorm (triton) | 67.11 | 33.55 | 4 | 21.90 |" in text
    assert (
        "| 1024 | 8192 | none | yes | separate | arnorm (triton) | 67.11 | 50.33 | 1 | 20.30 |" in text[hot:]
    )
    assert "Targets missed: 1." in text


def test_hot_rows_of_an_older_run_render_in_the_hot_table():
    """A row without the l2 / layout keys (a run before cold figures) is a hot, separate row."""
    key = {"T": 1024, "H": 8192, "format": "none", "normed": True, "bytes": 64 << 20, "us": 20.1}
    graph = [key | {"impl": "arnorm (triton)", "verdict": ""}]
    lines = bench.graph_tables({"graph": graph, "calls": 20, "replays": 7, "l2_bytes": 50 << 20})
    text = "\n".join(lines)
    assert "L2 cold" not in text and "L2 hot" in text
    assert "| 1024 | 8192 | none | yes | separate | arnorm (triton) |" in text
