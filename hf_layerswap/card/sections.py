"""The card's sections as data for the template: the swap-KL report, the candidate sets
of each protocol and the search, evaluation, calibration, cost, versions and the
reproduction and loading snippets."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import huggingface_hub

from ..calibration import shortfall_text
from ..config import LayerSwapConfig
from ..utils.provenance import library_versions
from ..scoring.protocols import PROTOCOLS, SWAP_PROTOCOLS, protocol_label
from ..scoring.report import set_key, SwapReport
from ..scoring.rule import NonFiniteScoresError, greedy_select, resolve_protect

from ..selection.registry import NO_PROTOCOL
from .checks import last_decision, step_config, step_provenance, step_strategy
from .evaluation import measured_contract, perplexity_eval_results
from .format import DASH, HUB_ID, MAX_PAIR_ROWS, REPORT_FILE, format_cell, format_indices, format_kl, format_pct, format_ratio

__all__ = [
    "calibration_rows", "candidates_section", "cost_rows", "evaluation_section", "load_snippet", "report_section",
    "reproduce_section", "unscored_why", "versions_section",
]


# ---------------------------------------------------------------------- sections
def report_section(report: SwapReport, removed: Sequence[int], protect: Sequence[int]) -> dict:
    """Template values of the scoring report: per-layer scores and ranks, pair rows, protected blocks."""
    protected = resolve_protect(protect, report.num_blocks)
    scores = {p: report.layer_scores(p) for p in report.protocols}
    ranks = {p: {layer: n + 1 for n, layer in enumerate(report.ranking(p))} for p in report.protocols}
    layer_rows = []
    for layer in range(report.num_blocks):
        status = "**removed**" if layer in removed else ("protected" if layer in protected else "")
        if layer in removed and not any(math.isfinite(scores[p][layer]) for p in report.protocols):
            status = "**removed** (its score is non-finite: not a basis for the removal)"
        layer_rows.append(
            {
                "layer": layer,
                "scores": [format_kl(scores[p][layer]) for p in report.protocols],
                "ranks": [ranks[p][layer] if math.isfinite(scores[p][layer]) else DASH for p in report.protocols],
                "status": status,
            }
        )
    pairs, note = report.pairs, None
    if len(pairs) > MAX_PAIR_ROWS:
        key = next((p for p in reversed(PROTOCOLS) if p in report.protocols), report.protocols[0])
        adjacent = [r for r in pairs if r.gap == 1]
        rest = sorted((r for r in pairs if r.gap > 1), key=lambda r: (_nan_last(r.value(key)), r.i, r.j))
        pairs = sorted(adjacent + rest[: max(0, MAX_PAIR_ROWS - len(adjacent))], key=lambda r: (r.i, r.j))
        note = (
            f"{len(report.pairs)} pairs were scored; the table lists the {len(adjacent)} adjacent pairs and the "
            f"lowest-{key} pairs further apart ({len(pairs)} rows). Every pair is in `{REPORT_FILE}`."
        )
    pair_rows = [
        {
            "i": r.i,
            "j": r.j,
            "repl_ij": format_kl(r.replacement_ij),
            "repl_ji": format_kl(r.replacement_ji),
            "repl": format_kl(r.replacement),
            "inter": format_kl(r.interchange),
            "ratio": format_ratio(r.ratio),
        }
        for r in pairs
    ]
    gap_summary = None
    if set(PROTOCOLS) <= set(report.protocols):
        s = report.protocol_gap()["summary"]
        if s["finite_pairs"]:
            gap_summary = (
                f"mean I/R = {s['mean_ratio']:.3f}, median {s['median_ratio']:.3f} over {s['finite_pairs']} pairs "
                f"with finite values; interchange ≤ replacement on "
                f"{100 * s['fraction_interchange_le_replacement']:.0f}% of them (the paper reports "
                "d_inter ≤ d_repl on every model and pair it measured)."
            )
            if len(s["mean_ratio_by_gap"]) > 1:
                by_gap = ", ".join(f"{g}: {v:.3f}" for g, v in s["mean_ratio_by_gap"].items())
                gap_summary += f" Mean I/R by pair distance j − i: {by_gap}."
        nonfinite = s["pairs"] - s["finite_pairs"]
        if nonfinite:
            gap_summary = (gap_summary or "") + (
                f" {nonfinite} pair(s) have a non-finite value (shown as NaN/inf: a result, not dropped)."
            )
    return {
        "protocols": [protocol_label(p) for p in report.protocols],
        "max_gap": report.max_gap,
        "layer_rows": layer_rows,
        "pair_rows": pair_rows,
        "pair_note": note,
        "gap_summary": gap_summary,
    }


def _nan_last(v):
    return (1, 0.0) if v is None or not math.isfinite(v) else (0, v)


def _layers_named(err: NonFiniteScoresError) -> str:
    return format_indices([int(label.split()[-1]) for label in err.nonfinite])


def candidates_section(report, removed, spacing, protect, steps) -> tuple[list[dict], str, str]:
    """``(rows, why, removed_kl)``: each protocol's chosen set with its joint removal KL, why the removed set won, and its KL."""
    rows, sets = [], {}
    removed_kl = format_kl(report.removal_kl.get(set_key(removed))) if set_key(removed) in report.removal_kl else "not measured"
    entry, decision = last_decision(steps)
    own = entry.card_candidates(decision, report, removed, format_kl, format_indices) if entry and entry.card_candidates else None
    if own is not None:  # the strategy's record carries its candidates and the reason
        rows, reason = own
        if len(steps) > 1:
            reason = f"the blocks were removed in {len(steps)} steps (table above); the last step: " + reason
        return rows, reason, removed_kl
    for p in report.protocols:
        try:
            chosen = greedy_select(report.layer_scores(p), len(removed), spacing=spacing, protect=protect)
        except NonFiniteScoresError as err:
            rows.append({"protocol": p, "layers": f"none: non-finite scores of layers {_layers_named(err)}",
                         "removal_kl": DASH})
            continue
        except ValueError as err:
            rows.append({"protocol": p, "layers": f"not possible under these rules ({err})", "removal_kl": DASH})
            continue
        sets[p] = chosen
        rows.append(
            {
                "protocol": protocol_label(p),
                "layers": format_indices(chosen),
                "removal_kl": format_kl(report.removal_kl.get(set_key(chosen))),
            }
        )
    return rows, _why(steps, removed, sets), removed_kl


