"""The card's healing section: what :func:`~hf_layerswap.healing.heal` did to the pruned
model, always with its held-out numbers before and after (a healing record without them is
shown as such, never as an improvement)."""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["HEALING_FILE", "healing_section"]

#: The healing report sidecar (``HealReport.to_json``: the loss and held-out KL histories).
HEALING_FILE = "layerswap_healing.json"
_DASH = "—"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _nats(value) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and math.isfinite(value) else _DASH


def _change(before, after) -> str:
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (before, after)) or not before:
        return _DASH
    return f"{100 * (after - before) / before:+.1f}%"


def _kl_row(entry: Mapping) -> str:
    before, after = entry.get("kl_before"), entry.get("kl_after")
    if before is None or after is None:
        return "not recorded: this healing cannot be judged (no held-out KL before and after)"
    text = f"{_nats(before)} → {_nats(after)} nats/token ({_change(before, after)})"
    if entry.get("reverted"):
        text += "; no evaluation beat the start, so the starting weights were kept"
    return text


def _perplexity_rows(entry: Mapping, repaired: bool) -> list[tuple[str, str]]:
    ppl = entry.get("perplexity") or {}
    if "before" not in ppl or "after" not in ppl:
        return []
    where = f" ({ppl['contract']} contract" + (f", {ppl['text']}" if ppl.get("text") else "") + ")" if ppl.get(
        "contract") else ""
    start = "after repair" if repaired else "after the cut"
    return [(f"Perplexity {start} → after healing{where}",
             f"{ppl['before']:.3f} → {ppl['after']:.3f} ({_change(ppl['before'], ppl['after'])})")]


def _distinct(entry: Mapping) -> str:
    """`` (D distinct, packed text, E epochs)`` when the entry records its distinct tokens."""
    if entry.get("distinct_tokens") is None or entry.get("epochs") is None:
        return ""
    text = "packed text" if entry.get("packing") else "one paragraph per prompt"
    return f" ({entry['distinct_tokens']:,} distinct, {text}, {entry['epochs']:.2f} epochs)"


def _entry_rows(entry: Mapping, repaired: bool) -> list[tuple[str, str]]:
    teacher = ("the dense model's full logits, on the fly" if entry.get("teacher_top_k") is None else
               f"the dense model's top-{entry['teacher_top_k']} log-probs plus the rest's mass, cached "
               "(a lower bound of the full KL)")
    options = ", ".join(f"{k}={v}" for k, v in sorted((entry.get("options") or {}).items()))
    data = str(entry.get("data", _DASH)) + (f" (sha256 {entry['data_hash'][:12]}…)" if entry.get("data_hash") else "")
    rows = [
        ("Method", f"`{entry.get('method', _DASH)}`" + (f" ({options})" if options else "")),
        ("Training", f"{entry.get('tokens', 0):,} tokens{_distinct(entry)}, {entry.get('steps', 0)} steps, learning rate "
                     f"{entry.get('learning_rate', _DASH)}, seed {entry.get('seed', _DASH)}"),
        ("Teacher", teacher),
        ("Data", data),
        ("Held-out KL(teacher ‖ student) before → after", _kl_row(entry)),
        ("Held-out prompts", str(entry.get("heldout", _DASH))),
        ("Final training loss", _nats(entry.get("final_loss")) + " nats/token"),
    ]
    rows += _perplexity_rows(entry, repaired)
    if entry.get("stale"):
        rows.append(("Status", f"**stale**: {entry['stale']}"))
    return rows


def healing_section(record: Mapping, *, plot: str | None = None) -> str | None:
    """The card's ``## Healing`` markdown for ``config.layerswap`` (``None`` when it records no
    healing): one table per healing run, newest last, each with its held-out KL before and
    after, its perplexity after the cut or repair and after healing when measured, and
    ``plot`` (a PNG file name next to the card) under the last run.
    """
    runs = [e for e in record.get("healing") or [] if isinstance(e, Mapping)]
    if not runs:
        return None
    repaired = bool(record.get("recovery"))
    parts = ["The pruned model was distilled from the dense model it was cut from (KL of the next-token "
             "distributions, on calibration text, never the evaluation text), with an early stop on held-out KL "
             "that keeps the best weights. Trained updates are in the weights themselves (LoRA merged back): no PEFT "
             "modules or adapter files are needed."]
    for n, entry in enumerate(runs, 1):
        title = f"### Healing run {n}" if len(runs) > 1 else None
        table = ["| | |", "|---|---|"] + [f"| {_cell(k)} | {_cell(v)} |" for k, v in _entry_rows(entry, repaired)]
        parts.append("\n".join(([title, ""] if title else []) + table))
    if plot:
        parts.append(f"![Healing: training loss and held-out KL against training tokens]({plot})")
    return "\n\n".join(parts)
