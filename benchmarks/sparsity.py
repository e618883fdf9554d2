"""Sparsity benchmark: one-shot pruning with uniform, PALS, OWL, random (and gradient)
layerwise sparsity, with Wanda (or SparseGPT), unstructured and N:M.

For every configuration the dense weights are restored, :func:`hf_layerswap.sparsity.sparsify`
prunes the model on a calibration set drawn from WikiText-2 validation
(``../shared/data/wikitext-2/valid.txt``; paragraphs shuffled with the calibration seed), and
perplexity is measured with :func:`hf_layerswap.evaluation.evaluate_perplexity` under the
matched contract on WikiText-2 raw test (``../shared/data/wikitext-2-raw/wiki.test.raw``).
Each allocator is compared with uniform allocation on the same calibration set and the
same evaluation windows (paired bootstrap over windows, :func:`delta_ppl_ci`); with several
calibration seeds, the across-seed mean, a t-based 95% interval and an exact sign-flip
(permutation) test of the paired per-seed differences are reported.

Running, resuming and merging are the benchmark runner's (``benchmarks/runner.py``): results
are cached per configuration in the JSON file, so an interrupted run resumes. Several
processes may share one model's cache (e.g. one per core, each with its own ``--seeds``): every
write merges under a file lock, and a configuration another process has stored is not run again.
Caches filled on other machines merge with ``--merge-from`` (a configuration stored with
different values is refused).

Usage (from the repository root)::

    python benchmarks/sparsity.py --model smollm2-135m --sparsity 0.5 \\
        --allocations uniform pals owl random --patterns unstructured 2:4 --seeds 0

Each model has its own cache and page (``results/sparsity-<model>.{json,md}``; a cache
recorded for another model is refused); ``results/sparsity.md`` indexes the pages.

An allocation may carry extra options, e.g. ``pals/source=block_input`` (PALS on the
residual stream entering each block instead of the linears' inputs).
"""

from __future__ import annotations

import argparse
import itertools
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from hf_layerswap.evaluation import PerplexityResult, delta_ppl_ci, delta_ppl_percent, evaluate_perplexity  # noqa: E402
from hf_layerswap.models import load_model  # noqa: E402
from hf_layerswap.utils.provenance import model_identity  # noqa: E402
from hf_layerswap.utils.jsonio import write_text_atomic  # noqa: E402
from hf_layerswap.sparsity import SparsityReport, sparsify  # noqa: E402
from hf_layerswap.sparsity.allocators import ALLOCATIONS  # noqa: E402
from runner import (  # noqa: E402
    CellStore,
    add_runner_arguments,
    experiment_cells,
    load_experiment,
    merge_files,
    read_state,
    run_cells,
)
from wikitext import wikitext_calibration  # noqa: E402

EVALUATION = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
RESULTS = REPO / "benchmarks" / "results"

#: The target sparsities the benchmark covers (a page names those without runs).
ISSUE_LEVELS = (0.5, 0.6)
ISSUE_SEEDS = 9  # calibration seeds per cell the grid asks for

# two-sided 97.5% Student t quantiles for small samples (df -> t)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def parse_allocation(spec: str) -> tuple[str, dict]:
    """``"pals"`` -> ``("pals", {})``; ``"pals/source=block_input/percentile=0.999"`` -> the
    allocation and extra :func:`sparsify` options (numbers parsed as floats, true/false as bools)."""
    name, *pairs = spec.split("/")
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if value.lower() in ("true", "false"):
            options[key] = value.lower() == "true"
            continue
        try:
            options[key] = float(value)
        except ValueError:
            options[key] = value
    return name, options


def config_key(pattern, allocation, method, seed, settings) -> str:
    """Cache key: everything that changes a result."""
    return (
        f"{pattern or 'unstructured'}|{allocation}|{method}|seed{seed}|s{settings['sparsity']:g}"
        f"|{settings['num_prompts']}x{settings['seq_len']}|words{settings['eval_words']}"
    )


def interval(low, high, spec: str) -> str:
    """``[low, high]`` in format ``spec``, or ``[—]`` when there is no interval (``None``:
    fewer than two evaluation windows score a token, e.g. ``--eval-words 200``)."""
    if low is None or high is None:
        return "[—]"
    return f"[{low:{spec}}, {high:{spec}}]"


