"""Recovery benchmark: perplexity cost of block removal with no repair, the fused
(ReplaceMe-style, folded into down_proj) map, the ghosted (Ghosted Layers) operator and the
linearpatch (LinearPatch: Hadamard rotation and channel scaling) map.

For each model and budget n, three removal sets are evaluated:

- ``interchange``: the paper's rule on the interchange swap-KL (adjacent pairs), greedy,
  no two removed blocks adjacent, first and last block protected
  (:func:`hf_layerswap.select_layers`);
- ``block-influence``: ShortGPT's Block Influence, BI_i = 1 - mean over real calibration
  tokens of cos(h_i, h_{i+1}) (raw residual streams, per token), the n lowest;
- ``search``: the default selection's set (``LayerSwapConfig()``'s protocol-guided search on
  removal KL), read from the quality benchmark's results (``results/quality-<model>.json``,
  criterion ``search``), not searched again here. These rows run first.

Calibration: WikiText-2 validation (``../shared/data/wikitext-2/valid.txt``); the same
prompts drive scoring, BI and the recovery fits. Evaluation: the matched contract of
:func:`hf_layerswap.evaluation.evaluate_perplexity` on WikiText-2 raw test. Writes a
Markdown table and a JSON file with every number and the full contract.

Running, resuming and merging are the benchmark runner's (``benchmarks/runner.py``;
``experiments/recovery.toml`` holds the option defaults and the models): one results file per
model, ``recovery-<model>.json``, whose cells are the removal sets, stored as the list
``result.evaluated`` (:class:`runner.ListCellStore`) after each method's evaluation, so a rerun
with the same settings resumes set by set and method by method; ``--merge-from`` first merges
files of other processes or machines into their models' files, refusing a set stored with
different values; ``--render-only`` rewrites the page from the JSON files, loading no model.
``--reverse`` runs the sets from the other end (the search's from the top budget down, then the
others), for a second process with its own ``--out`` whose file is merged back with
``--merge-from``.

Usage (from the repository root)::

    python benchmarks/recovery.py --models smollm2-135m --budgets 1 2 3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from hf_layerswap.selection.geometry import block_influence  # noqa: E402
from hf_layerswap import estimate_cost  # noqa: E402
from hf_layerswap.cost import Throughput  # noqa: E402
from hf_layerswap.evaluation import PerplexityResult, delta_ppl_ci, delta_ppl_percent, evaluate_perplexity  # noqa: E402
from hf_layerswap.models import load_model  # noqa: E402
from hf_layerswap.utils.provenance import library_versions, model_identity  # noqa: E402
from hf_layerswap.layerplan import num_blocks  # noqa: E402
from hf_layerswap.recovery import DEFAULT_EPSILON, recover  # noqa: E402
from hf_layerswap.utils.jsonio import write_json_atomic, write_text_atomic  # noqa: E402
from hf_layerswap.scoring.report import SwapReport  # noqa: E402
from hf_layerswap.scoring import score_layers  # noqa: E402
from hf_layerswap.selection import select_layers  # noqa: E402
from runner import ListCellStore, add_runner_arguments, experiment_cells, load_experiment, merge_files, read_state, run_cells  # noqa: E402
from wikitext import VALID as CALIBRATION  # noqa: E402
from wikitext import wikitext_calibration  # noqa: E402

EVALUATION = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
METHODS = ("none", "fused", "ghosted", "linearpatch")
#: The repairs the page compares with no repair (columns in this order).
REPAIRS = METHODS[1:]
SELECTIONS = ("interchange", "block-influence", "search")
#: Where the quality benchmark's results (``quality-<model>.json``) are read from: the ``search`` rows' sets.
QUALITY_RESULTS = REPO / "benchmarks" / "results"
#: The experiment: the option defaults ([settings]) and the models (one results file each).
EXPERIMENT = load_experiment("recovery")
SETTINGS = EXPERIMENT["settings"]


def calibration_set(tokenizer, num_prompts: int, seq_len: int):
    """WikiText-2 validation, variant ``sections`` (seeded shuffle, seed 0), truncated to ``seq_len``."""
    return wikitext_calibration(tokenizer, num_prompts, seq_len, seed=0)


def swap_report(model, calib, args, cache: Path) -> SwapReport:
    """Interchange swap-KL (adjacent pairs), reused from ``cache`` when it was computed on
    the same calibration prompts."""
    if cache.is_file():
        report = SwapReport.from_json(cache)
        if report.metadata.get("calibration", {}).get("content_hash") == calib.content_hash:
            return report
    report = score_layers(model, calib, protocols=("interchange",), max_gap=1, batch_size=args.batch_size, progress=False)
    report.to_json(cache)
    return report


def search_sets(name: str, budgets) -> dict[int, list[int]]:
    """``{n: removed}``: the default search's set at each budget, as the quality benchmark stored
    it (``quality-<name>.json`` beside :data:`QUALITY_RESULTS`, criterion ``search``).

    Raises:
        SystemExit: no such file, or a budget it has no search set for (named, with the command
            that measures it); before any model is loaded.
    """
    path = QUALITY_RESULTS / f"quality-{name}.json"
    hint = f"run `python benchmarks/quality.py --model {name}` first (the search rows reuse its sets)"
    try:
        stored = (read_state(path, "quality results file").get("criteria") or {}).get("search") or {}
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"{err}: {hint}") from None
    missing = [n for n in budgets if not isinstance(stored.get(str(n)), dict) or "removed" not in stored[str(n)]]
    if missing:
        raise SystemExit(f"{path} has no default-search set at budget(s) {missing}: {hint}")
    return {n: sorted(int(i) for i in stored[str(n)]["removed"]) for n in budgets}


def evaluate(model, tokenizer):
    return evaluate_perplexity(model, str(EVALUATION), tokenizer=tokenizer, contract="matched")


def removal_key(entry: dict) -> str:
    """The cell key of a stored removal set (a record of ``result.evaluated``): ``"4,6,12"``."""
    return ",".join(map(str, entry["removed"]))


def row_key(row: dict) -> str:
    """The key of a page row (a record of ``result.rows``): ``"3/interchange"``."""
    return f"{row['n']}/{row['selection']}"


def open_store(store: Path, header: dict) -> ListCellStore:
    """The model's results file: its removal sets are cells, a set finished when every method is stored."""
    return ListCellStore(store, fresh=lambda: {**header, "result": {"evaluated": []}}, key=removal_key,
                         cells=("result", "evaluated"), done=lambda e: all(m in e["results"] for m in METHODS))


