"""Plots: every figure the package draws (matplotlib on an Agg canvas), the only user of
matplotlib (an optional dependency: ``pip install matplotlib``).

- :func:`write_plots`: the swap-KL plots of a model card (per-layer scores, protocol gap,
  pair heatmap), named by :data:`PLOT_FILES`;
- :func:`write_sparsity_plot`: per-block sparsity of a pruned model;
- :func:`write_healing_plot`: training loss and held-out KL of healing vs tokens;
- :func:`figure` / :func:`save_png`: the canvas and byte-stable PNG writing that the
  peeling plots use too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .scoring.protocols import PROTOCOLS, protocol_color, protocol_label
from .scoring.report import SwapReport

__all__ = ["PLOT_FILES", "figure", "planned_plots", "save_png", "write_healing_plot", "write_plots",
           "write_sparsity_plot"]

#: Plot keys -> file names inside a checkpoint folder.
PLOT_FILES = {
    "layer_scores": "layerswap_layer_scores.png",
    "protocol_gap": "layerswap_protocol_gap.png",
    "pair_heatmap": "layerswap_pair_heatmap.png",
    "sparsity": "layerswap_sparsity.png",
    "healing": "layerswap_healing.png",
}


def planned_plots(report: SwapReport | None, *, sparsity: bool = False) -> list[str]:
    """Keys of :data:`PLOT_FILES` that :func:`write_plots` writes for ``report``, plus
    ``"sparsity"`` (:func:`write_sparsity_plot`) when ``sparsity`` is true."""
    if report is None:
        return ["sparsity"] if sparsity else []
    keys = ["layer_scores"]
    if set(PROTOCOLS) <= set(report.protocols):
        keys.append("protocol_gap")
    if report.max_gap > 1:
        keys.append("pair_heatmap")
    return keys + (["sparsity"] if sparsity else [])


def figure(width: float, height: float):
    """A matplotlib ``Figure`` of ``width`` x ``height`` inches at 110 dpi on an Agg canvas
    (no GUI backend, no global pyplot state).

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: Path) -> None:
    """Lay out ``fig`` and write it to ``path`` as PNG without the software tag, so the
    bytes are the same on every run."""
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})  # byte-stable across runs


