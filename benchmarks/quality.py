"""Quality benchmark: every layer-removal criterion, ours and the field's, on real models,
measured with one calibration set and one perplexity contract.

    python benchmarks/quality.py --model smollm2-135m --budgets 1 2 3
    python benchmarks/quality.py --model gemma3-270m --groups pages    # the committed page's cells

For the model (:func:`hf_layerswap.models.load_model`: the dequantized GGUF checkpoints
that install from the package index):

1. calibration: WikiText-2 validation, variant ``sections`` of ``benchmarks/wikitext.py``
   (``../shared/data/wikitext-2/valid.txt``, seeded shuffle); every criterion sees exactly these prompts;
2. :func:`hf_layerswap.comparison.compare_criteria` runs every criterion at every budget n
   (Block Influence, angular distance, single-removal KL, SLEB, random x5, tail,
   replacement-, interchange- and auto-guided selection, interchange-seeded beam scored
   by calibration removal KL, the search with each objective: ``search`` (removal KL, the
   default), ``search_nll``, ``search_ghosted``) and evaluates each removed set on WikiText-2 raw *test*
   (``../shared/data/wikitext-2-raw/wiki.test.raw``) under the matched contract (first
   5,000 words, window 512, stride 256), plus its joint removal KL on the calibration
   prompts;
3. the protocol gap: interchange vs replacement swap-KL on every pair with gap <= 3;
4. one removed set is evaluated both by a pruned deep copy and by a removal plan (the
   numbers must agree);
5. the objectives: every objective's value on the calibration prompts of each search's set
   and of the lowest set per n (stored under ``extras.objective_values``), so the pages say
   per objective where its search meets the target (lowest dPPL% or inside the lowest's
   paired 95% CI) and, for each miss, whether the objective misranks the two sets or the
   search did not reach the lower one; ``quality.md`` counts the cells met over every model.

Running, resuming and merging are the benchmark runner's (``benchmarks/runner.py``,
``experiments/quality.toml``: the option defaults and, as group ``pages``, the cells of the
committed pages with each model's repair). A cell is one criterion at one budget n: the library's
:func:`~hf_layerswap.comparison.compare_criteria` runs it (its selection, continuing a search from
the criterion's smaller budgets, then the perplexity and removal KL of its sets) and stores it in
its own resumable state, ``quality-<model>.json``, under ``criteria.<criterion>.<n>``; the runner
reads the cells there, so a rerun skips a stored cell and a stopped run loses at most the cell in
progress (and keeps the probes finished within a protocol's scoring). The table is then built by
one ``compare_criteria`` call over every cell, which computes nothing stored; the protocol gap
and the copy-vs-plan check are the model's two further cells (``extras``).

Writes ``benchmarks/results/quality-<model>.md`` (command, contract, table, winners,
protocol gap), ``quality-<model>.png`` (dPPL% vs n per criterion), ``quality-<model>.json``
(every number, and the state above) and the index ``quality.md``; ``--render-only`` rewrites
every page and the index from the JSON (no model is loaded; the plots are left as they are).

One module on purpose: the run and every section of the pages read one state and share its
labels; split, each part would pass the state and the table around.

A long run splits over processes: run disjoint ``--criteria`` with their own ``--results``
folders (only one of them with ``--max-gap`` above 1), then run once more with every
criterion and ``--merge-from`` their ``quality-<model>.json`` files (the runner's merge: a value
stored differently in two pieces is refused, timings excepted); that run recomputes nothing the
pieces finished.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from _cmdline import command_line  # noqa: E402
from hf_layerswap.comparison import (  # noqa: E402
    DEFAULT_CRITERIA,
    CriterionComparison,
    compare_criteria,
    evaluate_removed,
    merge_reports,
    protocol_gap_quartiles,
)
from hf_layerswap.calibration import CalibrationSet  # noqa: E402
from hf_layerswap.evaluation import delta_ppl_percent  # noqa: E402
from hf_layerswap.utils.jsonio import atomic_path, write_text_atomic  # noqa: E402
from hf_layerswap.models import BUNDLED_MODELS, load_model  # noqa: E402
from hf_layerswap.layerplan import interchange_plan, num_blocks, replacement_plan  # noqa: E402
from hf_layerswap.utils.provenance import library_versions, model_identity  # noqa: E402
from hf_layerswap.scoring.report import PairResult, SwapReport, set_key  # noqa: E402
from hf_layerswap.scoring import plan_kl  # noqa: E402
from hf_layerswap.selection.objectives import OBJECTIVES, SetObjective  # noqa: E402
from hf_layerswap.selection.search import criterion_name  # noqa: E402
from runner import CellStore, add_runner_arguments, cell_node, experiment_cells, load_experiment, merge_files, read_state, run_cells  # noqa: E402
from wikitext import wikitext_calibration  # noqa: E402

DATA = REPO.parent / "shared" / "data"
EVALUATION = DATA / "wikitext-2-raw" / "wiki.test.raw"
RESULTS = REPO / "benchmarks" / "results"
#: The experiment: the option defaults ([settings]), the fixed criterion options, and the cells
#: of the committed pages by group, with each model's repair (``benchmarks/experiments/quality.toml``).
EXPERIMENT = load_experiment("quality")
SETTINGS = EXPERIMENT["settings"]
GROUPS = experiment_cells(EXPERIMENT)
#: A run's summary of the whole table: a merge keeps the first file's until the next run rebuilds it.
RUN_SUMMARY = ("comparison", "protocol_gap", "command", "environment", "merged_runs")
#: Measurements of the machine in a result (seconds, the memory budget of a scoring): two runs of
#: one cell measure them differently, and a merge keeps the first.
TIMINGS = ("seconds", "ppl_seconds", "max_memory")

LABELS = {
    "block_influence": "Block Influence (ShortGPT)",
    "angular_distance": "angular distance (Gromov et al.)",
    "single_removal_kl": "single-removal KL (one-shot)",
    "sleb": "SLEB (iterative NLL)",
    "random": "random (mean of seeded draws)",
    "tail": "tail (last n before the final)",
    "replacement": "replacement-guided (ours)",
    "interchange": "interchange-guided (ours)",
    "auto": "auto (ours)",
    "interchange_beam": "interchange-seeded beam (ours)",
    "search": "search, removal KL (ours, default)",
    "search_ghosted": "search, ghosted objective (ours)",
    "search_nll": "search, NLL objective (ours)",
}
#: The search's criterion per objective (``search`` the default, removal KL): the "Objectives" sections.
SEARCHES = {objective: criterion_name(objective) for objective in OBJECTIVES}
#: Our criteria (the paper's rules and the searches); the rest are the field's and controls.
OURS = ("interchange", "replacement", "auto", "interchange_beam", *SEARCHES.values())


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _mean_se(values: torch.Tensor) -> tuple[float, float | None]:
    mean = float(values.mean())
    if values.numel() < 2:
        return mean, None
    return mean, float(values.std(unbiased=True) / values.numel() ** 0.5)


def gap_extension(model, calib: CalibrationSet, max_gap: int, batch_size: int) -> SwapReport:
    """Both protocols on the pairs with 2 <= gap <= max_gap (gap 1 comes from the harness)."""
    total = num_blocks(model)
    pairs = [(i, i + g) for g in range(2, max_gap + 1) for i in range(total - g)]
    plans = {}
    for i, j in pairs:
        plans[("replacement_ij", i, j)] = replacement_plan(total, i, j)
        plans[("replacement_ji", i, j)] = replacement_plan(total, j, i)
        plans[("interchange", i, j)] = interchange_plan(total, i, j)
    values, stats = plan_kl(model, calib, plans, batch_size=batch_size, progress=True, desc=f"gap 2..{max_gap}")
    results = []
    for i, j in pairs:
        kw = {}
        for kind in ("replacement_ij", "replacement_ji", "interchange"):
            kw[kind], kw[f"{kind}_se"] = _mean_se(values[(kind, i, j)])
        results.append(PairResult(i, j, **kw))
    metadata = {"calibration": calib.spec(), "forward_passes": stats["forward_passes"], "seconds": stats["seconds"],
                "block_evaluations": stats.get("block_evaluations"), "pairs": "2 <= gap <= max_gap"}
    return SwapReport(total, results, max_gap=max_gap, metadata=metadata)


def fmt_set(s) -> str:
    return "{" + ",".join(map(str, s)) + "}"


def protocol_section(table: CriterionComparison, gap: dict, budgets) -> list[str]:
    rows = {(r["criterion"], r["n"]): r for r in table.rows}
    out = ["## Interchange vs replacement (the paper's central claim)", ""]
    out.append("| n | interchange set | dPPL % | replacement set | dPPL % | repl/inter dPPL | removal KL inter / repl (nats) | auto picks |")
    out.append("|---|---|---|---|---|---|---|---|")
    for n in budgets:
        i, r, a = rows.get(("interchange", n)), rows.get(("replacement", n)), rows.get(("auto", n))
        if not (i and r):
            continue
        ratio = r["dppl"] / i["dppl"] if i["dppl"] > 0 else float("nan")
        auto = "-"
        if a:
            det = table.results["auto"][n]["details"]
            auto = f"{det['chosen_protocol']} ({det['reason']})"
        out.append(
            f"| {n} | {fmt_set(i['removed'])} | {i['dppl']:+.1f} | {fmt_set(r['removed'])} | {r['dppl']:+.1f} | "
            f"{ratio:.2f} | {i['removal_kl']:.4f} / {r['removal_kl']:.4f} | {auto} |"
        )
    out += ["", "Protocol gap on the calibration prompts, I/R = d_inter / d_repl per pair (both in nats):", ""]
    out.append("| gap | pairs | fraction with interchange <= replacement | I/R 25% | median | 75% | min | max |")
    out.append("|---|---|---|---|---|---|---|---|")
    for g, s in list(gap["by_gap"].items()) + [("all", gap["all"])]:
        out.append(
            f"| {g} | {s['pairs']} | {s['fraction_interchange_le_replacement']:.2f} | {s['ratio_q25']:.3f} | "
            f"{s['ratio_median']:.3f} | {s['ratio_q75']:.3f} | {s['ratio_min']:.3f} | {s['ratio_max']:.3f} |"
        )
    if gap.get("non_finite_pairs"):
        out.append(f"\n{gap['non_finite_pairs']} pair(s) with a non-finite value are left out of the ratios.")
    return out


def layer_section(table: CriterionComparison, num_blocks: int) -> list[str]:
    res = table.results

    def scores(name):
        first = next(iter(res.get(name, {}).values()), None)
        return first["scores"] if first else None

    cols = [("interchange s(i)", scores("interchange")), ("replacement s(i)", scores("replacement")),
            ("BI", scores("block_influence")), ("single-removal KL", scores("single_removal_kl")),
            ("SLEB step-1 NLL", scores("sleb"))]
    cols = [(h, v) for h, v in cols if v]
    out = ["## Per-layer scores (calibration prompts; low = removable)", "",
           "| layer | " + " | ".join(h for h, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for layer in range(num_blocks):
        cells = []
        for _, v in cols:
            x = v[layer]
            cells.append("-" if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x)))
        out.append(f"| {layer} | " + " | ".join(cells) + " |")
    return out


def winners(table: CriterionComparison, budgets) -> list[str]:
    out = ["## Which criterion wins", "",
           "Lowest dPPL% per n (random excluded; criteria that remove the same set tie and are all named); the "
           "rank of each of ours among the deterministic criteria (ties share a rank):", ""]
    ours = OURS
    for n in budgets:
        rows = sorted((r for r in table.rows if r["n"] == n and r["criterion"] != "random"), key=lambda r: r["dppl"])
        if not rows:
            continue
        best = rows[0]
        ranks = {r["criterion"]: 1 + sum(o["dppl"] < r["dppl"] for o in rows) for r in rows}  # competition ranking
        ranked = ", ".join(f"{c} #{ranks[c]}" for c in ours if c in ranks)
        tied = " = ".join(f"**{r['criterion']}**" for r in rows if r["dppl"] == best["dppl"])
        rand = next((r for r in table.rows if r["n"] == n and r["criterion"] == "random"), None)
        rtxt = f"; random mean {rand['dppl']:+.1f} (draws {rand['dppl_min']:+.1f} .. {rand['dppl_max']:+.1f})" if rand else ""
        out.append(f"- n={n}: best {tied} {fmt_set(best['removed'])} {best['dppl']:+.1f}% "
                   f"(CI {best['dppl_ci'][0]:+.1f} .. {best['dppl_ci'][1]:+.1f}); {ranked}{rtxt}.")
    return out


def lowest(rows, n: int, exclude=("random",)) -> dict | None:
    """The row of lowest dPPL% at budget ``n`` among the deterministic criteria of the table
    (``random``, ``exclude`` and rows without a CI, :func:`objective_rows`, left out), or None."""
    cell = [r for r in rows if r["n"] == n and r["criterion"] not in ("random", *exclude) and r.get("dppl_ci")]
    return min(cell, key=lambda r: r["dppl"]) if cell else None


def meets(mine: dict, best: dict) -> bool:
    """The pages' target: ``mine`` is the lowest dPPL% or inside the lowest's paired 95% CI."""
    return mine["dppl"] <= best["dppl"] or mine["dppl"] <= best["dppl_ci"][1]


def search_targets(table: CriterionComparison, budgets) -> list[str]:
    """Met or missed, per cell: the default search against the lowest dPPL of every criterion,
    and its cost for all budgets together against SLEB's for the largest budget alone."""
    rows = {(r["criterion"], r["n"]): r for r in table.rows}
    if not any(c == "search" for c, _ in rows):
        return []
    out = ["## Targets of the default search", "",
           "Per n: is `search` (removal KL objective, the default) the lowest dPPL% of all deterministic criteria, "
           "or inside the 95% CI (paired bootstrap over windows) of the lowest?", "",
           "| n | search | dPPL % | lowest (criterion) | dPPL % | its 95% CI | target | by |",
           "|---|---|---|---|---|---|---|---|"]
    met = 0
    for n in budgets:
        mine, best = rows.get(("search", n)), lowest(table.rows, n, exclude=("search",))
        if mine is None or best is None:
            continue
        ok = meets(mine, best)
        met += ok
        gap = mine["dppl"] - best["dppl"]
        by = "lowest" if mine["dppl"] <= best["dppl"] else (f"{gap:+.1f} points, inside" if ok else f"{gap:+.1f} points")
        out.append(f"| {n} | {fmt_set(mine['removed'])} | {mine['dppl']:+.1f} | {fmt_set(best['removed'])} "
                   f"({best['criterion']}) | {best['dppl']:+.1f} | [{best['dppl_ci'][0]:+.1f}, {best['dppl_ci'][1]:+.1f}] | "
                   f"{'met' if ok else 'missed'} | {by} |")
    out += ["", f"Met in {met} of {len(budgets)} budgets.", ""]
    top = max(budgets)
    mine, sleb = rows.get(("search", top)), rows.get(("sleb", top))
    if mine is not None and sleb is not None:
        search_cost = table.results["search"][top]["details"]["search_cost"]
        scoring = table.results["search"][top]["details"]["scoring_cost"]
        out += [
            f"Cost of `search` for n = 1..{top} in one call: {search_cost['forward_passes']} forward passes "
            f"({search_cost['evaluator_calls']} candidate sets), {search_cost['seconds']:.0f} s; with the scoring of "
            f"both protocols it needs, {mine['forward_passes']} forward passes, {mine['seconds']:.0f} s. SLEB for "
            f"n = {top} alone: {sleb['forward_passes']} forward passes, {sleb['seconds']:.0f} s. Target (search at most "
            f"SLEB's cost): search alone {'met' if search_cost['forward_passes'] <= sleb['forward_passes'] else 'missed'} "
            f"in forward passes ({search_cost['forward_passes'] / sleb['forward_passes']:.2f}x SLEB), "
            f"{'met' if search_cost['seconds'] <= sleb['seconds'] else 'missed'} in seconds "
            f"({search_cost['seconds'] / max(sleb['seconds'], 1e-9):.2f}x); with scoring "
            f"{mine['forward_passes'] / sleb['forward_passes']:.2f}x and {mine['seconds'] / max(sleb['seconds'], 1e-9):.2f}x "
            f"(scoring: {scoring['forward_passes']} forward passes).", ""]
    return out