def complete(result: dict, budgets) -> bool:
    """Whether every budget's two rows are stored, every method done."""
    rows = {row_key(r): r for r in result.get("rows", [])}
    return all(f"{n}/{s}" in rows and all(m in rows[f"{n}/{s}"]["results"] for m in METHODS)
               for n in budgets for s in SELECTIONS)


def run_model(name: str, args, store: Path, header: dict) -> dict:
    """Every number for one model. The runner's cells are the removal sets (every method of
    each), stored in ``store`` after each evaluation, so an interrupted run resumes where it
    stopped (same settings: other settings start anew) and a partial run renders."""
    t0 = time.time()
    searched = search_sets(name, args.budgets)  # refused before the store is opened or the model loads
    cells = open_store(store, header)
    if cells.state.get("settings") != header["settings"]:
        cells.state = cells.fresh()
    previous = cells.state["result"]
    if previous["evaluated"]:
        print(f"[{name}] resuming: {sum(len(e['results']) for e in previous['evaluated'])} evaluations stored", flush=True)
    model, tokenizer = load_model(name)
    model.eval()
    calib = calibration_set(tokenizer, args.num_prompts, args.seq_len)
    score_calib = calibration_set(tokenizer, args.score_prompts, args.seq_len)  # the first prompts of ``calib``
    if previous["evaluated"]:
        base = PerplexityResult.from_dict({k: v for k, v in previous["base"].items() if k != "ci"})
    else:
        base = evaluate(model, tokenizer)
    print(f"[{name}] base PPL {base.ppl:.3f} ({time.time() - t0:.0f}s)", flush=True)
    report = swap_report(model, score_calib, args, store.with_name(f"recovery_swap_report_{name}.json"))
    bi = block_influence(model, calib, args.budgets, batch_size=args.batch_size)
    out = {
        "model": name,
        "identity": {k: v for k, v in model_identity(model).items() if k != "path"},
        "num_blocks": num_blocks(model),
        "hidden_size": model.get_input_embeddings().weight.shape[1],
        "base": {**base.to_dict(), "ci": [base.ci_low, base.ci_high]},
        "calibration": calib.spec(),
        "score_calibration": score_calib.spec(),
        "interchange_scores": report.layer_scores("interchange"),
        "block_influence": bi[args.budgets[0]].scores,
        "rows": [],
        "evaluated": previous["evaluated"],
        "seconds": previous.get("seconds", 0.0) if previous["evaluated"] else 0.0,
        "complete": False,
    }
    started = time.time() - out["seconds"]
    cells.state = {**header, "result": out}
    rows = [{"n": n, "selection": selection, "removed": removed}
            for n in args.budgets
            for selection, removed in (("interchange", select_layers(report, n, protocol="interchange")),
                                       ("block-influence", bi[n].removed), ("search", searched[n]))]

    def refresh(state: dict) -> None:  # the page's rows: every set with plain removal measured, in budget order
        result = state["result"]
        stored = {removal_key(e): e for e in result["evaluated"]}
        result["rows"] = [{**row, "results": stored[removal_key(row)]["results"]} for row in rows
                          if "none" in stored.get(removal_key(row), {}).get("results", {})]
        result["seconds"] = time.time() - started
        result["complete"] = complete(result, args.budgets)

    def save(key: str, entry: dict) -> None:
        cells.put(key, entry)
        cells.update(refresh)

    def run_set(row: dict) -> dict:
        key = removal_key(row)
        entry = cells.get(key) or {"removed": list(row["removed"]), "results": {}}
        for method in METHODS:
            if method not in entry["results"]:
                entry["results"][method] = run_method(name, model, tokenizer, base, calib, row, method, args, t0)
                save(key, entry)
        return entry

    for row in rows:  # a method the library refuses since a set was measured: that refusal, the measurement kept
        stored = cells.get(removal_key(row))
        if stored is not None and refuse_stored(model, stored):
            save(removal_key(row), stored)
    cells.update(refresh)  # the stored sets' rows (a method added since they ran shows as "not run")
    order = [[row for row in rows if (row["selection"] == "search") == is_search] for is_search in (True, False)]
    if args.reverse:  # a second process starts at the other end of each; merge the two files with --merge-from
        order = [part[::-1] for part in order]
    first = order[0] + order[1]  # the default's sets first
    run_cells(cells, [(removal_key(row), row) for row in first], run_set, tag=name)
    cells.update(refresh)  # rows and completeness also when every set was stored
    return cells.state["result"]