def mean_ci(values: list[float]) -> tuple[float, float | None]:
    """Mean and half-width of the t-based 95% interval (None for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, None
    return m, T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def sign_flip_p(diffs: list[float]) -> float:
    """Exact two-sided sign-flip permutation p-value of the mean paired difference."""
    observed = abs(statistics.fmean(diffs))
    flips = list(itertools.product((1, -1), repeat=len(diffs)))
    extreme = sum(abs(statistics.fmean([s * d for s, d in zip(signs, diffs)])) >= observed - 1e-12 for signs in flips)
    return extreme / len(flips)


def without_local_paths(data):
    """Drop ``path`` entries (this machine's cache location) from nested records."""
    if isinstance(data, dict):
        return {k: without_local_paths(v) for k, v in data.items() if k != "path"}
    if isinstance(data, list):
        return [without_local_paths(v) for v in data]
    return data


def describe_model(identity: dict) -> str:
    source = identity.get("source") or {}
    if source.get("bundled_name"):
        return (
            f"{identity['name']} (bundled `{source['bundled_name']}`: GGUF {source.get('quantization')} from "
            f"{source.get('package')} {source.get('package_version')}, dequantized to {source.get('dequantized_dtype')})"
        )
    return f"{identity.get('name')} (revision {identity.get('revision')})"


def bos_text(bos) -> str:
    if not isinstance(bos, dict):
        return str(bos)
    return f"{'added' if bos.get('add_bos') else 'none'} ({bos.get('bos_choice')})"


def open_store(path: Path) -> CellStore:
    """The result cache, shared by the processes that fill it (the runner's locked store: each
    configuration is merged into the file under ``<json>.lock``, so none loses another's runs)."""
    return CellStore(path, fresh=lambda: {"runs": {}}, cells="runs", shared=True)


def configurations(args) -> list[tuple]:
    """``(pattern, allocation, method, seed)`` of every configuration a run with ``args`` covers, in
    run order (pattern ``None`` is unstructured; an N:M pattern runs uniform allocation only)."""
    return [(None if pattern == "unstructured" else pattern, allocation, method, seed)
            for pattern in args.patterns
            for allocation in (args.allocations if pattern == "unstructured" else ["uniform"])
            for method in args.methods for seed in args.seeds]


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    out_json = Path(args.json)
    model, tokenizer = load_model(args.model)
    model.eval()
    identity = without_local_paths(model_identity(model))

    def claim(store):
        if args.fresh:
            store.clear()
            store["runs"] = {}
        if store.get("model", identity) != identity:  # cached runs of another model must never be reused
            raise SystemExit(
                f"{out_json} holds runs of {store['model'].get('name')!r}, not of {identity.get('name')!r} "
                f"(--model {args.model}): pass another --json, or --fresh to start it over"
            )
        store["model"] = identity

    cache = open_store(out_json)
    store = cache.update(claim)
    dense_state = {k: v.clone() for k, v in model.state_dict().items()}

    def evaluate():
        return evaluate_perplexity(
            model, str(EVALUATION), tokenizer=tokenizer, contract="matched", max_words=args.eval_words, batch_size=4
        )

    dense_key = f"dense|words{args.eval_words}"
    if dense_key not in store:
        t = time.perf_counter()
        record = {"ppl": without_local_paths(evaluate().to_dict()), "eval_s": time.perf_counter() - t}
        store = cache.update(lambda s: s.setdefault(dense_key, record))
    print(f"dense PPL {store[dense_key]['ppl']['ppl']:.3f}", flush=True)

    def run_one(config):
        pattern, allocation, method, seed = config
        model.load_state_dict(dense_state)
        calib = wikitext_calibration(tokenizer, args.num_prompts, args.seq_len, seed)
        t = time.perf_counter()
        name, extra = parse_allocation(allocation)
        report = sparsify(model, calib, sparsity=args.sparsity, allocation=name, pruner=method, pattern=pattern,
                          batch_size=args.batch_size, **extra)
        sparsify_s = time.perf_counter() - t
        t = time.perf_counter()
        ppl = evaluate()
        return {
            "pattern": pattern,
            "allocation": allocation,
            "method": method,
            "seed": seed,
            "report": {**report.to_dict(), "linears": []},  # per-linear rows dropped to keep the file small
            "ppl": without_local_paths(ppl.to_dict()),
            "sparsify_s": sparsify_s,
            "eval_s": time.perf_counter() - t,
        }

    run_cells(cache, [(config_key(*c, vars(args)), c) for c in configurations(args)], run_one, tag="sparsity",
              describe=lambda r: f"sparsity {r['report']['achieved_sparsity']:.4f} PPL {r['ppl']['ppl']:.3f} "
                                 f"({r['sparsify_s']:.0f} s)")
    model.load_state_dict(dense_state)
    settings = {k: v for k, v in vars(args).items()
                if k not in ("fresh", "render_only", "merge_from", "experiment", "groups", "json", "output")}
    return cache.update(lambda s: s.__setitem__("settings", settings))


def levels(store: dict) -> list[float]:
    """The target sparsities with cached runs under the last run's calibration size and
    evaluation contract, ascending."""
    settings = store["settings"]
    found = set()
    for key, r in store["runs"].items():
        level = float(r["report"]["target_sparsity"])
        if key == config_key(r["pattern"], r["allocation"], r["method"], r["seed"], {**settings, "sparsity": level}):
            found.add(level)
    return sorted(found)


def render(store: dict, command: str, json_name: str) -> str:
    """The model's page: one header, then one section per target sparsity."""
    settings = store["settings"]
    dense = PerplexityResult.from_dict(store[f"dense|words{settings['eval_words']}"]["ppl"])
    done = levels(store)
    sections = [level_section(store, {**settings, "sparsity": level}, dense) for level in done]
    not_run = [f"{level:g}" for level in ISSUE_LEVELS if level not in done]
    any_run = next(r for r in store["runs"].values()
                   if r["report"]["calibration"]["num_prompts"] == settings["num_prompts"])
    calib = any_run["report"]["calibration"]
    opts = any_run["report"]["options"]
    contract = dense.contract
    lines = [
        "# Sparsity benchmark: layerwise allocation for one-shot pruning",
        "",
        "```",
        *store.get("commands", [command]),
        "```",
        "",
        f"(Each command adds configurations; results are cached per configuration in `{json_name}`, and this "
        "file shows every cached run with the same calibration size and evaluation contract, one section per "
        "target sparsity.)",
        "",
        f"Model: {describe_model(store['model'])}. The target sparsity applies to every "
        "`nn.Linear` weight inside the decoder blocks (embeddings, norms and LM head dense). Target sparsities "
        f"run: {', '.join(f'{level:g}' for level in done)}"
        + (f" (not yet: {', '.join(not_run)})." if not_run else ".")
        + " An N:M pattern fixes every block's sparsity at N/M, so 2:4 runs at 0.5 with uniform allocation only.",
        "",
        f"Calibration: WikiText-2 validation paragraphs shuffled with the seed, {calib['num_prompts']} prompts "
        f"truncated to {settings['seq_len']} tokens ({calib['num_tokens']} real tokens for seed "
        f"{any_run['seed']}); statistics for the allocators from the dense model, pruning block by block "
        "on the outputs of the already-pruned blocks.",
        "",
        f"Evaluation: matched contract, {contract.get('source', 'wiki.test.raw')} first {contract.get('max_words')} "
        f"words, window {contract.get('window')} / stride {contract.get('stride')}, {dense.tokens} scored tokens "
        f"in {dense.windows} windows, BOS {bos_text(contract.get('bos'))}, dtype {contract.get('dtype')}. "
        "PPL 95% interval: bootstrap over windows (1,000 resamples, seed 42).",
        "",
        f"Dense PPL: **{dense.ppl:.3f}** {interval(dense.ci_low, dense.ci_high, '.3f')}.",
        "",
        f"Allocator options: PALS percentile {opts['percentile']:g} of |activation| (source {opts['source']}, "
        f"pool {opts['pool']}, estimator {opts['estimator']} with {opts['bins_per_octave']} bins per octave), "
        f"{opts['mapping']} mapping, delta {opts['delta']:g}, scale {opts['scale'] or opts['delta']:g}, exact "
        f"parameter-weighted budget; OWL M = {opts['owl_m']:g}, lambda = {opts['owl_lambda']:g} (reference "
        f"mapping); random U(-delta, delta) offsets, seed {opts['seed']}, exact budget. Per-block statistics: "
        "see the JSON file.",
        "",
    ]
    return "\n".join(lines + [line for section in sections for line in section])


def level_section(store: dict, settings: dict, dense: PerplexityResult) -> list[str]:
    """Tables, findings and per-block targets of the runs at ``settings['sparsity']``."""
    runs = {
        key: r
        for key, r in store["runs"].items()
        if key == config_key(r["pattern"], r["allocation"], r["method"], r["seed"], settings)
    }
    order = ["uniform", "pals", "owl", "random", "gradient"]

    def row_order(item):
        r = item[1]
        name = parse_allocation(r["allocation"])[0]
        return (r["pattern"] is not None, r["pattern"] or "", order.index(name), r["allocation"], r["method"], r["seed"])

    runs = dict(sorted(runs.items(), key=row_order))
    lines = [
        f"## Sparsity {settings['sparsity']:g}",
        "",
        "| pattern | allocation | method | calib seed | achieved sparsity | block targets min-max | PPL [95% CI] "
        "| dPPL% vs dense | vs uniform, same seed: dPPL% [paired 95% CI] | sparsify s |",
        "|---|---|---|---:|---:|---|---|---:|---|---:|",
    ]
    for key, r in runs.items():
        ppl = PerplexityResult.from_dict(r["ppl"])
        rep = SparsityReport.from_dict(r["report"])
        ukey = config_key(r["pattern"], "uniform", r["method"], r["seed"], settings)
        versus = ""
        if r["allocation"] != "uniform" and ukey in runs:
            base = PerplexityResult.from_dict(runs[ukey]["ppl"])
            lo, hi = delta_ppl_ci(base, ppl)
            versus = f"{delta_ppl_percent(base, ppl):+.2f} {interval(lo, hi, '+.2f')}"
        lines.append(
            f"| {r['pattern'] or 'unstructured'} | {r['allocation']} | {r['method']} | {r['seed']} "
            f"| {rep.achieved_sparsity:.4f} | {min(rep.block_targets):.3f}-{max(rep.block_targets):.3f} "
            f"| {ppl.ppl:.3f} {interval(ppl.ci_low, ppl.ci_high, '.3f')} | {delta_ppl_percent(dense, ppl):+.1f} "
            f"| {versus} | {r['sparsify_s']:.0f} |"
        )
    # across seeds
    groups: dict = {}
    for r in runs.values():
        groups.setdefault((r["pattern"] or "unstructured", r["allocation"], r["method"]), {})[r["seed"]] = r["ppl"]["ppl"]
    if any(len(v) > 1 for v in groups.values()):
        lines += [
            "",
            "Across calibration seeds (mean, t-based 95% interval; paired test vs uniform on the seeds both have: "
            "exact sign-flip permutation p-value, two-sided; with n seeds the smallest possible p is 2/2^n, "
            "i.e. 0.25 for 3):",
            "",
            "| pattern | allocation | method | seeds | mean PPL +- 95% | mean paired diff vs uniform | p |",
            "|---|---|---|---:|---|---:|---:|",
        ]
        for (pattern, allocation, method), by_seed in groups.items():
            m, h = mean_ci(list(by_seed.values()))
            diff, p = "", ""
            _, _, mean_diff, p_value = paired_difference(by_seed, groups.get((pattern, "uniform", method), {}))
            if allocation != "uniform" and p_value is not None:
                diff, p = f"{mean_diff:+.3f}", f"{p_value:.3f}"
            ci = "" if h is None else f" +- {h:.3f}"
            lines.append(f"| {pattern} | {allocation} | {method} | {len(by_seed)} | {m:.3f}{ci} | {diff} | {p} |")
    lines += ["", *findings(runs, groups, settings), ""]
    # per-block allocations
    lines += ["", "Per-block targets (0-based blocks; first calibration seed):", ""]
    shown = set()
    for r in runs.values():
        if r["allocation"] in shown or r["pattern"] is not None or r["allocation"] == "uniform":
            continue
        shown.add(r["allocation"])
        rep = SparsityReport.from_dict(r["report"])
        lines.append(f"- {r['allocation']}: " + ", ".join(f"{t:.3f}" for t in rep.block_targets))
        if rep.blocks[0].statistic is not None:
            lines.append(
                f"  - statistic ({rep.allocator.get('statistic')}): "
                + ", ".join(f"{b.statistic:.4g}" for b in rep.blocks)
            )
    lines += [""]
    return lines


def paired_difference(a: dict, b: dict) -> tuple[list, list[float], float | None, float | None]:
    """Paired comparison of ``{seed: PPL}`` maps on the seeds both have: ``(seeds, a - b per seed,
    mean difference, exact sign-flip p)``; mean and p are None below two paired seeds."""
    common = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in common]
    if len(common) < 2:
        return common, diffs, None, None
    return common, diffs, statistics.fmean(diffs), sign_flip_p(diffs)