def unscored_why(steps, removed) -> str:
    """Why the removed set was chosen when no swap-KL table was measured: the strategy's
    own reason (its registry entry's ``card_reason``), else its rule in words; no protocol's
    set to compare with."""
    return _why(steps, removed, {})


def _why(steps, removed, sets) -> str:
    entry, record = step_strategy(steps[-1] if steps else {})
    own = entry.card_reason(record, format_kl, format_indices) if entry is not None and entry.card_reason else None
    if len(steps) > 1:
        reason = f"the blocks were removed in {len(steps)} steps (table above); the last step: "
    else:
        reason = ""
    if own:
        reason += own
    elif record.selection == "explicit layers":
        reason += "the blocks were given explicitly (`LayerSwapConfig(layers=...)` or `remove_layers`)."
    elif record.strategy and record.selection != "not recorded":
        reason += f"strategy **{record.strategy}** ({record.selection})."
    elif record.protocol in SWAP_PROTOCOLS:
        reason += f"greedy selection on the **{record.protocol}** scores (the paper's rule)."
    elif steps:
        reason += "`remove_layers` was called without a selection record."
    else:
        reason += "the model carries no removal record (`config.layerswap`)."
    matching = [p for p, s in sets.items() if list(s) == list(removed)]
    if len(matching) == len(sets) and sets:
        reason += " Both protocols pick this same set at this budget."
    elif matching:
        reason += f" It is the set the {matching[0]} protocol picks; the other protocol picks a different one."
    elif sets:
        reason += " It is neither protocol's greedy set under the rule shown."
    return reason


def _no_ci(windows) -> str:
    """The CI cell of a result without one: one window has no bootstrap interval."""
    return f"none ({windows} window)" if isinstance(windows, int) and windows < 2 else DASH


def evaluation_section(evaluation: dict) -> tuple[dict, list]:
    """``(section, eval_results)``: the card's perplexity table (rows, ΔPPL, the contract) and its ``model-index``
    entries, for an evaluation checked by :func:`~hf_layerswap.card.checks.normalize_evaluation`."""
    rows = []
    for key, label in (("base", "base"), ("pruned", "pruned (this model)")):
        r = evaluation.get(key)
        if r is None:
            continue
        lo, hi = r.get("ci_low"), r.get("ci_high")
        rows.append(
            {
                "name": label,
                "ppl": f"{r['ppl']:.3f}",
                "ci": f"[{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else _no_ci(r.get("windows")),
                "nll": format_kl(r["nll"] / r["tokens"]) if r.get("nll") is not None and r.get("tokens") else DASH,
                "tokens": f"{r['tokens']:,}" if isinstance(r.get("tokens"), int) else DASH,
                "windows": f"{r['windows']:,}" if isinstance(r.get("windows"), int) else DASH,
            }
        )
    base, pruned = evaluation.get("base"), evaluation.get("pruned")
    delta = format_pct(100 * (pruned["ppl"] / base["ppl"] - 1)) if base and pruned else None
    contract = measured_contract(pruned or base)  # one contract: normalize_evaluation refuses two
    section = {
        "rows": rows,
        "delta": delta,
        "contract": [(k, format_cell(v)) for k, v in contract.items()],
    }
    return section, _eval_results(evaluation, contract)