def refusal(model, removed, method: str) -> str | None:
    """Why the library refuses ``method`` on ``model`` for the removal set ``removed`` (its
    checks before any fit, through :func:`hf_layerswap.estimate_cost`), or ``None``."""
    try:
        estimate_cost(model, {"layers": list(removed), "recovery": method},
                      throughput=Throughput(1e12, 1e12, 1e9, source="unused: only the checks run"))
    except ValueError as err:
        return str(err)
    return None


def refuse_stored(model, entry: dict) -> bool:
    """A stored result of a method the library has refused on this model since it was
    measured becomes that refusal, the measurement kept beside it
    (``measured_before_refusal``); whether any did."""
    changed = False
    for method, result in entry["results"].items():
        if method == "none" or "refused" in result:
            continue
        reason = refusal(model, entry["removed"], method)
        if reason is not None:
            entry["results"][method] = {"refused": reason, "measured_before_refusal": result}
            changed = True
    return changed


def run_method(name: str, model, tokenizer, base, calib, row: dict, method: str, args, t0: float) -> dict:
    """One method on one removal set: the recovery fit, then the matched evaluation (or the refusal)."""
    removed = row["removed"]
    pruned = copy.deepcopy(model)
    try:
        rec = recover(pruned, removed, calib, method=method, num_tokens=args.num_tokens,
                      epsilon=args.epsilon, batch_size=args.batch_size)
    except ValueError as err:
        print(f"[{name}] {removed} {method}: refused ({err})", flush=True)
        return {"refused": str(err)}
    result = evaluate(pruned, tokenizer)
    entry = {
        "ppl": result.ppl,
        "ci": [result.ci_low, result.ci_high],
        "dppl_percent": delta_ppl_percent(base, result),
        "dppl_ci": list(delta_ppl_ci(base, result)),
        "recovery": rec.to_dict(),
    }
    print(f"[{name}] n={row['n']} {row['selection']} {removed} {method}: PPL {result.ppl:.3f} "
          f"dPPL {entry['dppl_percent']:+.1f}% "
          f"residuals {[(round(b.residual_before, 3), round(b.residual_after, 3)) for b in rec.boundaries]} "
          f"({time.time() - t0:.0f}s)", flush=True)
    return entry