def search_label(criterion: str) -> str:
    """A search's column head: ``search (default)``, ``search, nll objective``, ..."""
    objective = next(o for o, c in SEARCHES.items() if c == criterion)
    return "search (default)" if criterion == "search" else f"search, {objective} objective"


def who_wins(table: CriterionComparison, budgets, key: str = "dppl") -> list[str]:
    """One row per n: the lowest dPPL% (``key``) of the deterministic criteria, the criteria that
    share it, and where the search of each objective the table holds stands."""
    rows = [r for r in table.rows if r["criterion"] != "random" and r.get(key) is not None]
    searches = [c for c in SEARCHES.values() if any(r["criterion"] == c for r in rows)]
    ci = key + "_ci"
    out = ["| n | lowest dPPL % | 95% CI | set | criteria with that set | "
           + " | ".join(search_label(c) for c in searches) + " |", "|---" * (5 + len(searches)) + "|"]
    for n in budgets:
        cell = sorted((r for r in rows if r["n"] == n), key=lambda r: r[key])
        if not cell:
            continue
        best = cell[0]
        tied = ", ".join(r["criterion"] for r in cell if r["removed"] == best["removed"])
        ranks = {r["criterion"]: 1 + sum(o[key] < r[key] for o in cell) for r in cell}

        def mine(name):
            r = next((r for r in cell if r["criterion"] == name), None)
            return "-" if r is None else f"{fmt_set(r['removed'])} {r[key]:+.1f} (#{ranks[name]} of {len(cell)})"

        out.append(f"| {n} | {best[key]:+.1f} | [{best[ci][0]:+.1f}, {best[ci][1]:+.1f}] | {fmt_set(best['removed'])} | "
                   f"{tied} | " + " | ".join(mine(c) for c in searches) + " |")
    return out


