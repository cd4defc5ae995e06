"""``arnorm bench``'s report: every rank's samples combined, the markdown table, the plot.

A sample is the slowest rank's time for one iteration (or one graph replay); a point's median and
p10-p90 are over those, and its speed-up is the baseline's median over its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "BASELINE",
    "SMOKE_TEST",
    "auto_points",
    "combine",
    "percentile",
    "plot_figure",
    "render_table",
    "write_plot",
]

BASELINE = "baseline"
#: Printed under a CPU run's table and plot: gloo and the CPU say nothing about GPU kernels.
SMOKE_TEST = "CPU run: a smoke test of the bench itself; these numbers say nothing about GPU backends"


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between the closest ranks."""
    s = sorted(samples)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def combine(
    per_rank: list[dict[str, Any]], meta: dict[str, Any], rejected: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """One report: per iteration the slowest rank, then median, p10, p90 and speed-up per point."""
    first = per_rank[0]
    rows = []
    for i, entry in enumerate(first["results"]):
        per = [r["results"][i]["samples_us"] for r in per_rank]
        samples = [max(v) for v in zip(*per, strict=True)]
        row = {"backend": entry["backend"], "tokens": entry["tokens"], "error": entry["error"]}
        if "picked" in entry:  # the auto row: the backend selection ran at this token count
            row["picked"] = entry["picked"]
        notes = {r["results"][i].get("note") for r in per_rank} - {None}
        row["note"] = "; ".join(sorted(notes)) or None
        if "restore_us" in entry:
            row["rank_restore_us"] = [r["results"][i].get("restore_us") for r in per_rank]
        for key, q in (("median_us", 50), ("p10_us", 10), ("p90_us", 90)):
            row[key] = percentile(samples, q) if samples else None
        row.update(samples_us=samples, rank_samples_us=per)
        rows.append(row)
    base = {r["tokens"]: r.get("median_us") for r in rows if r["backend"] == BASELINE}
    for r in rows:
        b = base.get(r["tokens"])
        r["speedup"] = b / r["median_us"] if b and r["median_us"] else None
    rejected = dict(rejected)
    for r in per_rank:
        rejected.update(r["rejected"])
    timed = [n for n in meta["backends"] if n not in rejected]
    extra = {"timed": timed, "rejected": rejected, "auto": first["auto"], "auto_error": first["auto_error"]}
    return {**meta, **extra, "results": rows}


def chooser(report: dict[str, Any]) -> str:
    """Who picked the marked backend per token count: ``"auto mode"``, or ``"ARNORM_BACKEND"``
    when that variable named the backends (the marked op reads it as any op does)."""
    choice = report.get("choice", "auto")
    return "auto mode" if choice == "auto" else choice


def _fmt(us: float) -> str:
    return f"{us:.0f}" if us >= 100 else f"{us:.1f}" if us >= 10 else f"{us:.2f}"


def _samples_text(report: dict[str, Any]) -> str:
    from arnorm.cli._bench_timing import GRAPH_CALLS

    n, warm = report["iters"], report["warmup"]
    if report.get("timing") == "CUDA graphs":
        return (
            f"{n} samples per point, each the time per call of a CUDA-graph replay of {GRAPH_CALLS} calls "
            f"(the partial's restore copy subtracted), after {warm} warm-up calls"
        )
    return f"{n} timed + {warm} warm-up calls per point, one at a time ({report.get('timing', '?')})"


def render_table(report: dict[str, Any]) -> str:
    """The report as a markdown table, one row per (token count, backend), plus what was not timed."""
    head = (
        f"arnorm bench: tp={report['tp']} hidden={report['hidden']} {report['dtype']} "
        f"quant={report['quant'] or 'none'}{' batch-invariant' if report.get('batch_invariant') else ''} "
        f"on {report['device']} ({report['comm']}, {report['launcher']}); "
        f"{_samples_text(report)}\n"
        f"latency per call in us: median and p10-p90 over samples, each the slowest rank's time"
    )
    by = chooser(report)
    mark = "auto" if by == "auto mode" else by
    rows = [("tokens", "backend", "median us", "p10-p90 us", "vs baseline", mark)]
    order = [BASELINE, *report["backends"]]
    for r in sorted(report["results"], key=lambda r: (r["tokens"], order.index(r["backend"]))):
        if r["samples_us"]:
            cells = (_fmt(r["median_us"]), f"{_fmt(r['p10_us'])}-{_fmt(r['p90_us'])}")
            speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        else:
            cells, speed = ("n/a", r["error"] or "-"), "-"
        if "picked" in r:
            picked = f"ran {r['picked'] or 'nothing'}"
        else:
            picked = f"<- {mark}" if report["auto"].get(str(r["tokens"])) == r["backend"] else ""
        rows.append((str(r["tokens"]), r["backend"], *cells, speed, picked))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    right = (True, False, True, False, True, False)
    lines = [head, ""]
    for k, row in enumerate(rows):
        padded = [c.rjust(w) if rj else c.ljust(w) for c, w, rj in zip(row, widths, right, strict=True)]
        lines.append("| " + " | ".join(padded) + " |")
        if k == 0:
            dashes = ["-" * (w - 1) + ":" if rj else "-" * w for w, rj in zip(widths, right, strict=True)]
            lines.append("| " + " | ".join(dashes) + " |")
    timed = {BASELINE, *report["timed"]}
    picks = ", ".join(
        f"T={t}: {n}" + ("" if n in timed or n == "-" else " (not timed)") for t, n in report["auto"].items()
    )
    lines.append("")
    lines.extend(f"T={r['tokens']} {r['backend']}: {r['note']}" for r in report["results"] if r.get("note"))
    lines.append(f"{by} picks: {picks or 'nothing'}")
    lines.extend(f"{by}: {r}" for r in report["auto_error"])
    for name, why in report["rejected"].items():
        lines.append(f"not timed: {name} ({why['status']}): " + "; ".join(why["reasons"]))
    if report["device"] == "cpu":
        lines.append(SMOKE_TEST)
    return "\n".join(lines)


def auto_points(report: dict[str, Any]) -> list[tuple[int, float, str]]:
    """``(tokens, median us, backend)`` of the timed point auto mode would run, per token count."""
    points = []
    for r in report["results"]:
        if r["samples_us"] and report["auto"].get(str(r["tokens"])) == r["backend"]:
            points.append((r["tokens"], r["median_us"], r["backend"]))
    return sorted(points)


def plot_figure(report: dict[str, Any]) -> Any:
    """Median latency against tokens (log-log), p10-p90 shaded; one line per backend plus the
    baseline; a ring around each point auto mode picks. Returns the matplotlib ``Figure``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name in [BASELINE, *report["timed"]]:
        pts = [r for r in report["results"] if r["backend"] == name and r["samples_us"]]
        if not pts:
            continue
        t = [r["tokens"] for r in pts]
        style: dict[str, Any] = {"color": "black", "linestyle": "--"} if name == BASELINE else {}
        (line,) = ax.plot(t, [r["median_us"] for r in pts], marker="o", label=name, **style)
        ax.fill_between(
            t, [r["p10_us"] for r in pts], [r["p90_us"] for r in pts], color=line.get_color(), alpha=0.15
        )
    picked = auto_points(report)
    if picked:
        ax.plot(
            [p[0] for p in picked],
            [p[1] for p in picked],
            linestyle="none",
            marker="o",
            markersize=14,
            markerfacecolor="none",
            markeredgecolor="crimson",
            markeredgewidth=2,
            label=f"{chooser(report)}'s pick",
            gid="auto",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(report["tokens"], labels=[str(t) for t in report["tokens"]])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("tokens")
    ax.set_ylabel("latency per call (us, median; p10-p90 shaded)")
    title = (
        f"arnorm bench: TP {report['tp']}, H {report['hidden']}, {report['dtype']}, "
        f"quant {report['quant'] or 'none'}, {report['device']}"
    )
    if report["device"] == "cpu":
        title += "\n(CPU: a smoke test of the bench, not a measure of GPU backends)"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def write_plot(report: dict[str, Any], path: str) -> None:
    """Save :func:`plot_figure` as a PNG."""
    plot_figure(report).savefig(path, dpi=120)