def _not_run(model_result: dict) -> list[tuple[str, int]]:
    """``(method, rows without its result)`` for each method of :data:`METHODS`."""
    return [(m, sum(m not in row["results"] for row in model_result["rows"])) for m in METHODS]


def _pct(value: float) -> str:
    """A dPPL% cell: one decimal, or three significant digits from a million on (a repair that blows
    the perplexity up stays readable)."""
    return f"{value:+.1f}" if abs(value) < 1e6 else f"{value:+.2e}"


def _fmt_method(entry: dict | None) -> str:
    if entry is None:
        return "not run"
    if "refused" in entry:
        return "n/a"
    low, high = entry["dppl_ci"]
    return f"{_pct(entry['dppl_percent'])} [{_pct(low)}, {_pct(high)}]"


def _fmt_residual(entry: dict | None) -> str:
    if entry is None:
        return "not run"
    if "refused" in entry:
        return "n/a"
    parts = [f"{b['residual_after']:.3f}" for b in entry["recovery"]["boundaries"]]
    return ", ".join(parts)


def _observations(model_result: dict) -> list[str]:
    notes = []
    for row in model_result["rows"]:
        res = row["results"]
        none = res["none"]["dppl_percent"]
        for method in REPAIRS:
            entry = res.get(method)
            if entry is None or "refused" in entry:
                continue
            gain = none - entry["dppl_percent"]
            low, high = entry["dppl_ci"]
            nlow, nhigh = res["none"]["dppl_ci"]
            if gain <= 0:
                notes.append(
                    f"n={row['n']} {row['selection']} {row['removed']}: {method} does not help "
                    f"(dPPL {entry['dppl_percent']:+.1f}% vs {none:+.1f}% with no repair)."
                )
            elif low <= nhigh and high >= nlow:
                notes.append(
                    f"n={row['n']} {row['selection']} {row['removed']}: {method} lowers dPPL by {gain:.1f} points, "
                    "within overlapping 95% intervals."
                )
    for method in REPAIRS:
        refused = [(row, row["results"][method]) for row in model_result["rows"]
                   if "refused" in row["results"].get(method, {})]
        if not refused:
            continue
        note = f"{method} is not applicable to this model: {refused[0][1]['refused']}"
        before = [(row, e["measured_before_refusal"]) for row, e in refused if "measured_before_refusal" in e]
        if before:
            worse = sum(e["dppl_percent"] > row["results"]["none"]["dppl_percent"] for row, e in before)
            mine = median(e["dppl_percent"] for _, e in before)
            none = median(row["results"]["none"]["dppl_percent"] for row, _ in before)
            note += (f". Measured before the library refused it, {method} left dPPL% above plain removal on {worse} of "
                     f"the {len(before)} sets it ran on (median {_pct(mine)} against {_pct(none)} with no repair)")
        notes.append(note)
    return notes