def objective_cells(rows, budgets) -> list[dict]:
    """Per budget n and per objective whose search the rows hold: the search's row, the lowest
    row of every deterministic criterion (:func:`lowest`) and whether the search meets the
    pages' target (:func:`meets`)."""
    by = {(r["criterion"], r["n"]): r for r in rows}
    out = []
    for n in budgets:
        best = lowest(rows, n)
        for objective, criterion in SEARCHES.items():
            mine = by.get((criterion, n))
            if mine is not None and best is not None:
                out.append({"n": n, "objective": objective, "row": mine, "best": best, "met": meets(mine, best)})
    return out


def objective_rows(state: dict) -> list[dict]:
    """The table's rows, plus a row (criterion, n, removed set, dPPL%) for each stored cell of a
    search that the table does not hold yet (a run stopped before the search's last budget; its
    perplexity is stored with the cell), so the "Objectives" sections count every cell measured."""
    comp = state["comparison"]
    rows = list(comp["rows"])
    have = {(r["criterion"], r["n"]) for r in rows}
    for criterion in SEARCHES.values():
        for n, cell in sorted(state.get("criteria", {}).get(criterion, {}).items(), key=lambda kv: int(kv[0])):
            ppl = state.get("ppl", {}).get(set_key(cell["removed"]))
            if (criterion, int(n)) not in have and ppl is not None and int(n) in comp["params"]["budgets"]:
                rows.append({"criterion": criterion, "n": int(n), "removed": cell["removed"],
                             "dppl": delta_ppl_percent(comp["base"]["ppl"], ppl["ppl"]), "dppl_ci": None})
    return rows