def pals_verdict(groups: dict, method: str, sparsity: float) -> str:
    """The PALS paper's claim (PALS below uniform) judged by the paired sign-flip test over calibration seeds.

    It reproduces when the mean paired PPL difference is negative at p < 0.05, is reversed when it is
    positive at p < 0.05, and is otherwise undecided (including a single seed, where no test exists).
    """
    pals, uni = groups[("unstructured", "pals", method)], groups.get(("unstructured", "uniform", method), {})
    common, diffs, mean, p = paired_difference(pals, uni)
    better = sum(d < 0 for d in diffs)
    head = f"The PALS paper's direction (PALS below uniform {method}) "
    tail = f"on this model at sparsity {sparsity:g} (default options: p99 of the linears' inputs, z-score, +-0.05)"
    if p is None:
        return head + f"is undecided {tail}: {len(common)} calibration seed (PALS better on {better}), no paired test."
    if p < 0.05:
        verdict = "reproduces" if mean < 0 else "is reversed"
    else:
        verdict = "is undecided (no reliable direction)"
    return head + (
        f"{verdict} {tail}: PALS better on {better} of {len(common)} calibration seeds, "
        f"mean paired PPL difference {mean:+.3f}, sign-flip p = {p:.3f}."
    )


def ablation_verdict(groups: dict, method: str) -> str:
    """The PALS paper's ablation claim (gradient allocation worse than random), per method,
    judged like :func:`pals_verdict`: holds when the mean paired PPL difference gradient - random
    is positive at sign-flip p < 0.05, is reversed when negative at p < 0.05, else undecided."""
    grad, rand = groups[("unstructured", "gradient", method)], groups[("unstructured", "random", method)]
    common, diffs, mean, p = paired_difference(grad, rand)
    worse = sum(d > 0 for d in diffs)
    head = f"The paper's ablation claim (gradient allocation worse than random, {method}) "
    runs = "; ".join(f"seed {s}: {grad[s]:.3f} vs {rand[s]:.3f}" for s in common)
    if p is None:
        return head + f"is undecided: {len(common)} paired seed, no test ({runs})."
    verdict = ("holds" if mean > 0 else "is reversed") if p < 0.05 else "is undecided (no reliable direction)"
    return head + (
        f"{verdict} here: gradient worse on {worse} of {len(common)} calibration seeds, mean paired PPL "
        f"difference {mean:+.3f}, sign-flip p = {p:.3f} ({runs})."
    )