def best_repairs(model_result: dict) -> list[tuple[dict, str, dict[str, float]]]:
    """``(row, best, {repair: dPPL%})`` for each ``search`` row where every repair of
    :data:`REPAIRS` is stored (a refused one counts as stored, with no value): the repair with
    the lowest dPPL% and each measured repair's dPPL%."""
    out = []
    for row in model_result["rows"]:
        res = row["results"]
        if row["selection"] != "search" or any(m not in res for m in REPAIRS):
            continue
        values = {m: res[m]["dppl_percent"] for m in REPAIRS if "refused" not in res[m]}
        if values:
            out.append((row, min(values, key=values.get), values))
    return out


def recommendation(results: list[dict]) -> list[str]:
    """The page's recommendation: the repair with the lowest dPPL% on the most ``search`` rows
    (the sets the library's default removes) over every model, with its count and each model's
    rows; LinearPatch's standing against ghosted with its numbers."""
    measured = [(res["model"], *entry) for res in results for entry in best_repairs(res)]
    if not measured:
        return ["No search row has every repair measured yet: no recommendation."]
    wins = {m: sum(best == m for _, _, best, _ in measured) for m in REPAIRS}
    best = max(REPAIRS, key=lambda m: (wins[m], -REPAIRS.index(m)))
    others = [f"{m} on {wins[m]}" for m in REPAIRS if m != best and wins[m]]
    top = max(row["n"] for _, row, _, _ in measured)
    lines = [f"**Recommended repair: {best}**, by measurement: the lowest dPPL% on {wins[best]} of the {len(measured)} "
             f"rows on the default search's sets (n = 1..{top}" + "".join(f"; {o}" for o in others) + ")."]
    for model in dict.fromkeys(name for name, *_ in measured):
        cells = [f"n={row['n']} {row['removed']}: " + ", ".join(
            f"{'**' + m + '**' if m == b else m} {_pct(v)}" for m, v in values.items())
            for name, row, b, values in measured if name == model]
        lines.append(f"- {model}: " + "; ".join(cells) + ".")
    pairs = [(values["linearpatch"], values["ghosted"]) for *_, values in measured
             if "linearpatch" in values and "ghosted" in values]
    lost = sum(lp > gh for lp, gh in pairs)
    if pairs and lost:
        lines += ["", f"LinearPatch loses to ghosted on {lost} of the {len(pairs)} search rows where both ran "
                      f"(median dPPL% {_pct(median(lp for lp, _ in pairs))} against "
                      f"{_pct(median(gh for _, gh in pairs))}). The reference LinearPatch adds an optional "
                      "refinement of its patch by offline top-K-logit distillation (about 5K samples); the "
                      "library's LinearPatch is its training-free closed form only (H·D·Hᵀ from calibration "
                      "magnitudes), so these rows measure that form."]
    return lines