def objective_sets(rows, budgets) -> list[list[list[int]]]:
    """The sets whose calibration objectives the "Objectives" section reads: per missed cell (the
    default objective's first), the search's set and the lowest set (:func:`miss_reason`)."""
    cells = sorted((c for c in objective_cells(rows, budgets) if not c["met"]),
                   key=lambda c: list(SEARCHES).index(c["objective"]))
    return [[c["row"]["removed"], c["best"]["removed"]] for c in cells]


def miss_reason(cell: dict, values: dict) -> str:
    """Why a search missed, as measured: each objective's calibration value of the set it
    chose and of the lowest set (``values``: objective -> set key -> value), and which of the
    two its own objective ranks lower (a misranking, or a set the search did not reach)."""
    mine, best, objective = cell["row"]["removed"], cell["best"]["removed"], cell["objective"]
    got = {o: (v.get(set_key(mine)), v.get(set_key(best))) for o, v in values.items()}
    own = got.get(objective, (None, None))
    if None in own:
        verdict = "calibration values not measured yet"
    elif own[0] < own[1]:
        verdict = f"the objective misranks them: it rates {fmt_set(mine)} lower"
    elif own[0] > own[1]:
        verdict = f"the search did not reach {fmt_set(best)}, which its objective rates lower"
    else:
        verdict = "the objective ties them"
    listed = "; ".join(f"{o} {a:.4f} vs {b:.4f}" for o, (a, b) in got.items() if a is not None and b is not None)
    return (f"n={cell['n']}, {cell['objective']}: chose {fmt_set(mine)} {cell['row']['dppl']:+.1f}% over "
            f"{fmt_set(best)} ({cell['best']['criterion']}) {cell['best']['dppl']:+.1f}% "
            f"(CI upper {cell['best']['dppl_ci'][1]:+.1f}); {verdict}" + (f" (calibration, chosen vs lowest: {listed})"
                                                                          if listed else "") + ".")


def objectives_section(rows, budgets, values: dict, heading: str = "##") -> tuple[list[str], dict]:
    """The "Objectives" table of one model: per n, each objective's search set, its dPPL% and
    whether it meets the target (lowest or inside the lowest's paired 95% CI), the count per
    objective and the reason for each miss. Returns the lines and ``{objective: (met, cells)}``."""
    cells = objective_cells(rows, budgets)
    objectives = [o for o in SEARCHES if any(c["objective"] == o for c in cells)]
    if not objectives:
        return [], {}
    by = {(c["objective"], c["n"]): c for c in cells}
    out = [f"{heading} Objectives of the search", "",
           "Per n: the set the search chooses with each objective on the calibration prompts (`removal_kl` is the "
           "default), its dPPL% and whether it is the lowest of every deterministic criterion or inside the lowest's "
           "paired 95% CI (the target of the default search above).", "",
           "| n | lowest (criterion) | dPPL % | its 95% CI | " + " | ".join(objectives) + " |",
           "|---" * (4 + len(objectives)) + "|"]
    for n in budgets:
        best = lowest(rows, n)
        if best is None:
            continue
        marks = []
        for o in objectives:
            c = by.get((o, n))
            marks.append("-" if c is None else f"{fmt_set(c['row']['removed'])} {c['row']['dppl']:+.1f} "
                         f"{'met' if c['met'] else 'missed'}{'' if c['row'].get('dppl_ci') else ' *'}")
        out.append(f"| {n} | {fmt_set(best['removed'])} ({best['criterion']}) | {best['dppl']:+.1f} | "
                   f"[{best['dppl_ci'][0]:+.1f}, {best['dppl_ci'][1]:+.1f}] | " + " | ".join(marks) + " |")
    counts = {o: (sum(c["met"] for c in cells if c["objective"] == o), sum(c["objective"] == o for c in cells))
              for o in objectives}
    if any(not c["row"].get("dppl_ci") for c in cells):
        out += ["", "\\* a cell of a search whose run has not reached its last budget yet (stored, not in the "
                "table above)."]
    out += ["", "Met: " + ", ".join(f"{o} {m} of {k}" for o, (m, k) in counts.items()) + "."]
    misses = [miss_reason(c, values) for c in cells if not c["met"]]
    if misses:
        out += ["", "Why each miss (objective values on the calibration prompts: removal_kl and ghosted in nats, "
                "nll in nats per token):", ""] + [f"- {m}" for m in misses]
    return out + [""], counts