def scope_statement(groups: dict, sparsity: float) -> str:
    """What a page at ``sparsity`` covers and what of the grid (both methods, every allocator,
    2:4 at 0.5, ``ISSUE_SEEDS`` calibration seeds per cell) it lacks. ``groups`` maps
    ``(pattern, allocation, method)`` to ``{seed: PPL}``; allocations with options are variants
    outside the grid, listed with their seed counts."""
    methods = {k[2] for k in groups}
    patterns = {k[0] for k in groups}
    names = {parse_allocation(k[1])[0] for k in groups}
    missing = [m for m in ("wanda", "sparsegpt") if m not in methods]
    missing += [f"{a} allocation" for a in ALLOCATIONS if a not in names]
    # an N:M pattern fixes the sparsity at N/M: 2:4 belongs to the 0.5 section only
    missing += [f"{p} pattern" for p in ("2:4",) if p not in patterns and math.isclose(sparsity, 0.5)]
    seeds = sorted({seed for by_seed in groups.values() for seed in by_seed})
    grid = {k: s for k, s in groups.items() if k[1] in ALLOCATIONS}  # option variants are extra, not grid cells
    short = sorted(f"{p} {a} {m} ({len(s)})" for (p, a, m), s in grid.items() if len(s) < ISSUE_SEEDS)
    if short:
        missing.append(f"{ISSUE_SEEDS} seeds in " + ", ".join(short))
    uneven = any(set(s) != set(seeds) for s in grid.values())
    variants = sorted(f"{p} {a} {m} ({len(s)})" for (p, a, m), s in groups.items() if (p, a, m) not in grid)
    return (
        f"Scope: this model at sparsity {sparsity:g}, calibration seeds {seeds}"
        + (" (not every cell has all of them: see the tables)." if uneven else " in every cell.")
        + (" Not run here (shared 2-core CPU): " + ", ".join(missing) + "." if missing else "")
        + ("" if math.isclose(sparsity, 0.5) else " (2:4 fixes the sparsity at 0.5: it is in that section.)")
        + (" Option variants outside the grid (seeds): " + ", ".join(variants) + "." if variants else "")
    )