def write_markdown(results: list[dict], args, path: Path, command: str, libraries: str) -> None:
    lines = [
        "# Recovery of the cut: no repair vs fused vs ghosted vs linearpatch",
        "",
        f"Command: `{command}`",
        "",
        "Removing decoder blocks, then repairing each cut with a closed-form linear map fitted on the dense model "
        "(`hf_layerswap.recovery.recover`): **fused** = ReplaceMe-style least-squares map on the MLP output of the "
        "last kept block, folded into its `down_proj` (a plain transformers checkpoint); **ghosted** = Ghosted "
        "Layers' operator I + M on the full residual stream (a hook; needs `hf_layerswap` to load); **linearpatch** = "
        "LinearPatch's symmetric map H·D·Hᵀ (a Hadamard rotation of the hidden size and the per-channel ratio of "
        "mean magnitudes across the cut in the rotated basis; no ridge), folded into the embedding at a cut of block "
        "0, a hook elsewhere. \"not run\": a method this model's stored results do not have yet.",
        "",
        f"- Calibration: WikiText-2 validation (`../shared/data/wikitext-2/valid.txt`), {args.num_prompts} paragraphs "
        f"(seeded shuffle, seed 0), truncated to {args.seq_len} tokens, for Block Influence and the recovery fits; "
        f"the first {args.score_prompts} of them for the interchange swap-KL.",
        f"- Recovery fit: at most {args.num_tokens} real calibration tokens (pad positions excluded), float64 "
        "moments, ridge toward the identity with λ = ε·trace(XᵀX)/H, "
        + (f"ε = {args.epsilon:g}." if args.epsilon is not None else f"ε per method: {DEFAULT_EPSILON}."),
        "- Evaluation: matched contract (WikiText-2 raw test, first 5,000 words, window 512, stride 256, "
        "PPL = exp(total NLL / tokens)); dPPL% = (PPL_pruned / PPL_base − 1) × 100 with a paired bootstrap "
        "95% interval over windows (2,000 resamples, seed 42).",
        "- Selection: **interchange** = greedy on the interchange swap-KL (adjacent pairs), no two removed blocks "
        "adjacent, first and last block protected; **block-influence** = the n blocks with the lowest "
        "ShortGPT Block Influence 1 − cos(h_i, h_{i+1}) (per token), no constraints; **search** = the set the "
        "library's default selection removes (`LayerSwapConfig()`: the protocol-guided search on removal KL), "
        "as the quality benchmark found it (`results/quality-<model>.json`, criterion `search`; not searched "
        "again here).",
        "- Fit residual = ‖Ŷ − h_e‖_F / ‖h_e‖_F on the calibration tokens, per cut; \"before\" is plain removal "
        "(Ŷ = h_s).",
        f"- Libraries: {libraries}",
        "",
        "## Recommendation",
        "",
        *recommendation(results),
        "",
    ]
    for res in results:
        base = res["base"]
        lines += [
            f"## {res['model']} ({res['num_blocks']} blocks, hidden size {res['hidden_size']})",
            "",
            f"Base PPL {base['ppl']:.3f} (95% CI {base['ci'][0]:.3f}–{base['ci'][1]:.3f}); "
            f"{res['base']['contract'].get('scored_tokens', '?')} scored tokens; calibration "
            f"{res['calibration']['num_tokens']} real tokens, sha256 {res['calibration']['content_hash'][:12]}; "
            f"run time {res['seconds'] / 60:.0f} min."
            + ("" if res.get("complete", True) else
               f" **Partial run**: stopped after the rows below (budgets requested: {', '.join(map(str, args.budgets))})"
               + "".join(f"; {m} not run on {k} of them" for m, k in _not_run(res) if k) + "."),
            "",
            "| n | selection | removed (0-based) | dPPL% none | "
            + "".join(f"dPPL% {m} | " for m in REPAIRS) + "fit residual before | "
            + "".join(f"after {m} | " for m in REPAIRS).rstrip(),
            "|---|---|---|---|" + "---|" * (2 * len(REPAIRS) + 1),
        ]
        for row in res["rows"]:
            r = row["results"]
            before = ", ".join(f"{b['residual_before']:.3f}" for b in r["none"]["recovery"]["boundaries"])
            lines.append(
                f"| {row['n']} | {row['selection']} | {row['removed']} | {_fmt_method(r['none'])} | "
                + "".join(f"{_fmt_method(r.get(m))} | " for m in REPAIRS) + f"{before} | "
                + "".join(f"{_fmt_residual(r.get(m))} | " for m in REPAIRS).rstrip()
            )
        notes = _observations(res)
        lines += ["", "Where recovery does not help (or not clearly):", ""]
        lines += [f"- {note}" for note in notes] or ["- recovery lowered dPPL in every row, outside the overlap of intervals."]
        lines.append("")
    write_text_atomic("\n".join(lines), path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[c["model"] for c in experiment_cells(EXPERIMENT)["models"]])
    parser.add_argument("--budgets", nargs="+", type=int, default=SETTINGS["budgets"])
    parser.add_argument("--num-prompts", type=int, default=SETTINGS["num_prompts"],
                        help="calibration prompts (BI, recovery fits)")
    parser.add_argument("--score-prompts", type=int, default=SETTINGS["score_prompts"],
                        help="the first prompts, for the swap-KL")
    parser.add_argument("--seq-len", type=int, default=SETTINGS["seq_len"])
    parser.add_argument("--num-tokens", type=int, default=SETTINGS["num_tokens"])
    parser.add_argument("--epsilon", type=float, default=SETTINGS.get("epsilon"), help="relative ridge (default: per method)")
    parser.add_argument("--batch-size", type=int, default=SETTINGS["batch_size"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: up to 2)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "recovery.md"))
    parser.add_argument("--reverse", action="store_true",
                        help="run the removal sets in the opposite order (for a second process with its own --out, "
                             "merged back with --merge-from)")
    add_runner_arguments(parser)
    return parser