def _eval_results(evaluation: dict, contract: Mapping) -> list:
    return perplexity_eval_results(contract, [
        (name, evaluation[key]["ppl"]) for key, name in (
            ("pruned", "Perplexity (this model)"), ("base", "Perplexity (base model, same contract)")) if key in evaluation])


def calibration_rows(report, steps, ident) -> list:
    """Rows of the card's calibration table (source, content hash, prompts, tokens) from the report or the removal
    record; ``ident`` is the scored model's identity (:func:`~hf_layerswap.card.checks.scored_identity`)."""
    meta = report.metadata if report is not None else {}
    cal = dict(meta.get("calibration") or {})
    if not cal:
        for step in reversed(steps):
            recorded = step_provenance(step).calibration
            if recorded is not None:
                cal = dict(recorded)
                break
    if not cal and not meta:
        return []
    rows = [
        ("Source", cal.get("description", "not recorded")),
        ("Content hash", f"`{cal['content_hash']}`" if cal.get("content_hash") else "not recorded"),
    ]
    n, seq, tokens = cal.get("num_prompts", meta.get("num_prompts")), cal.get("seq_len", meta.get("seq_len")), cal.get(
        "num_tokens", meta.get("num_tokens")
    )
    if n is not None:
        rows.append(("Prompts × tokens", f"{n} prompts × up to {seq} tokens ({tokens:,} real tokens)" if isinstance(tokens, int) else f"{n} × {seq}"))
    if isinstance(cal.get("shortfall"), Mapping):
        rows.append(("Shortfall", f"**fewer prompts than requested**: {shortfall_text(cal['shortfall'])}"))
    if cal.get("add_special_tokens") is not None:
        rows.append(
            (
                "Tokenizer special tokens",
                "`add_special_tokens=True`: the tokenizer's own BOS policy (the source line says whether a BOS was added)"
                if cal["add_special_tokens"]
                else "`add_special_tokens=False`: no BOS/EOS added",
            )
        )
    for key, label in (
        ("dtype", "Model dtype while scoring"),
        ("softmax_dtype", "Softmax dtype"),
        ("seed", "Paragraph shuffle seed"),
        ("batch_size", "Batch size"),
        ("token_averaging", "Averaging"),
        ("kl_direction", "KL direction"),
    ):
        if key in meta:
            rows.append((label, format_cell(meta[key])))
    if ident.get("name"):
        rows.append(("Scored model", _display_identity(ident)))
    return rows


def _display_identity(ident: Mapping) -> str:
    """A model identity for the card: Hub id and revision, never a local path."""
    source = ident.get("source") if isinstance(ident.get("source"), Mapping) else {}
    name = str(source.get("upstream") or ident["name"])
    revision = f" @ {ident['revision']}" if ident.get("revision") else ""
    if HUB_ID.match(name):
        return f"{name}{revision}"
    if os.sep in name or name.startswith((".", "~")):
        return f"local checkpoint `{Path(name).name}`{revision}"
    return f"{name}{revision}"


def cost_rows(report) -> list:
    """Rows of the card's scoring-cost table (forward passes, block evaluations, wall time, hardware) from the report metadata."""
    if report is None:
        return []
    m = report.metadata
    rows = []
    if "forward_passes" in m:
        rows.append(("Forward passes", f"{m['forward_passes']} sweeps over the calibration set (1 reference + 1 per probe)"))
    if "block_evaluations" in m:
        rows.append(("Block evaluations", f"{m['block_evaluations']:,}" + (" (unchanged prefixes reused)" if m.get("prefix_reuse") else "")))
    if "seconds" in m:
        rows.append(("Wall time", f"{m['seconds']:.1f} s"))
    rows.append(("Hardware", format_cell(m.get("hardware", "not recorded"))))
    return rows