def findings(runs: dict, groups: dict, settings: dict) -> list[str]:
    """Plain statements computed from the runs: does PALS beat uniform, and what was not run."""
    out = [f"### Findings at sparsity {settings['sparsity']:g}", ""]
    for (pattern, allocation, method), by_seed in groups.items():
        uni = groups.get((pattern, "uniform", method), {})
        common = sorted(set(by_seed) & set(uni))
        if allocation == "uniform" or not common:
            continue
        per_seed = []
        worse = excluded = no_interval = 0
        for seed in common:
            key = config_key(None if pattern == "unstructured" else pattern, allocation, method, seed, settings)
            ukey = config_key(None if pattern == "unstructured" else pattern, "uniform", method, seed, settings)
            base, pruned = PerplexityResult.from_dict(runs[ukey]["ppl"]), PerplexityResult.from_dict(runs[key]["ppl"])
            d = delta_ppl_percent(base, pruned)
            lo, hi = delta_ppl_ci(base, pruned)
            per_seed.append(f"{d:+.2f}%")
            worse += d > 0
            if lo is None:
                no_interval += 1
            else:
                excluded += lo > 0 or hi < 0
        n = len(common)
        verdict = (
            f"worse than uniform on {'every' if n > 1 else 'the'} seed"
            if worse == n
            else f"better than uniform on {'every' if n > 1 else 'the'} seed"
            if worse == 0
            else f"worse on {worse} of {n} seeds"
        )
        out.append(
            f"- {pattern} {method}, **{allocation}** vs uniform: PPL change {', '.join(per_seed)} on calibration "
            f"seed(s) {common}; {verdict}; the paired window-bootstrap 95% interval excludes 0 on {excluded} of {n}"
            + (f" (no interval on {no_interval}: fewer than two windows score a token)" if no_interval else "") + "."
        )
    for method in sorted({k[2] for k in groups if k[0] == "unstructured" and k[1] == "pals"}):
        out += ["", pals_verdict(groups, method, settings["sparsity"])]
    for method in sorted({k[2] for k in groups if k[:2] == ("unstructured", "gradient")}):
        if ("unstructured", "random", method) in groups:
            out += ["", ablation_verdict(groups, method)]
    out += ["", scope_statement(groups, settings["sparsity"])]
    return out


