"""Peeling presentation: markdown tables and PNG plots of a :class:`PeelReport` and of a
:class:`PeelTrajectory` (matplotlib through :mod:`hf_layerswap.plots`)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from ..utils.jsonio import atomic_path
from ..plots import figure, save_png
from .report import DEFAULT_TAU, REFERENCES, PeelProbe, PeelReport
from .trajectory import PeelTrajectory


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "—"
    if math.isnan(x):
        return "nan"
    return f"{x:+.{digits}f}"


# ----------------------------------------------------------------------------- rendering


def _gap_cell(p: PeelProbe | None) -> str:
    if p is None:
        return "—"
    return f"{_fmt(p.dce)} [{_fmt(p.ci_low)}, {_fmt(p.ci_high)}]"


def _ev_cell(p: PeelProbe | None) -> str:
    if p is None or math.isnan(p.explained_variance):
        return "—"
    return f"{p.explained_variance:.3f}"


def peel_table_markdown(report: PeelReport, *, reference: str = "linear") -> str:
    """Markdown table of the per-layer reference gaps (one row per site k, 0-based).

    Columns: the held-out explained variance and ΔCE [95% CI] of ``reference`` for every
    span in the report, the map onto the final stream (``k → end``), ΔCE of the other
    references at span 1 when present, and the flags (``beaten``: the reference beats
    the blocks, CI below 0; ``matched``: CI upper end ≤ tau). ΔCE in nats per token.
    """
    if reference not in REFERENCES:
        raise ValueError(f"reference={reference!r}: allowed {list(REFERENCES)}")
    spans = report.settings.get("spans", sorted({p.span for p in report.probes if p.kind == "own"}))
    others = [r for r in report.settings.get("references", []) if r != reference]
    L = report.num_blocks
    head = ["layer"]
    for m in spans:
        label = "k" if m == 1 else f"k..k+{m - 1}"
        head += [f"EV {label}", f"ΔCE {label} [95% CI]"]
    has_later = any(p.target == L and p.reference == reference for p in report.probes)
    if has_later:
        head.append("ΔCE k→end [95% CI]")
    head += [f"ΔCE {r} k" for r in others]
    head.append("flags")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in range(L):
        row = [str(k)]
        for m in spans:
            p = report.probe(k, m, reference)
            row += [_ev_cell(p), _gap_cell(p)]
        if has_later:
            row.append(_gap_cell(report.probe(k, L - k, reference)) if k > 0 else "—")
        row += [_gap_cell(report.probe(k, 1, r)) for r in others]
        flags = []
        for p in report.probes:
            if p.site == k and p.flag:
                where = "end" if p.target == L and p.kind == "later" else f"span {p.span}"
                flags.append(f"{p.flag} ({p.reference}, {where})")
        row.append("; ".join(flags))
        lines.append("| " + " | ".join(row) + " |")
    s = report.settings
    meta = report.metadata
    lo, hi = report.base_ce_ci
    notes = [
        f"Base CE {report.base_ce:.4f} nats/token [{lo:.4f}, {hi:.4f}] on {meta.get('evaluation_predicted_tokens')} "
        f"held-out tokens ({meta.get('evaluation_sequences')} sequences). ΔCE = CE(hybrid) − CE(model); "
        f"negative with the CI below 0 = the reference beats the trained blocks ({s.get('bootstrap')} paired "
        f"bootstrap resamples of sequences). EV = held-out explained variance of the blocks' update. "
        f"Linear references: ridge {s.get('ridge')} (relative, toward the identity), affine={s.get('bias')}; "
        f"matched = CI upper end ≤ tau = {s.get('tau')} nats.",
    ]
    return "\n".join(lines) + "\n\n" + " ".join(notes) + "\n"


def _plot_canvas(width: float, height: float, rows: int = 1, cols: int = 1):
    fig = figure(width, height)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(rows * cols)]
    return fig, axes


def _write_png(fig, path: str | os.PathLike) -> Path:
    """Save through a temporary file in the same folder, then rename."""
    with atomic_path(path, suffix=".png") as tmp:
        save_png(fig, tmp)
    return Path(path)


def peel_plot(report: PeelReport, path: str | os.PathLike, *, reference: str = "linear") -> Path:
    """PNG (matplotlib, Agg canvas) of the per-layer reference gaps.

    Top: ΔCE [95% CI] per site for every span and the ``k → end`` map (symmetric-log
    axis, linear within ±tau), beaten probes filled red. Bottom: held-out explained
    variance of the fits. Returns the path written.

    Raises:
        ImportError: matplotlib is not installed.
    """
    L = report.num_blocks
    fig, (ax, ax2) = _plot_canvas(max(6.0, 0.3 * L + 2.5), 5.6, rows=2)
    series = [(f"span {m}", [report.probe(k, m, reference) for k in range(L)]) for m in report.settings.get("spans", [1])]
    if any(p.kind == "later" and p.reference == reference for p in report.probes):
        series.append(("k → end", [report.probe(k, L - k, reference) if k > 0 else None for k in range(L)]))
    for r in report.settings.get("references", []):
        if r != reference:
            series.append((f"{r}, span 1", [report.probe(k, 1, r) for k in range(L)]))
    colors = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#a6761d"]
    width = 0.8 / max(1, len(series))
    for n, (label, probes) in enumerate(series):
        xs = np.array([k for k, p in enumerate(probes) if p is not None], dtype=float)
        if not xs.size:
            continue
        ps = [p for p in probes if p is not None]
        y = np.array([p.dce for p in ps])
        err = np.array([[p.dce - p.ci_low for p in ps], [p.ci_high - p.dce for p in ps]])
        off = (n - (len(series) - 1) / 2) * width
        color = colors[n % len(colors)]
        ax.errorbar(xs + off, y, yerr=np.clip(err, 0, None), fmt="o", ms=3.5, color=color, lw=0.8, label=label,
                    mfc="white")
        beaten = np.array([p.flag == "beaten" for p in ps])
        if beaten.any():
            ax.scatter(xs[beaten] + off, y[beaten], color="#b2182b", s=18, zorder=3)
        evs = np.array([p.explained_variance for p in ps])
        if label.startswith("span") or label == "k → end":
            ax2.plot(xs, evs, "o-", ms=3, lw=1, color=color, label=label)
    tau = float(report.settings.get("tau", DEFAULT_TAU)) or 1e-3
    ax.set_yscale("symlog", linthresh=tau)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.axhline(tau, color="grey", lw=0.6, ls="--")
    ax.set_xlim(-0.6, L - 0.4)
    ax.set_xticks(range(L))
    ax.set_ylabel("ΔCE [nats/token]")
    ax.set_title("Peeling: CE(hybrid) − CE(model) with the reference in place of blocks k.. (red: beaten)", fontsize=9)
    ax.legend(fontsize=7, ncol=min(4, len(series)))
    ax2.set_xlim(-0.6, L - 0.4)
    ax2.set_xticks(range(L))
    ax2.set_ylim(min(0.0, ax2.get_ylim()[0]), 1.02)
    ax2.set_xlabel("site k (0-based first replaced block)")
    ax2.set_ylabel("held-out EV of update")
    return _write_png(fig, path)




def trajectory_table_markdown(trajectory: PeelTrajectory, *, span: int = 1, reference: str = "linear") -> str:
    """Markdown table: one row per checkpoint with base CE, ΔCE per site k (``span``;
    ``span=0``: the map onto the final stream), the peel bound, flag counts and the mean
    I/R over pairs."""
    if not trajectory.points:
        return ""
    L = trajectory.points[0].peel.num_blocks
    def site(k: int) -> str:
        return f"{k}→end" if span == 0 else (str(k) if span == 1 else f"{k}..{k + span - 1}")

    head = ["step", "CE [nats]"] + [f"ΔCE {site(k)}" for k in range(L)] + ["peel bound", "beaten", "matched", "mean I/R"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = trajectory.protocol_gap_series()
    for n, (pt, gaps) in enumerate(zip(trajectory.points, trajectory.gap_matrix(span, reference))):
        bound = pt.peel.peel_bound
        finite = [v[n] for v in ratios.values() if v[n] is not None and math.isfinite(v[n])]
        row = [str(pt.step), f"{pt.peel.base_ce:.3f}"] + [_fmt(g, 3) for g in gaps]
        row.append("—" if bound is None else f"{_fmt(bound.dce, 3)} (k={bound.site}, m={bound.span}, {bound.reference})")
        row += [str(len(pt.peel.flagged("beaten"))), str(len(pt.peel.flagged("matched")))]
        row.append(f"{sum(finite) / len(finite):.3f}" if finite else "—")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def trajectory_plot(trajectory: PeelTrajectory, path: str | os.PathLike, *, reference: str = "linear") -> Path:
    """PNG of a training trajectory (2 x 2 panels, x = training step):

    held-out CE with the numbers of beaten and matched probes; per-layer ΔCE of the span-1 references; per-layer ΔCE of
    the map onto the final stream; and I/R = d_inter / d_repl per adjacent pair.

    Raises:
        ImportError: matplotlib is not installed.
    """
    pts = trajectory.points
    x = np.array([p.step if p.step is not None else n for n, p in enumerate(pts)], dtype=float)
    L = pts[0].peel.num_blocks
    fig, axes = _plot_canvas(10.0, 7.0, rows=2, cols=2)
    cmap = __import__("matplotlib").colormaps["viridis"]
    ax = axes[0]
    ax.plot(x, [p.peel.base_ce for p in pts], "o-", color="black", label="model CE (held-out)")
    ax.set_ylabel("CE [nats/token]")
    ax.set_title("Held-out CE; probes flagged beaten / matched", fontsize=9)
    twin = ax.twinx()
    twin.plot(x, [len(p.peel.flagged("beaten")) for p in pts], "v--", color="#b2182b", label="beaten (CI < 0)")
    twin.plot(x, [len(p.peel.flagged("matched")) for p in pts], "^--", color="#2166ac", label="matched (CI ≤ tau)")
    twin.set_ylabel("probes flagged")
    twin.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()
    extra = twin.get_legend_handles_labels()
    ax.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=7)
    tau = float(pts[0].peel.settings.get("tau", DEFAULT_TAU)) or 1e-3
    for ax, span, title in ((axes[1], 1, "ΔCE, linear reference for block k"), (axes[2], 0, "ΔCE, linear map h_k → h_L")):
        grid = np.array([[np.nan if v is None else v for v in row] for row in trajectory.gap_matrix(span, reference)])
        for k in range(L):
            if np.isfinite(grid[:, k]).any():
                ax.plot(x, grid[:, k], "o-", ms=3, lw=1, color=cmap(k / max(1, L - 1)), label=f"k={k}")
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_yscale("symlog", linthresh=tau)
        ax.set_ylabel("ΔCE [nats/token]")
        ax.set_title(title + " (< 0: reference beats the model)", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    ax = axes[3]
    series = trajectory.protocol_gap_series()
    adjacent = [key for key in series if int(key.split("-")[1]) - int(key.split("-")[0]) == 1]
    for n, key in enumerate(adjacent):
        y = np.array([np.nan if v is None else v for v in series[key]], dtype=float)
        ax.plot(x, y, "o-", ms=3, lw=1, color=cmap(n / max(1, len(adjacent) - 1)), label=key)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    if adjacent:
        ax.set_yscale("log")
        ax.legend(fontsize=6, ncol=2)
    ax.set_ylabel("I/R = d_inter / d_repl")
    ax.set_title("Protocol gap per adjacent pair", fontsize=9)
    for ax in axes:
        ax.set_xlabel("training step")
    return _write_png(fig, path)