def cost_table(table: CriterionComparison, budgets) -> list[str]:
    """Per criterion: the cost of choosing the sets of every budget up to the largest (one-shot
    rankings serve every budget from one sweep; searches continue from the smaller budgets)."""
    top = max(budgets)
    out = [f"## Cost of each criterion (selection only, budgets 1..{top})", "",
           "Forward passes = sweeps of the model over the calibration prompts (swap-KL scoring included for ours); "
           "evaluator calls = candidate sets a search scored; seconds = wall clock on this shared 2-core machine "
           "(ratios between rows are what carries over).", "",
           "| criterion | forward passes | block passes | evaluator calls | seconds |", "|---|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r["criterion"] for r in table.rows):
        r = next((r for r in table.rows if r["criterion"] == name and r["n"] == top), None)
        if r is None or name in ("random", "tail"):
            continue
        calls = "-" if r["evaluator_calls"] is None else str(r["evaluator_calls"])
        out.append(f"| {name} | {r['forward_passes']} | {r['block_passes']} | {calls} | {r['seconds']:.0f} |")
    return out + [""]


def recovery_section(table: CriterionComparison, budgets) -> list[str]:
    """dPPL% of every criterion's set after the same repair, who wins, and the ghosted-search target."""
    method = table.recovery
    rows = [r for r in table.rows if r.get("dppl_recovered") is not None]
    if not rows:
        return []
    names = list(dict.fromkeys(r["criterion"] for r in rows))
    by = {(r["criterion"], r["n"]): r for r in rows}
    out = [f"## After the same repair ({method} recovery)", "",
           f"Every criterion's set, cut from a copy of the dense model and repaired by `recover(method=\"{method}\")` "
           "fitted on the same calibration prompts, then evaluated under the same contract. dPPL% after repair "
           "(before repair in parentheses):", "",
           "| criterion | " + " | ".join(f"n={n}" for n in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for name in names:
        cells = []
        for n in budgets:
            r = by.get((name, n))
            cells.append("-" if r is None else f"{r['dppl_recovered']:+.1f} ({r['dppl']:+.1f})")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", "Who wins after repair:", ""] + who_wins(table, budgets, key="dppl_recovered") + [""]
    mine_name = "search"  # what LayerSwapConfig(recovery="ghosted") selects with (default objective)
    out += [f"Target: `{mine_name}` (the default objective, also with `recovery=\"{method}\"`) after repair beats "
            "every other criterion's set after the same repair "
            "(strictly lower dPPL%, or the same set), per n:", "",
            "| n | ours | dPPL % | best other (criterion) | dPPL % | target | by |", "|---|---|---|---|---|---|---|"]
    met = 0
    for n in budgets:
        mine = by.get((mine_name, n))
        others = [r for (c, m), r in by.items() if m == n and c != mine_name]
        if mine is None or not others:
            continue
        best = min(others, key=lambda r: r["dppl_recovered"])
        ok = mine["removed"] == best["removed"] or mine["dppl_recovered"] < best["dppl_recovered"]
        met += ok
        diff = mine["dppl_recovered"] - best["dppl_recovered"]
        out.append(f"| {n} | {fmt_set(mine['removed'])} | {mine['dppl_recovered']:+.1f} | {fmt_set(best['removed'])} "
                   f"({best['criterion']}) | {best['dppl_recovered']:+.1f} | {'met' if ok else 'missed'} | "
                   f"{'same set' if mine['removed'] == best['removed'] else f'{diff:+.1f} points'} |")
    return out + ["", f"Met in {met} of {len(budgets)} budgets.", ""]


def plot(table: CriterionComparison, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    markers = "os^vD<>ph*"
    for k, name in enumerate(dict.fromkeys(r["criterion"] for r in table.rows)):
        rows = sorted((r for r in table.rows if r["criterion"] == name), key=lambda r: r["n"])
        ns = [r["n"] for r in rows]
        ys = [r["dppl"] for r in rows]
        style = {"marker": markers[k % len(markers)], "label": LABELS.get(name, name)}
        if name in OURS:
            style["linewidth"] = 2.2
        else:
            style["linestyle"] = "--"
        if name == "random":
            lo = [r["dppl"] - r["dppl_min"] for r in rows]
            hi = [r["dppl_max"] - r["dppl"] for r in rows]
            ax.errorbar(ns, ys, yerr=[lo, hi], capsize=3, color="grey", **style)
        else:
            ax.plot(ns, ys, **style)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("blocks removed (n)")
    ax.set_ylabel("dPPL % (WikiText-2 test, matched contract)")
    ax.set_xticks(sorted({r["n"] for r in table.rows}))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    """The command line; the defaults are the experiment's ``[settings]``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(BUNDLED_MODELS), help="required unless --index-only or --render-only")
    p.add_argument("--index-only", action="store_true", help="only rewrite quality.md from the existing results")
    p.add_argument("--groups", nargs="+", default=None, choices=list(GROUPS),
                   help="run the model's cells of these experiment groups (criteria x budgets, and the repair, "
                        "of experiments/quality.toml) instead of --criteria x --budgets")
    p.add_argument("--budgets", type=int, nargs="+", default=SETTINGS["budgets"])
    p.add_argument("--criteria", nargs="+", default=list(DEFAULT_CRITERIA), choices=list(DEFAULT_CRITERIA))
    p.add_argument("--num-prompts", type=int, default=SETTINGS["num_prompts"])
    p.add_argument("--seq-len", type=int, default=SETTINGS["seq_len"])
    p.add_argument("--batch-size", type=int, default=SETTINGS["batch_size"])
    p.add_argument("--max-gap", type=int, default=SETTINGS["max_gap"],
                   help="protocol-gap summary over pairs with gap <= this")
    p.add_argument("--beam-evaluator", default=SETTINGS["beam_evaluator"], choices=["removal_kl", "nll"])
    p.add_argument("--random-draws", type=int, default=SETTINGS["random_draws"])
    p.add_argument("--recovery", choices=["ghosted", "fused"], default=None,
                   help="also evaluate every criterion's set after this repair of the cut (fitted on the calibration prompts)")
    p.add_argument("--recovery-criteria", nargs="+", default=None, choices=list(DEFAULT_CRITERIA),
                   help="only these criteria's sets are repaired (default: all but random)")
    p.add_argument("--max-words", type=int, default=None, help="override the contract's 5,000 words (smoke tests only)")
    p.add_argument("--threads", type=int, default=SETTINGS["threads"],
                   help="torch CPU threads (1 is fastest on a shared 2-core machine)")
    p.add_argument("--results", type=Path, default=RESULTS)
    add_runner_arguments(p)  # --render-only: every page and quality.md; --merge-from: runs of other cells
    return p


def model_cells(args) -> tuple[list[str], list[int], list[tuple[str, int]]]:
    """The criteria, budgets and cells ``(criterion, n)`` (criterion slowest, the table's row
    order) of this run: ``--criteria`` x ``--budgets``, or the model's cells of ``--groups``
    (then also the experiment's repair for the model, unless ``--recovery`` is given).

    Raises:
        SystemExit: groups without a cell of the model, or whose cells are not a full grid of
            criteria x budgets (one table needs every criterion at every budget).
    """
    if not args.groups:
        return list(args.criteria), list(args.budgets), [(c, n) for c in args.criteria for n in args.budgets]
    cells = list(dict.fromkeys((c["criterion"], c["n"]) for g in args.groups for c in GROUPS[g]
                               if c["model"] == args.model))
    criteria, budgets = list(dict.fromkeys(c for c, _ in cells)), sorted({n for _, n in cells})
    if not cells or len(cells) != len(criteria) * len(budgets):
        raise SystemExit(f"--groups {args.groups}: {len(cells)} cells of {args.model}, not a full grid of criteria "
                         "x budgets (each group lists every criterion of a model at every budget)")
    repair = EXPERIMENT.get("repair", {}).get(args.model)
    if args.recovery is None and repair:
        args.recovery, args.recovery_criteria = repair["method"], list(repair["criteria"])
    return criteria, budgets, [(c, n) for c in criteria for n in budgets]


def merge_pieces(state_path: Path, sources, run: bool) -> None:
    """``--merge-from``: the states of runs of other cells (other processes, other ``--results``
    folders) into ``state_path``; a cell, perplexity or report stored with different values in
    two files is refused (timings excepted: the first is kept). The run summary (table, command,
    number of merged runs) stays the first file's until a run builds it from the merged cells:
    ``run`` (not ``--render-only``) records the files merged as ``merged_runs``, which the page
    states."""
    runs = (1 if state_path.is_file() else 0) + len(sources)
    merge_files(state_path, sources, union=(), first=RUN_SUMMARY, volatile=TIMINGS)
    if run:
        CellStore(state_path, fresh=dict).update(lambda state: state.__setitem__("merged_runs", runs))
    log(f"merged {runs} state files into {state_path.name}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.merge_from:
        if args.model is None:
            parser().error("--merge-from needs --model (the results file the pieces go into)")
        merge_pieces(args.results / f"quality-{args.model}.json", args.merge_from, not args.render_only)
    if args.index_only:
        write_index(args.results)
        return 0
    if args.render_only:
        stored = sorted(args.results.glob("quality-*.json"))
        if not stored:
            raise SystemExit(f"--render-only: no quality-*.json in {args.results}: nothing to render")
        for state_path in stored:
            render_stored(state_path)
        write_index(args.results)
        return 0
    if args.model is None:
        parser().error("--model is required (or pass --index-only or --render-only)")
    criteria, budgets, cells = model_cells(args)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    log(f"loading {args.model}")
    model, tok = load_model(args.model)
    calib = wikitext_calibration(tok, args.num_prompts, args.seq_len)
    log(f"{num_blocks(model)} blocks; calibration {calib.num_prompts} prompts, {calib.num_tokens} tokens")
    args.results.mkdir(parents=True, exist_ok=True)
    state_path = args.results / f"quality-{args.model}.json"
    fixed = EXPERIMENT["criterion_options"]
    harness = {
        "eval_text": EVALUATION, "tokenizer": tok, "contract": "matched", "evaluation_method": "copy",
        "options": {"random": {"draws": args.random_draws, **fixed["random"]},
                    "interchange_beam": {"evaluator": args.beam_evaluator, **fixed["interchange_beam"]}},
        "batch_size": args.batch_size, "evaluation_options": {"max_words": args.max_words} if args.max_words else None,
        "state_path": state_path, "log": log,
    }
    repaired = [c for c in (args.recovery_criteria or criteria) if c != "random"] if args.recovery else []

    def run_cell(cell) -> dict:
        """One criterion at one budget: its selection (continuing a search from its smaller
        budgets), the perplexity and removal KL of its sets, and its repair; stored by the
        library's harness in the state, from which the cell's record is read back."""
        criterion, n = cell
        compare_criteria(model, calib, [n], criteria=[criterion],
                         recovery=args.recovery if criterion in repaired else None, **harness)
        return json.loads(state_path.read_text(encoding="utf-8"))["criteria"][criterion][str(n)]

    # the harness writes the file itself: the store re-reads it before each cell (shared)
    run_cells(CellStore(state_path, fresh=dict, cells="criteria", depth=2, shared=True),
              [(f"{c}/{n}", (c, n)) for c, n in cells], run_cell, tag="quality",
              describe=lambda record: f"removed {record['removed']}")
    # the table from the stored cells (computes only what a stopped cell left undone)
    table = compare_criteria(model, calib, budgets, criteria=criteria, recovery=args.recovery,
                             recovery_criteria=args.recovery_criteria, **harness)
    run_extras(model, tok, calib, table, state_path, args)
    objective_values(model, calib, table, state_path, args)
    finish(model, table, state_path, args, argv)
    log(f"done in {time.time() - t_start:.0f} s; wrote {state_path.with_suffix('.md').name} and quality.md")
    return 0


def run_extras(model, tok, calib, table: CriterionComparison, state_path: Path, args) -> None:
    """The model's two cells beside the table, stored under ``extras``: the protocol gap over
    the pairs with 2 <= gap <= ``--max-gap`` and the copy-vs-plan check of one removed set."""
    check_set = next((r["removed"] for r in table.rows if r["criterion"] == "interchange"), None)
    names = (["gap_extension"] if args.max_gap > 1 else []) + (["plan_check"] if check_set else [])

    def run_extra(name: str) -> dict:
        if name == "gap_extension":
            return gap_extension(model, calib, args.max_gap, args.batch_size).to_dict()
        opts = {"batch_size": 2, **({"max_words": args.max_words} if args.max_words else {})}
        by_plan = evaluate_removed(model, check_set, EVALUATION, tok, "matched", "plan", opts)
        stored = json.loads(state_path.read_text(encoding="utf-8"))["ppl"][",".join(map(str, sorted(check_set)))]
        return {"removed": check_set, "ppl_by_plan": by_plan.ppl, "ppl_by_copy": stored["ppl"]}

    run_cells(CellStore(state_path, fresh=dict, cells="extras", shared=True), [(k, k) for k in names], run_extra,
              tag="quality")


def objective_values(model, calib, table: CriterionComparison, state_path: Path, args) -> None:
    """Each objective's value on the calibration prompts of the sets the "Objectives" section
    reads (:func:`objective_sets`), stored under ``extras.objective_values.<objective>.<set>``
    after each missed cell (a stopped run keeps the cells done): the removal KL the harness
    stored for the set (its joint removal KL on the same prompts), the others scored here
    (a few partial forward passes per set; only sets not stored yet)."""
    store = CellStore(state_path, fresh=dict, shared=True)
    evaluators: dict[str, SetObjective] = {}
    for pair in objective_sets(objective_rows({**store.state, "comparison": table.to_dict()}), table.params["budgets"]):
        found: dict[str, dict] = {}
        for objective in OBJECTIVES:
            stored = store.state.get("extras", {}).get("objective_values", {}).get(objective, {})
            known = store.state.get("removal_kl", {}) if objective == "removal_kl" else {}
            todo = [s for s in pair if set_key(s) not in stored]
            found[objective] = {set_key(s): known[set_key(s)] for s in todo if set_key(s) in known}
            todo = [s for s in todo if set_key(s) not in found[objective]]
            if todo:
                log(f"objective {objective} of {', '.join(map(fmt_set, todo))} on the calibration prompts")
                if objective not in evaluators:
                    evaluators[objective] = SetObjective(model, calib, objective, batch_size=args.batch_size)
                found[objective].update({set_key(s): v for s, v in zip(todo, evaluators[objective](todo))})
        store.update(lambda state, f=found: [cell_node(state, ("extras", "objective_values", o)).update(v)
                                             for o, v in f.items()])


def finish(model, table: CriterionComparison, state_path: Path, args, argv) -> None:
    """Store the run summary (table, protocol gap, command, machine) and write the page, the plot
    and quality.md."""
    state = json.loads(state_path.read_text(encoding="utf-8"))
    extras = state.get("extras", {})
    parts = [SwapReport.from_dict(table.reports[p]) for p in ("replacement", "interchange") if p in table.reports]
    if "gap_extension" in extras:
        # this script's own partial report (only the pairs 2 <= gap <= max_gap): trusted as written
        parts.append(SwapReport.from_dict(extras["gap_extension"], trust=True))
    gap = protocol_gap_quartiles(merge_reports(*parts)) if len(parts) >= 2 else None
    summary = {"comparison": table.to_dict(), "protocol_gap": gap, "command": command(argv),
               "environment": environment(args)}
    state = CellStore(state_path, fresh=dict, shared=True).update(lambda s: s.update(summary))
    total = num_blocks(model)
    title = f"{model_identity(model)['name']} ({total} blocks)"
    stem = state_path.with_suffix("")
    plot(table, stem.with_suffix(".png"), title)
    write_markdown(stem.with_suffix(".md"), table, gap, extras, total, title, state["command"],
                   state["environment"], state)
    write_index(args.results)


def command(argv) -> str:
    """The command line, less ``--merge-from`` and its local state paths: the single-process
    command that gives the same results."""
    return command_line("quality.py", argv)


def environment(args) -> dict:
    return {"platform": platform.platform(), "processor": platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": args.threads, **library_versions()}


def write_markdown(path: Path, table, gap, extras, num_blocks, title, command_text, env, state) -> None:
    ident = table.model
    budgets = table.params["budgets"]
    eval_total = sum(v for v in (state.get("ppl_seconds") or {}).values() if v)
    lines = [
        f"# Quality benchmark: {title}",
        "",
        "Command (from the repository root):",
        "",
        "```",
        command_text,
        "```",
        "",
        *([f"(Run as {state['merged_runs']} processes over disjoint criteria, their states merged with "
           "`--merge-from`; the pieces are cached, so the command above reproduces the same numbers.)", ""]
          if state.get("merged_runs") else []),
        f"- Model: `{ident.get('name')}`, weights {ident.get('revision')} (dequantized to fp32), {num_blocks} "
        "decoder blocks, layers 0-based.",
        f"- Machine: {env['platform']}, {env['cpu_count']} CPU cores, torch threads {env['torch_threads']}; "
        f"torch {env['torch']}, transformers {env['transformers']}, hf_layerswap {env['hf_layerswap']}.",
        f"- Calibration (every criterion, same prompts): {table.calibration['description']}; "
        f"{table.calibration['num_prompts']} prompts, {table.calibration['num_tokens']} real tokens, sha256 "
        f"{table.calibration['content_hash'][:12]}.",
        "- Evaluation: `evaluate_perplexity(contract=\"matched\")` on WikiText-2 raw test "
        "(`../shared/data/wikitext-2-raw/wiki.test.raw`); the text is never seen by any criterion "
        "(the beam is scored by calibration removal KL, not by the evaluation text as in the paper).",
        "- Costs: forward passes = sweeps of the model over the calibration prompts (a probe starting mid-stack "
        "counts as one); evaluator calls = candidate sets scored by a search; seconds = wall clock of selection "
        f"on this shared machine (evaluation not included: {eval_total:.0f} s for "
        f"{len(state.get('ppl_seconds') or {})} perplexity runs).",
        "- Protection: the first and last block are never removed by single-removal KL, SLEB, random, tail and "
        "ours (spacing 1 for the guided rule, none for the beam); Block Influence and angular distance follow "
        "their papers and may remove any block.",
        "",
        "## Results",
        "",
        table.to_markdown(),
        f"![dPPL% vs n]({path.with_suffix('.png').name})",
        "",
    ]
    lines += winners(table, budgets) + ["", "## Who wins at each n", ""] + who_wins(table, budgets) + [""]
    lines += search_targets(table, budgets)
    lines += objectives_section(objective_rows({**state, "comparison": table.to_dict()}), budgets,
                                extras.get("objective_values", {}))[0]
    lines += cost_table(table, budgets) + recovery_section(table, budgets)
    if gap:
        lines += protocol_section(table, gap, budgets) + [""]
    check = extras.get("plan_check")
    if check:
        lines += [
            "## Evaluation path check",
            "",
            f"Removed set {fmt_set(check['removed'])}: PPL {check['ppl_by_copy']:.6f} by pruning a deep copy "
            f"(`remove_layers`) vs {check['ppl_by_plan']:.6f} by a removal plan on the unpruned model.",
            "",
        ]
    lines += layer_section(table, num_blocks) + [""]
    lines += [
        "## Contract (as recorded with every number)",
        "",
        "```json",
        json.dumps({k: v for k, v in table.contract.items() if k != "model"}, indent=1, sort_keys=True),
        "```",
        "",
        "All numbers, per-window NLLs and per-criterion details: "
        f"[`{path.with_suffix('.json').name}`]({path.with_suffix('.json').name}).",
    ]
    write_text_atomic("\n".join(lines) + "\n", path)


def render_stored(state_path: Path) -> None:
    """Rewrite one model's page from its stored state (command, environment and numbers as
    recorded); the plot is left as it is."""
    state = read_state(state_path, "--render-only: results file")
    if "comparison" not in state:
        raise SystemExit(f"--render-only: {state_path} holds cells but no table (a run stopped before its end, or "
                         "merged pieces): run the model's command to build the table from the stored cells")
    table = CriterionComparison.from_dict(state["comparison"])
    num_blocks = next(iter(state["reports"].values()))["num_blocks"]
    title = f"{table.model['name']} ({num_blocks} blocks)"
    write_markdown(state_path.with_suffix(".md"), table, state.get("protocol_gap"), state.get("extras", {}),
                   num_blocks, title, state["command"], state["environment"], state)


def default_choice(totals: dict) -> list[str]:
    """The rule that picks the default objective, applied to ``totals`` (objective -> [met,
    measured], over every model): another objective replaces ``removal_kl`` only when it has
    been measured on every cell the default was and meets strictly more of them; one that
    already misses at least as many cells as the default cannot, whatever its other cells give."""
    met, cells = totals.get("removal_kl", (0, 0))
    out = [f"Choosing the default: an objective replaces `removal_kl` ({met} of {cells} met) only when it is "
           "measured on every cell and meets strictly more of them."]
    for objective, (m, k) in totals.items():
        if objective == "removal_kl":
            continue
        if k - m >= cells - met:
            verdict = f"misses {k - m} of the {k} measured, at least as many as the default: it cannot replace it"
        elif k < cells:
            verdict = f"misses {k - m} of the {k} measured; not measured on every cell yet"
        else:
            verdict = f"meets more ({m} of {k}): it replaces the default"
        out.append(f"- `{objective}`: {verdict}.")
    return out


def write_index(results: Path) -> None:
    """``quality.md``: the headline dPPL% of every criterion on every benchmarked model."""
    lines = [
        "# Quality benchmark: headline numbers",
        "",
        "dPPL % on WikiText-2 raw test (matched contract: first 5,000 words, window 512, stride 256) after "
        "removing n blocks, every criterion selected on the same WikiText-2 validation calibration prompts. "
        "Random: mean of 5 seeded draws. Full tables, intervals, costs and contracts in the per-model files.",
        "",
    ]
    totals: dict[str, list[int]] = {}
    models = []
    for path in sorted(results.glob("quality-*.json")):
        state = json.loads(path.read_text(encoding="utf-8"))
        comp = state.get("comparison")
        if not comp:
            continue
        budgets = comp["params"]["budgets"]
        rows = {(r["criterion"], r["n"]): r for r in comp["rows"]}
        name = comp["model"].get("name")
        lines += [
            f"## {name}", "",
            f"Base PPL {comp['base']['ppl']:.3f}. Command: `{state.get('command')}`. "
            f"Details: [{path.with_suffix('.md').name}]({path.with_suffix('.md').name}).", "",
            "| criterion | " + " | ".join(f"n={n}" for n in budgets) + " |",
            "|---" * (len(budgets) + 1) + "|",
        ]
        for crit in comp["params"]["criteria"]:
            cells = []
            for n in budgets:
                r = rows.get((crit, n))
                if r is None:
                    cells.append("-")
                elif crit == "random":
                    cells.append(f"{r['dppl']:+.1f} ({r['dppl_min']:+.1f} .. {r['dppl_max']:+.1f})")
                else:
                    cells.append(f"{r['dppl']:+.1f} {fmt_set(r['removed'])}")
            lines.append(f"| {LABELS.get(crit, crit)} | " + " | ".join(cells) + " |")
        lines.append("")
        section, counts = objectives_section(objective_rows(state), budgets,
                                             state.get("extras", {}).get("objective_values", {}), heading="###")
        lines += section
        models.append(path.stem.removeprefix("quality-"))
        for objective, (met, measured) in counts.items():
            total = totals.setdefault(objective, [0, 0])
            total[0], total[1] = total[0] + met, total[1] + measured
    if totals:
        lines += ["## Objectives across models", "",
                  f"Cells (model, n) where the search with each objective meets the target (the lowest dPPL% of every "
                  f"deterministic criterion, or inside its paired 95% CI), over {', '.join(models)}:", "",
                  "| objective | met | cells measured |", "|---|---:|---:|"]
        lines += [f"| {o}{' (default)' if o == 'removal_kl' else ''} | {m} | {k} |" for o, (m, k) in totals.items()]
        lines += ["", *default_choice(totals), ""]
    write_text_atomic("\n".join(lines) + "\n", results / "quality.md")


if __name__ == "__main__":
    sys.exit(main())