def merge_runs(out: Path, sources) -> None:
    """``--merge-from``: each source (a ``recovery-<model>.json`` of another process or machine)
    into this model's file beside ``out``, removal set by removal set; the first file's command
    and libraries are kept; a set or setting stored with different values is refused
    (:class:`runner.MergeConflict`)."""
    for source in map(Path, sources):
        if not source.is_file():
            raise SystemExit(f"--merge-from {source}: no such results file")
        stored = read_state(source, "--merge-from results file")
        model = stored.get("result", {}).get("model")
        if model is None:
            raise SystemExit(f"--merge-from {source}: not a recovery results file (no result.model)")
        merged = merge_files(out.with_name(f"recovery-{model}.json"), [source], union=(),
                             first=("command", "libraries"), volatile=("seconds", "complete"),
                             keyed={"evaluated": removal_key, "rows": row_key})
        result = merged["result"]
        order = {f"{n}/{s}": i for i, (n, s) in enumerate((n, s) for n in merged["settings"]["budgets"] for s in SELECTIONS)}
        result["rows"].sort(key=lambda r: order.get(row_key(r), len(order)))
        result["complete"] = complete(result, merged["settings"]["budgets"])
        write_json_atomic(merged, out.with_name(f"recovery-{model}.json"))


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    if args.merge_from:
        merge_runs(out, args.merge_from)
    for path in (CALIBRATION, EVALUATION):
        if not path.is_file():
            raise SystemExit(f"{path} is missing: this benchmark needs the shared WikiText-2 files")
    torch.set_num_threads(args.threads or max(1, min(2, os.cpu_count() or 1)))
    command = "python benchmarks/recovery.py " + " ".join(
        [f"--models {' '.join(args.models)}", f"--budgets {' '.join(map(str, args.budgets))}",
         f"--num-prompts {args.num_prompts}", f"--score-prompts {args.score_prompts}", f"--seq-len {args.seq_len}", f"--num-tokens {args.num_tokens}",
         *([f"--epsilon {args.epsilon:g}"] if args.epsilon is not None else [])]
    )
    settings = {k: v for k, v in vars(args).items()
                if k not in ("models", "out", "threads", "render_only", "merge_from", "reverse")}
    if not args.render_only:
        for name in args.models:
            # one file per model, so models run in separate processes and render together
            run_model(name, args, out.with_name(f"recovery-{name}.json"),
                      {"command": command, "settings": settings, "libraries": library_versions()})
    results, commands, libraries = [], [], []
    for path in sorted(out.parent.glob("recovery-*.json")):
        stored = read_state(path)
        if stored["settings"] != settings:
            print(f"{path.name}: other settings than this run ({stored['command']}); not rendered", flush=True)
            continue
        results.append(stored["result"])
        commands.append(stored["command"])
        libraries.append(json.dumps(stored["libraries"]))
    if not results:  # never replace a page with an empty one
        raise SystemExit(f"no recovery-*.json beside {out} was run with these settings {settings}: nothing rendered")
    write_markdown(results, args, out, "`; `".join(dict.fromkeys(commands)), "; ".join(dict.fromkeys(libraries)))
    print(f"wrote {out} from {', '.join(r['model'] for r in results)}")


if __name__ == "__main__":
    main()