def experiment_argvs(name: str, groups=None) -> list[list[str]]:
    """The ``sparsity.py`` argument lists of experiment ``name`` (``benchmarks/experiments/<name>.toml``):
    one per cell (model x target sparsity) of the chosen groups (default: all), in the file's order.

    Raises:
        ValueError: a group the experiment does not have (the message lists those it has).
    """
    experiment = load_experiment(name)
    cells = experiment_cells(experiment)
    unknown = [g for g in groups or [] if g not in cells]
    if unknown:
        raise ValueError(f"--groups {unknown}: experiment {name!r} has the groups {list(cells)}")
    return [["--model", cell["model"], "--sparsity", f"{cell['sparsity']:g}", *experiment.get("options", "").split(),
             *cell.get("options", "").split()] for group in groups or list(cells) for cell in cells[group]]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--allocations", nargs="+", default=["uniform", "pals", "owl", "random"])
    parser.add_argument("--methods", nargs="+", default=["wanda"])
    parser.add_argument("--patterns", nargs="+", default=["unstructured"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-words", type=int, default=None, help="override the contract's 5,000 words (smoke runs)")
    parser.add_argument("--json", default=None, help="result cache (default: results/sparsity-<model>.json)")
    parser.add_argument("--output", default=None, help="Markdown (default: results/sparsity-<model>.md)")
    parser.add_argument("--fresh", action="store_true", help="start --json over: its stored runs are discarded")
    parser.add_argument("--experiment", default=None,
                        help="run the cells of benchmarks/experiments/<name>.toml instead (each one sparsity.py run)")
    parser.add_argument("--groups", nargs="+", default=None, help="with --experiment: only these groups")
    add_runner_arguments(parser)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.experiment:
        for cell_argv in experiment_argvs(args.experiment, args.groups):
            print("[sparsity] python benchmarks/sparsity.py " + " ".join(cell_argv), flush=True)
            main(cell_argv)
        return
    args.json = args.json or str(RESULTS / f"sparsity-{args.model}.json")
    args.output = args.output or str(RESULTS / f"sparsity-{args.model}.md")
    if args.merge_from:  # caches filled on other machines: the first file's settings are kept
        merge_files(Path(args.json), args.merge_from, union=("commands",), first=("settings",),
                    volatile=("eval_s", "sparsify_s", "seconds"))
    if args.render_only:
        store = read_state(Path(args.json), "--render-only: results file")
        text = render(store, "", Path(args.json).name)
        write_text_atomic(text, args.output)
        write_index(Path(args.output).parent)
        print(text)
        return
    command = "python benchmarks/sparsity.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    run(args)

    def record_command(store):
        store["commands"] = merge_command(store.get("commands", []), command)

    store = open_store(Path(args.json)).update(record_command)
    text = render(store, command, Path(args.json).name)
    write_index(write_text_atomic(text, args.output).parent)
    print(text)


def merge_command(commands: list[str], command: str) -> list[str]:
    """``commands`` with ``command`` added; a command that differs from a recorded one only in
    its ``--seeds`` list extends that one's seeds instead of adding a line."""

    def split(text):
        words = shlex.split(text)
        if "--seeds" not in words:
            return words, None
        start = end = words.index("--seeds") + 1
        while end < len(words) and words[end].lstrip("-").isdigit():
            end += 1
        return words[: start - 1] + words[end:], [int(w) for w in words[start:end]]

    rest, seeds = split(command)
    for i, known in enumerate(commands):
        known_rest, known_seeds = split(known)
        if known == command:
            return commands
        if seeds is not None and known_seeds is not None and known_rest == rest:
            words = shlex.split(known)
            at = words.index("--seeds") + 1
            merged = [str(s) for s in sorted(set(known_seeds) | set(seeds))]
            words[at : at + len(known_seeds)] = merged
            return [*commands[:i], " ".join(shlex.quote(w) for w in words), *commands[i + 1 :]]
    return [*commands, command]


def write_index(results: Path) -> None:
    """``sparsity.md``: one line per model page (``sparsity-<model>.md``) with its verdict."""
    lines = ["# Sparsity benchmark: index", "",
             "One page per model, each with its commands, tables and findings "
             "(`python benchmarks/sparsity.py --model <name>` writes `sparsity-<name>.md`).", ""]
    for page in sorted(results.glob("sparsity-*.md")):
        text = page.read_text(encoding="utf-8")
        verdicts = [ln for ln in text.splitlines() if ln.startswith("The PALS paper's direction")]
        verdict = " ".join(verdicts) if verdicts else "no PALS run yet"
        lines.append(f"- [{page.stem.removeprefix('sparsity-')}]({page.name}): {verdict}")
    write_text_atomic("\n".join(lines) + "\n", results / "sparsity.md")


if __name__ == "__main__":
    main()
