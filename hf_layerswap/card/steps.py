"""The card's list of the steps a prune ran, in their order: one row per entry of
``config.layerswap["recipe"]`` (written by :func:`hf_layerswap.prune`, one entry per
:class:`~hf_layerswap.steps.Step`), each cell rendered from its record by the card code of
that kind of step (:data:`STEP_CELLS`)."""

from __future__ import annotations

from collections.abc import Mapping

from .checks import format_pct_plain, recovery_row
from .format import DASH, format_cell, format_indices
from .healing import kl_summary

__all__ = ["STEP_CELLS", "STEP_LABELS", "step_cell", "steps_section"]


def _score(entry: Mapping) -> str:
    if entry.get("skipped"):
        return f"no swap-KL pass: {entry['skipped']}"
    return f"swap-KL of {entry.get('pairs', DASH)} pairs, protocols {', '.join(entry.get('protocols') or [])}"


def _select(entry: Mapping) -> str:
    return f"{format_cell(entry.get('selection', DASH))}: blocks {format_indices(entry.get('layers') or [])}"


def _remove(entry: Mapping) -> str:
    text = f"blocks {format_indices(entry.get('layers') or [])} removed"
    return text + (f" (by the `{entry['repair']}` repair, next row)" if entry.get("repair") else "")


def _repair(entry: Mapping) -> str:
    row = recovery_row(entry)
    return row[1] if row is not None else DASH


def _heal(entry: Mapping) -> str:
    zeros = entry.get("kept_zeros")
    kept = f"; the sparsified model's {zeros:,} zero weights kept" if isinstance(zeros, int) else ""
    return f"`{entry.get('method')}` (healing run {entry.get('run', DASH)}): held-out KL {kl_summary(entry)}{kept}"


def _sparsify(entry: Mapping) -> str:
    achieved = entry.get("achieved_sparsity")
    return (f"{entry.get('method')}, {entry.get('pattern') or 'unstructured'}, {entry.get('allocation')} allocation: "
            f"target {format_pct_plain(entry.get('target_sparsity') or 0.0)}, achieved "
            + (format_pct_plain(achieved, 4) if isinstance(achieved, float) else DASH))


#: Each kind of step: its card cell from its record.
STEP_CELLS = {"score": _score, "select": _select, "remove": _remove, "repair": _repair, "heal": _heal,
              "sparsify": _sparsify}
#: Each kind of step as the card names it.
STEP_LABELS = {"score": "Score", "select": "Select", "remove": "Remove", "repair": "Repair", "heal": "Heal",
               "sparsify": "Sparsify"}


def step_cell(entry: Mapping) -> str:
    """The card cell of one recorded step (its kind's :data:`STEP_CELLS` entry; an unknown
    kind by its name)."""
    cell = STEP_CELLS.get(str(entry.get("step")))
    return cell(entry) if cell is not None else format_cell(entry.get("step"))


def steps_section(record: Mapping) -> str | None:
    """The card's ``## Steps`` markdown: a table of the steps in the order they ran
    (``config.layerswap["recipe"]``; a repair's cell reads the repair's own record,
    ``config.layerswap["recovery"]``), ``None`` when the record lists no step after the
    removal (a plain cut: the removal table says it all)."""
    entries = [e for e in record.get("recipe") or [] if isinstance(e, Mapping)]
    if not any(e.get("step") in ("repair", "heal", "sparsify") for e in entries):
        return None
    repair = record.get("recovery") if isinstance(record.get("recovery"), Mapping) else {}
    entries = [{**repair, **e} if e.get("step") == "repair" else e for e in entries]  # its fit: the repair's record
    rows = [f"| {n} | {STEP_LABELS.get(str(e.get('step')), format_cell(e.get('step')))} | "
            f"{step_cell(e).replace('|', chr(92) + '|')} |" for n, e in enumerate(entries, 1)]
    return "\n".join(["The steps of the prune, in the order they ran (`config.layerswap[\"recipe\"]`):", "",
                      "| # | step | what it did |", "|---|---|---|", *rows])