def versions_section(report, steps, evaluation) -> dict:
    """Library versions of the scoring, removal and evaluation runs, one column each."""
    columns = {}
    if report is not None and isinstance(report.metadata.get("library_versions"), Mapping):
        columns["scoring"] = report.metadata["library_versions"]
    if steps and isinstance(steps[-1].get("library_versions"), Mapping):
        columns["removal"] = steps[-1]["library_versions"]
    pruned = (evaluation or {}).get("pruned") or {}
    contract = pruned.get("contract") or {}
    evaluated = contract.get("library_versions") or contract.get("versions")
    if isinstance(evaluated, Mapping):
        columns["evaluation"] = evaluated
    columns["card"] = {**library_versions(), "huggingface_hub": huggingface_hub.__version__}
    names = list(dict.fromkeys(k for col in columns.values() for k in col))
    return {"columns": list(columns), "rows": [(n, [format_cell(c.get(n, DASH)) for c in columns.values()]) for n in names]}


def load_snippet(repo: str, tokenizer_repo: str | None, *, attaches: bool = False) -> str:
    """The Python snippet that loads the checkpoint from ``repo`` (with ``import hf_layerswap`` first when
    the repair ``attaches`` modules that a loader re-attaches)."""
    lines = ["from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    if attaches:
        lines = ["import hf_layerswap  # registers the loader that re-attaches the repair operators", *lines]
    lines.append(f'model = AutoModelForCausalLM.from_pretrained("{repo}")')
    if tokenizer_repo:
        lines.append(f'tokenizer = AutoTokenizer.from_pretrained("{tokenizer_repo}")')
        lines += [
            'inputs = tokenizer("The capital of France is", return_tensors="pt")',
            "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))",
        ]
    return "\n".join(lines)


def reproduce_section(base_model, removed, steps, report, ident) -> tuple[str, str | None]:
    """``(code, notes)``: the Python that repeats the removal from the base model and notes on rescoring (``None`` when none apply)."""
    cfg = step_config(steps)
    defaults = LayerSwapConfig().to_dict()
    if cfg and len(steps) == 1:
        keep = ("num_to_remove", "layers", "protocol")
        args = {k: v for k, v in cfg.items() if k != "quant_method" and (k in keep or v != defaults.get(k)) and v is not None}
        args.pop("progress", None)
        entry = step_strategy(steps[-1])[0]
        unguided = entry is not None and entry.guided_by is NO_PROTOCOL
        if args.get("layers") is not None or (unguided and args.get("protocol") == defaults.get("protocol")):
            args.pop("protocol", None)  # no protocol guided these blocks (the card says so): none to repeat
    else:
        args = {"layers": list(removed)}
    call = ", ".join(f"{k}={v!r}" for k, v in args.items())
    source = base_model or "<base model id or folder>"
    lines = [
        "from transformers import AutoModelForCausalLM",
        "from hf_layerswap import LayerSwapConfig",
        "",
        "model = AutoModelForCausalLM.from_pretrained(",
        f'    "{source}",',
        f"    quantization_config=LayerSwapConfig({call}),",
        ")",
    ]
    cal = (report.metadata.get("calibration") if report is not None else None) or {}
    if "layers" not in args and cal.get("description"):
        lines.insert(3, f"# calibration used for the scores: {cal['description']} (content hash {cal.get('content_hash')})")
    notes = []
    if "layers" in args and report is not None:
        first = steps[0].get("num_blocks_before", report.num_blocks) if steps else report.num_blocks
        scored = ("the base model" if report.num_blocks == first else
                  f"the {report.num_blocks}-block checkpoint the last removal step started from")
        notes.append(
            "This removes the same blocks without rescoring. To recompute the scores, run "
            f"`hf_layerswap.score_layers(model, calibration, max_gap={report.max_gap}, "
            f"num_prompts={report.metadata.get('num_prompts')}, seq_len={report.metadata.get('seq_len')}, "
            f"seed={report.metadata.get('seed')})` on {scored} with the calibration source above."
        )
    source_record = ident.get("source") if isinstance(ident.get("source"), Mapping) else None
    if source_record and source_record.get("bundled_name"):
        notes.append(
            f"The scores were computed on the dequantized GGUF weights ({ident.get('revision')}), not on the "
            f"original release of `{source_record.get('upstream')}`. To reproduce them exactly: "
            f"`model, tokenizer = hf_layerswap.models.load_model(\"{source_record['bundled_name']}\")`, then "
            f"`hf_layerswap.prune_loaded_model(model, LayerSwapConfig({call}))`."
        )
    return "\n".join(lines), " ".join(notes) or None