def write_plots(report: SwapReport, directory: str | os.PathLike, *, removed: Sequence[int] = ()) -> dict[str, Path]:
    """Write the card's PNG plots (matplotlib, Agg canvas) into ``directory``.

    - ``layer_scores``: per-layer s(i) of each scored protocol (log scale, nats), removed
      layers shaded, non-finite scores marked at the top;
    - ``protocol_gap``: I/R = d_inter / d_repl per pair, with the line I/R = 1;
    - ``pair_heatmap`` (``max_gap > 1``): replacement above the diagonal, interchange below.

    Returns:
        ``{key: path}`` for the files written (see :func:`planned_plots`).

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    import matplotlib
    from matplotlib.colors import LogNorm

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    keys = planned_plots(report)
    written = {}
    L = report.num_blocks
    x = np.arange(L)
    colors = {p: protocol_color(p) for p in report.protocols}

    fig = figure(min(14.0, max(6.0, 0.28 * L + 2)), 3.6)
    ax = fig.add_subplot()
    width = 0.8 / len(report.protocols)
    finite_all = [v for p in report.protocols for v in report.layer_scores(p) if math.isfinite(v) and v > 0]
    top = max(finite_all) * 3 if finite_all else 1.0
    for k, p in enumerate(report.protocols):
        scores = np.array(report.layer_scores(p), dtype=float)
        ok = np.isfinite(scores)
        offset = (k - (len(report.protocols) - 1) / 2) * width
        ax.bar(x[ok] + offset, scores[ok], width=width, color=colors[p], label=f"{protocol_label(p)} s(i)")
        if (~ok).any():
            ax.scatter(x[~ok] + offset, np.full((~ok).sum(), top), marker="x", color=colors[p], label=f"{protocol_label(p)}: non-finite")
    for layer in removed:
        ax.axvspan(layer - 0.5, layer + 0.5, color="#999999", alpha=0.25, lw=0)
    if finite_all:
        ax.set_yscale("log")
        ax.set_ylim(top=top * 4)  # room for the legend above the tallest bar
    shown = x[:: max(1, L // 48)]
    ax.set_xticks(shown)
    ax.set_xticklabels([str(i) for i in shown], fontsize=7)
    for tick, layer in zip(ax.get_xticklabels(), shown):
        if layer in removed:
            tick.set_color("#b2182b")
            tick.set_fontweight("bold")
    ax.set_xlim(-0.6, L - 0.4)
    ax.set_xlabel("layer (0-based); shaded = removed")
    ax.set_ylabel("s(i) = min_j d(i, j)  [nats]")
    ax.set_title("Per-layer swap-KL scores (low = removable)")
    ax.legend(fontsize=8, loc="upper center", ncol=2, framealpha=0.9)
    save_png(fig, directory / PLOT_FILES["layer_scores"])
    written["layer_scores"] = directory / PLOT_FILES["layer_scores"]

    if "protocol_gap" in keys:
        rows = report.protocol_gap()["pairs"]
        fig = figure(min(12.0, max(6.0, 0.22 * L + 2)), 3.4)
        ax = fig.add_subplot()
        ratios = np.array([np.nan if r["ratio"] is None else r["ratio"] for r in rows], dtype=float)
        gaps = np.array([r["gap"] for r in rows])
        midpoints = np.array([(r["i"] + r["j"]) / 2 for r in rows])
        ok = np.isfinite(ratios)
        if report.max_gap == 1:
            ax.bar(midpoints[ok], ratios[ok], width=0.8, color=colors["interchange"])
            step = max(1, len(rows) // 40)
            ax.set_xticks(midpoints[::step])
            ax.set_xticklabels([f"{r['i']}-{r['j']}" for r in rows][::step], rotation=90, fontsize=7)
            ax.set_xlabel("adjacent pair i-j")
        else:
            cmap = matplotlib.colormaps["viridis"]
            for g in sorted(set(gaps.tolist())):
                sel = ok & (gaps == g)
                ax.plot(midpoints[sel], ratios[sel], "o-", ms=3, lw=1, color=cmap((g - 1) / max(1, gaps.max() - 1)),
                        label=f"j - i = {g}")
            ax.legend(fontsize=7, ncol=min(4, int(gaps.max())))
            ax.set_xlabel("pair midpoint (i + j) / 2")
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        finite = ratios[ok]
        if finite.size and finite.max() / max(finite.min(), 1e-12) > 30:
            ax.set_yscale("log")
        ax.set_ylabel("I/R = d_inter / d_repl")
        title = "Protocol gap per pair (below 1: interchange is the gentler probe)"
        if (~ok).any():
            title += f"; {int((~ok).sum())} non-finite pair(s) not drawn"
        ax.set_title(title, fontsize=10)
        save_png(fig, directory / PLOT_FILES["protocol_gap"])
        written["protocol_gap"] = directory / PLOT_FILES["protocol_gap"]

    if "pair_heatmap" in keys:
        grid = np.full((L, L), np.nan)
        for r in report.pairs:
            if r.replacement is not None:
                grid[r.i, r.j] = r.replacement
            if r.interchange is not None:
                grid[r.j, r.i] = r.interchange
        positive = grid[np.isfinite(grid) & (grid > 0)]
        fig = figure(6.0, 5.2)
        ax = fig.add_subplot()
        norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
        image = ax.imshow(np.where(np.isfinite(grid) & (grid > 0), grid, np.nan), norm=norm, cmap="magma_r")
        fig.colorbar(image, ax=ax, label="swap-KL [nats]")
        ax.set_xlabel("j")
        ax.set_ylabel("i")
        ax.set_title("Pair swap-KL: replacement above, interchange below the diagonal", fontsize=9)
        save_png(fig, directory / PLOT_FILES["pair_heatmap"])
        written["pair_heatmap"] = directory / PLOT_FILES["pair_heatmap"]
    return written


def write_sparsity_plot(summary: Mapping, path: str | os.PathLike, *, kept: Sequence[int] | None = None) -> Path:
    """Per-block target and achieved sparsity as a PNG (matplotlib, Agg canvas).

    Args:
        summary: :func:`~hf_layerswap.sparsity.config_record` of a sparsity report (or
            ``config.layerswap_sparsity``): ``original_blocks``, ``block_targets``,
            ``block_achieved`` (fractions), ``target_sparsity``, ``method``, ``allocation``.
        path: the PNG to write (through a temporary file and a rename).
        kept: original indices of the blocks still in the model; the others are hatched
            as removed after pruning. ``None`` = all kept.

    Returns:
        ``path``.

    Raises:
        ImportError: matplotlib is not installed.
    """
    path = Path(path)
    blocks = list(summary["original_blocks"])
    x = np.arange(len(blocks))
    fig = figure(min(14.0, max(6.0, 0.28 * len(blocks) + 2)), 3.4)
    ax = fig.add_subplot()
    gone = [k for k, b in enumerate(blocks) if kept is not None and b not in kept]
    bars = ax.bar(x, summary["block_achieved"], width=0.8, color="#7570b3", label="achieved")
    for k in gone:
        bars[k].set_hatch("//")
        bars[k].set_alpha(0.4)
    ax.plot(x, summary["block_targets"], "k_", ms=12, mew=2, label="allocated target")
    ax.axhline(summary["target_sparsity"], color="#d95f02", lw=1, ls="--",
               label=f"overall target {summary['target_sparsity']:g}")
    step = max(1, len(blocks) // 48)
    ax.set_xticks(x[::step])
    ax.set_xticklabels([str(b) for b in blocks][::step], fontsize=7)
    ax.set_xlim(-0.6, len(blocks) - 0.4)
    ax.set_ylim(0, min(1.0, max(max(summary["block_achieved"]), max(summary["block_targets"])) * 1.25 + 0.02))
    ax.set_xlabel("block (0-based, original numbering)" + ("; hatched = removed after pruning" if gone else ""))
    ax.set_ylabel("sparsity (fraction of zeros)")
    ax.set_title(f"Per-block sparsity: {summary['method']}, {summary.get('pattern') or 'unstructured'}, "
                 f"{summary['allocation']} allocation", fontsize=10)
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9)
    return _save_replacing(fig, path)


def _save_replacing(fig, path: Path) -> Path:
    """:func:`save_png` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_png(fig, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_healing_plot(report: Mapping, path: str | os.PathLike) -> Path:
    """Training loss and held-out KL of one healing run against training tokens, on one
    axes, as a PNG (matplotlib, Agg canvas).

    Args:
        report: :meth:`~hf_layerswap.HealReport.to_dict`: ``loss_history`` (``[{"step",
            "loss"}]``, nats), ``eval_history`` (``[{"step", "kl"}]``, nats),
            ``tokens_per_step``, ``kl_before``, ``kl_after``, ``method``.
        path: the PNG to write (through a temporary file and a rename).

    Returns:
        ``path``.

    Raises:
        ImportError: matplotlib is not installed.
    """
    path = Path(path)
    per_step = float(report.get("tokens_per_step") or 0.0) or 1.0
    unit = "tokens" if report.get("tokens_per_step") else "steps"
    fig = figure(6.4, 3.6)
    ax = fig.add_subplot()
    losses = report.get("loss_history") or []
    ax.plot([e["step"] * per_step for e in losses], [e["loss"] for e in losses], color="#999999", lw=1,
            label="training loss (KL on the training prompts)")
    evals = [{"step": 0, "kl": report["kl_before"]}] + list(report.get("eval_history") or [])
    ax.plot([e["step"] * per_step for e in evals], [e["kl"] for e in evals], "o-", color="#1b9e77", ms=4,
            label="held-out KL")
    ax.axhline(report["kl_before"], color="#d95f02", lw=1, ls="--", label=f"before healing {report['kl_before']:.4f}")
    ax.axhline(report["kl_after"], color="#7570b3", lw=1, ls=":", label=f"kept weights {report['kl_after']:.4f}")
    ax.set_xlabel(f"training {unit}")
    ax.set_ylabel("KL(teacher || student), nats/token")
    ax.set_title(f"Healing ({report.get('method', '?')}): loss and held-out KL", fontsize=10)
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    return _save_replacing(fig, path)
