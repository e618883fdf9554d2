"""The ``hf-layerswap demo`` verb: score a real model with both protocols, compare the
removals of each budget by held-out perplexity, and save the final cut (made by
:func:`hf_layerswap.pipeline.prune` on the same report and prompts) with its card.

Before any work it prints how long it plans to take: the work (block and head passes of
the scoring, the search's candidate sets, the perplexity windows) counted in forward-pass
tokens, times the seconds per token of one measured forward pass of the calibration prompts
on this machine."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..calibration import build_calibration, check_positions
from ..config import LayerSwapConfig
from ..cost import estimate_cost, measure_throughput
from ..cost.estimate import forwards_phase
from ..cost.steps import ModelShape
from ..utils.devices import input_device
from ..evaluation import CONTRACTS, delta_ppl_percent, evaluate_perplexity, prepare_text, sliding_windows
from ..evaluation.contract import PerplexityResult, read_source, tokenize_text
from ..evaluation.perplexity import window_batches
from ..pipeline import prune
from ..layerplan import num_blocks
from ..scoring import score_layers
from ..selection import search_select
from ..selection.objectives import SetObjective
from ..selection import select_layers
from ..selection.registry import strategies_taking, strategy_entry
from ..selection.search import search_allowances
from ..surgery.removal import remove_layers
from .options import (
    HELP_FORMATTER,
    add_calibration_args,
    add_model_args,
    calibration_source,
    check_before_loading,
    count,
    load,
    needs_tokenizer,
    prompt_count,
    save_pruned,
    positive_seconds,
)
from .score import format_scores_table

__all__ = ["DEFAULT_MODEL", "DEMO_EVAL_BATCH", "DEMO_EVAL_WORDS", "DEMO_PROMPTS", "DEMO_TIME_BUDGET", "eval_forwards",
           "plan_demo", "search_allowance", "add_parser", "demo_config", "run_demo"]

DEFAULT_MODEL = "smollm2-135m"
#: Words of held-out text the demo's perplexities read (the matched contract's window and
#: stride on the first 1,000 words instead of 5,000: each evaluation costs a fifth).
DEMO_EVAL_WORDS = 1000
#: Windows per forward pass of the demo's perplexities (``evaluate_perplexity``'s ``batch_size``).
DEMO_EVAL_BATCH = 2
#: Wall seconds of planned work that ``--num-prompts auto`` fits by default (the scoring,
#: the searches and the perplexities, at this machine's measured rates).
DEMO_TIME_BUDGET = 300.0
#: The calibration prompts ``--num-prompts auto`` chooses between (whole batches).
DEMO_PROMPTS = (8, 64)


def add_parser(subparsers):
    """Register the ``demo`` verb on ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    demo = subparsers.add_parser("demo", formatter_class=HELP_FORMATTER,
                                 help="score a real model with both protocols, compare removals, save a pruned copy")
    demo.add_argument("--model", default=DEFAULT_MODEL, help="model to load (a bundled name, checkpoint dir, GGUF file or Hub id)")
    add_model_args(demo, positional=False)
    add_calibration_args(demo, num_prompts_default="auto")
    demo.add_argument("--eval-text", default="embedded", help="held-out text file for perplexity, or 'embedded'")
    demo.add_argument("--eval-max-words", type=count(1), default=DEMO_EVAL_WORDS,
                      help="words of held-out text (the matched contract reads 5,000; the demo's default keeps it short)")
    demo.add_argument("--budgets", type=count(1), nargs="+", default=[1, 2, 3], help="numbers of layers to compare")
    demo.add_argument("--final-num-to-remove", type=count(1), default=2, help="layers removed from the saved checkpoint")
    demo.add_argument("--final-protocol", default="auto", choices=["interchange", "replacement", "auto"],
                      help="with --final-strategy greedy: the protocol whose set is removed")
    demo.add_argument("--final-strategy", default="search", choices=["search", "greedy"],
                      help="search: the searched set (removal KL on the calibration prompts); greedy: --final-protocol's set")
    demo.add_argument("--max-evaluations", type=count(1), default=None,
                      help="most candidate sets the search scores in all (default: the single-removal sweep, then "
                           "a third of the removable blocks per further budget, to keep the demo short)")
    demo.add_argument("--output", default="layerswap-demo", help="where the pruned checkpoint and report go")
    demo.add_argument("--time-budget", type=positive_seconds, default=DEMO_TIME_BUDGET, metavar="SECONDS",
                      help="wall seconds of planned work (scoring, searches, perplexities, at this machine's measured "
                           "rates and thread count) that --num-prompts auto fits")
    demo.set_defaults(func=run_demo)
    return demo


def _contract_summary(contract: dict) -> str:
    """One line naming the evaluation contract a perplexity was measured under (no local paths)."""
    bos = contract.get("bos") or {}
    boot = contract.get("bootstrap") or {}
    words = f"first {contract['max_words']} words of " if contract.get("max_words") else ""
    return (
        f"{contract.get('name')}: {words}{contract.get('source')} (text sha256 {str(contract.get('text_sha256'))[:12]}), "
        f"window {contract.get('window')}, stride {contract.get('stride')}, {contract.get('scored_tokens')} scored tokens "
        f"in {contract.get('windows')} windows, BOS {'added' if bos.get('add_bos') else 'not added'} "
        f"({bos.get('bos_choice')}), {contract.get('dtype')}; 95% CI: "
        + (f"bootstrap over windows ({boot.get('resamples')} resamples, seed {boot.get('seed')})"
           if (contract.get("windows") or 0) >= 2 else "none (a bootstrap over windows needs 2)")
    )


def plan_demo(model, args, calib, num_prompts: int, throughput, search_budgets: list[int], per_budget: int,
          final_sets: int, forwards, evaluations: int):
    """The demo's estimate on ``calib``'s first ``num_prompts`` prompts (``args`` gives the
    rest): ``({"scoring", "search", "perplexity"}: seconds, the final cut's
    :class:`~hf_layerswap.cost.CostEstimate`)``, every part priced at ``throughput`` (the
    rates :func:`~hf_layerswap.cost.measure_throughput` measured on this machine, at the
    threads this run uses). The scoring is the final cut's own (the same prompts and
    probes, :func:`~hf_layerswap.estimate_cost`); the search is the comparison's (budgets up
    to the largest, ``per_budget`` sets each) plus the final cut's (at most ``final_sets``; 0
    when it takes the comparison's values);
    the perplexity is ``evaluations`` evaluations of the dense model's ``forwards``."""
    total = num_blocks(model)
    device = input_device(model)
    calib = calib.prefix(num_prompts, "the demo's estimate")
    cut = estimate_cost(model, demo_config(args, total, num_prompts, final_sets or None), calibration=calib,
                        device=device, throughput=throughput)
    search = cut.phases["selection"]["seconds"] if final_sets else 0.0
    compare = LayerSwapConfig(num_to_remove=search_budgets[-1], strategy="search", num_prompts=num_prompts,
                              seq_len=args.seq_len, batch_size=args.batch_size, max_evaluations=args.max_evaluations,
                              strategy_options={"evaluations_per_budget": per_budget})
    search += estimate_cost(model, compare, calibration=calib, device=device,
                            throughput=throughput).phases["selection"]["seconds"]
    ppl = throughput.seconds(forwards_phase(ModelShape(model), forwards, total))
    return {"scoring": cut.phases["scoring"]["seconds"], "search": search, "perplexity": evaluations * ppl}, cut


def _fit_prompts(most, batch_size: int, seconds: float, plan) -> int:
    """The most calibration prompts, in whole batches of ``batch_size`` within
    :data:`DEMO_PROMPTS` (at most ``most.num_prompts``), whose planned work ``plan(most,
    prompts)`` (the first ``prompts`` of ``most``) estimates at ``seconds`` or less; the fewest
    when none fits."""
    low, high = DEMO_PROMPTS[0], min(DEMO_PROMPTS[1], most.num_prompts)
    options = [n for n in range(batch_size, high + 1, batch_size) if n >= low] or [min(low, most.num_prompts)]
    def fits(prompts: int) -> bool:
        return sum(plan(most, prompts)[0].values()) <= seconds

    lo, hi = 0, len(options) - 1  # the work grows with the prompts: the last option that fits
    if not fits(options[0]):
        return options[0]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(options[mid]) else (lo, mid - 1)
    return options[lo]


def search_allowance(num_blocks: int, protect: int = 2) -> int:
    """The demo's search allowance per budget n >= 2: a third of the removable blocks."""
    return max(1, (num_blocks - protect) // 3)


def _search_sets(num_blocks: int, top: int, allowance: int | None, max_evaluations: int | None) -> int:
    """Most sets a search up to budget ``top`` scores: the single-removal sweep, then per
    further budget its ``allowance`` (``None``: the search's default, SLEB's schedule), each
    protocol's own greedy set inside it; at most ``max_evaluations`` in all."""
    sets = sum(search_allowances(num_blocks - 2, top, allowance))
    return sets if max_evaluations is None else min(sets, max_evaluations)


def eval_forwards(model, eval_text, tokenizer, max_words) -> tuple[list[tuple[int, int, int]], int]:
    """The forwards of one perplexity under the matched contract, as
    :func:`~hf_layerswap.evaluate_perplexity` batches its windows (``(windows, length,
    kept logits)`` each), and the scored tokens; a window the model has no positions for is
    refused here, before any work."""
    spec = CONTRACTS["matched"]
    check_positions(model, spec["window"], f"the matched contract's window={spec['window']}", "use another model or lower window")
    raw, _ = read_source(eval_text)
    ids, _ = tokenize_text(tokenizer, prepare_text(raw, max_words)[0], None)
    spans = sliding_windows(len(ids), spec["window"], spec["stride"])
    forwards = [(len(members), length, keep) for length, keep, members in window_batches(spans, DEMO_EVAL_BATCH)]
    return forwards, sum(end - score_from for _, end, score_from in spans)


def demo_config(args, num_blocks: int, num_prompts: int, max_evaluations: int | None = None,
                evaluations_per_budget: int | None = None):
    """The :class:`~hf_layerswap.LayerSwapConfig` of the demo's final cut: ``--final-num-to-remove``
    blocks by ``--final-strategy`` (greedy: ``--final-protocol``'s set, ``auto`` = the better
    of the two), on the demo's calibration budget. ``num_blocks`` is the model's block count;
    ``max_evaluations`` caps the search (default ``--max-evaluations``, else 3 per block) and
    ``evaluations_per_budget`` (the comparison search's, where the final budget is one of its
    budgets) gives it that search's schedule, so that it scores the same sets."""
    entry = strategy_entry(args.final_strategy)
    protocol = {"protocol": args.final_protocol} if entry.reads(args.final_protocol) else {}  # a rule on its scores
    searches = _searches(args)
    schedule = ({"evaluations_per_budget": evaluations_per_budget}
                if searches and evaluations_per_budget is not None else None)
    return LayerSwapConfig(
        num_to_remove=args.final_num_to_remove, strategy=entry.strategy_for(args.final_protocol), **protocol,
        strategy_options=schedule,
        max_evaluations=(max_evaluations or args.max_evaluations or 3 * num_blocks) if searches else None,
        calibration=calibration_source(args.calibration), num_prompts=num_prompts, seq_len=args.seq_len,
        batch_size=args.batch_size, seed=args.seed, progress=True,
    )


def _check_budgets(args, total: int) -> None:
    """Refuse a ``--budgets`` or ``--final-num-to-remove`` above the ``total - 2`` blocks a
    cut may remove (the first and last are protected), and a ``--max-evaluations`` below
    them (the search's single-removal sweep), naming the option and the limit."""
    removable = total - 2
    blocks = f"for this model (its {total} blocks less the first and last, which are never removed)"
    for option, values in (("--budgets", args.budgets), ("--final-num-to-remove", [args.final_num_to_remove])):
        above = [n for n in values if n > removable]
        if above:
            raise ValueError(f"{option} {above[0]}: at most {removable} {blocks}")
    if args.max_evaluations is not None and args.max_evaluations < removable:
        raise ValueError(f"--max-evaluations {args.max_evaluations}: at least {removable}, one set per removable "
                         f"block {blocks}")


def _searches(args) -> bool:
    """Whether ``--final-strategy`` scores candidate sets (it takes ``max_evaluations``, which
    the demo caps and counts in its time estimate)."""
    return args.final_strategy in strategies_taking("max_evaluations")


def _prompts_note(args, planned: float) -> str:
    """Why the demo takes its calibration prompts: as ``--num-prompts`` asks, chosen to fit
    ``--time-budget``, or the fewest ``auto`` takes when even their ``planned`` seconds of
    work are above it (so the budget line never contradicts the estimate below it)."""
    if args.num_prompts != "auto":
        return "as requested"
    if planned <= args.time_budget:
        return f"chosen to fit about {_minutes(args.time_budget)} of planned work on this machine"
    return (f"the fewest --num-prompts auto takes: their planned work, about {_minutes(planned)}, is above the "
            f"--time-budget of {_minutes(args.time_budget)} on this machine")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def run_demo(args) -> int:
    """The ``demo`` verb (its transcript is in docs/cli.md)."""
    t_start, cpu_start = time.perf_counter(), time.process_time()
    check_before_loading(args, outputs=[("--output", args.output, "new folder")])
    model, tokenizer = load(args)
    needs_tokenizer(tokenizer, args.model, f"--calibration {args.calibration}")
    total = num_blocks(model)
    _check_budgets(args, total)
    num_probes = 3 * (total - 1)
    eval_text = None if args.eval_text == "embedded" else args.eval_text
    search_budgets = sorted(set(args.budgets))
    per_budget = search_allowance(total)
    forwards, scored_tokens = eval_forwards(model, eval_text, tokenizer, args.eval_max_words)
    window_tokens = sum(w * length for w, length, _ in forwards)
    evaluations = 1 + 3 * len(search_budgets)  # at most: the base model and every distinct set
    search_sets = _search_sets(total, search_budgets[-1], per_budget, args.max_evaluations)
    reused = _searches(args) and args.final_num_to_remove in search_budgets
    if not _searches(args):
        final_sets = 0
    elif reused:  # the same candidates as the search above, up to that budget: their values are reused
        final_sets = _search_sets(total, args.final_num_to_remove, per_budget, args.max_evaluations)
    else:
        final_sets = _search_sets(total, args.final_num_to_remove, None, args.max_evaluations or 3 * total)
    throughput = measure_throughput(model, args.batch_size, args.seq_len, device=input_device(model))

    def plan(calibration, prompts: int):
        return plan_demo(model, args, calibration, prompts, throughput, search_budgets, per_budget,
                     0 if reused else final_sets, forwards, evaluations)

    if args.num_prompts == "auto":
        most = build_calibration(args.calibration, tokenizer, num_prompts=DEMO_PROMPTS[1], seq_len=args.seq_len,
                                 seed=args.seed)
        n_prompts = _fit_prompts(most, args.batch_size, args.time_budget, plan)
    else:
        n_prompts = prompt_count(args.num_prompts)
    calib = build_calibration(args.calibration, tokenizer, num_prompts=n_prompts, seq_len=args.seq_len, seed=args.seed)
    estimate, cut = plan(calib, calib.num_prompts)
    how = _prompts_note(args, sum(estimate.values()))
    print(
        f"calibration budget: {calib.num_prompts} prompts x up to {args.seq_len} tokens "
        f"({calib.num_tokens} real tokens), {num_probes} probes + 1 reference pass per batch ({how})\n"
        f"calibration source: {calib.description}\n"
        f"planned work: scoring {num_probes} probes; the search at most {search_sets} candidate sets"
        + (f"; the final cut's search takes the values of its {final_sets} from it (no pass)" if reused
           else f" and the final cut's search at most {final_sets} more" if final_sets else "")
        + f"; at most {evaluations} perplexity evaluations of {scored_tokens} tokens ({window_tokens} through the model)\n"
        f"estimated time: about {_minutes(sum(estimate.values()))} (scoring {_minutes(estimate['scoring'])}, search "
        f"{_minutes(estimate['search'])}, perplexity {_minutes(estimate['perplexity'])}), at this machine's rates "
        f"({throughput.source})",
        flush=True,
    )
    print("for reference, not run by this demo: the final cut as a prune from scratch (hl.estimate_cost):\n" + "\n".join(cut.lines()), flush=True)
    t_work = time.perf_counter()
    report = score_layers(model, calib, batch_size=args.batch_size, progress=True, seed=args.seed)
    print(f"\nper-layer swap-KL scores, s(i) = min over adjacent partners (nats; low = removable), "
          f"{model.config.num_hidden_layers} blocks, 0-based:\n")
    print(format_scores_table(report))
    gap = report.protocol_gap()["summary"]
    print(
        f"\nprotocol gap: mean I/R = {gap['mean_ratio']:.3f}, median {gap['median_ratio']:.3f}; "
        f"interchange <= replacement on {gap['fraction_interchange_le_replacement'] * 100:.0f}% of pairs"
    )

    selected: list[tuple[int, str, list[int] | None, str | None]] = []
    for n in args.budgets:
        for protocol in ("replacement", "interchange"):
            try:
                selected.append((n, protocol, select_layers(report, n, protocol=protocol), None))
            except ValueError as err:
                selected.append((n, protocol, None, str(err)))
    bar = tqdm(total=search_sets, desc="removal-set search (removal_kl)", unit="set", dynamic_ncols=True)
    values = SetObjective(model, calib, batch_size=args.batch_size, progress=bar)
    searched = search_select(report, search_budgets, model=model, calibration=calib, batch_size=args.batch_size,
                             max_evaluations=args.max_evaluations, evaluations_per_budget=per_budget,
                             evaluator=values)
    bar.close()
    if reused:  # measured on these prompts: the final cut's search takes them from the report
        report.removal_kl.update(values.cache)
    for n in args.budgets:
        selected.append((n, "search", searched[n]["selected"], None))
    cost = searched[search_budgets[-1]]["total_cost"]
    print(f"\nsearch (removal KL on the calibration prompts, budgets {search_budgets} in one call): "
          f"{cost['evaluator_calls']} candidate sets, {cost['forward_passes']} forward passes, {cost['seconds']:.0f} s")
    for n in args.budgets:
        rec = searched[n]
        others = "; ".join(f"{p} greedy {e['set']} {_kl_text(e['value'])}" for p, e in rec["protocol_sets"].items()
                           if e is not None)
        print(f"  n = {n}: search {rec['selected']} {_kl_text(rec['value'])}; {others}")
    cache = _perplexity_table(model, selected, args, eval_text, tokenizer)
    base = cache[()]

    # the final cut: the one pipeline, on the report and prompts above (nothing is scored twice). Where the
    # final budget was searched above, its search gets that search's schedule and the evaluations it spent up
    # to that budget: the same candidates in the same order, so the same set, every value taken from the report.
    spent = searched[args.final_num_to_remove]["cost"]["evaluator_calls"] if args.final_num_to_remove in searched else None
    result = prune(model, demo_config(args, total, n_prompts, spent, per_budget if reused else None), tokenizer=tokenizer,
                   report=report, calibration=calib)
    pruned, final = result.model, result.removed
    decision = (result.provenance.decision or {}) if result.provenance else {}
    reason = ("lowest joint removal KL on the calibration prompts of the candidate sets searched"
              if _searches(args) else decision.get("reason", "as selected"))
    key = tuple(final)
    after = cache.get(key) or evaluate_perplexity(pruned, eval_text, tokenizer=tokenizer, max_words=args.eval_max_words,
                                                        batch_size=DEMO_EVAL_BATCH)
    evaluation = {"base": base, "pruned": after}
    out = save_pruned(pruned, tokenizer, report, Path(args.output), evaluation=evaluation)
    print(
        f"\nfinal: removed {final} ({_final_how(args, decision)}: {reason}); "
        f"PPL {base.ppl:.3f} -> {after.ppl:.3f} ({delta_ppl_percent(base.ppl, after.ppl):+.1f}%)\n"
        f"pruned checkpoint, model card (README.md), layerswap_report.json and plots written to {out}/ "
        f"(loads in plain transformers: AutoModelForCausalLM.from_pretrained('{out}'))\n"
        f"total time {time.perf_counter() - t_start:.0f} s wall, {time.process_time() - cpu_start:.0f} CPU-seconds at "
        f"{torch.get_num_threads()} thread(s); the planned work {time.perf_counter() - t_work:.0f} s "
        f"(estimated {sum(estimate.values()):.0f} s before it started)"
    )
    return 0


def _perplexity_table(model, selected, args, eval_text, tokenizer) -> dict[tuple, PerplexityResult]:
    """Evaluate the base model and every distinct selected set on the held-out text and
    print the table; returns the results keyed by removed set (``()`` = the base model)."""
    to_evaluate = [()] + list(dict.fromkeys(tuple(layers) for _, _, layers, _ in selected if layers is not None))
    print(f"\nperplexity on held-out text ({args.eval_text}), matched contract on the first {args.eval_max_words} "
          f"words: the base model and {len(to_evaluate) - 1} distinct removal sets", flush=True)
    cache: dict[tuple, PerplexityResult] = {}
    for key in tqdm(to_evaluate, desc="perplexity evaluations", unit="model"):
        pruned = remove_layers(copy.deepcopy(model), list(key)) if key else model
        cache[key] = evaluate_perplexity(pruned, eval_text, tokenizer=tokenizer, max_words=args.eval_max_words,
                                         batch_size=DEMO_EVAL_BATCH)
        del pruned
    base = cache[()]
    rows = [(n, protocol, layers, None if layers is None else cache[tuple(layers)], err)
            for n, protocol, layers, err in selected]
    print("\n| n | protocol | removed (0-based) | PPL | 95% CI | dPPL% |\n|---:|---|---|---:|---|---:|")
    print(f"| 0 | (base) | - | {base.ppl:.3f} | {base.ci_text()} | 0.0 |")
    for n, protocol, layers, res, err in rows:
        if res is None:
            print(f"| {n} | {protocol} | ({err}) | - | - | - |")
        else:
            print(
                f"| {n} | {protocol} | {layers} | {res.ppl:.3f} | {res.ci_text()} | "
                f"{delta_ppl_percent(base.ppl, res.ppl):+.1f} |"
            )
    print(f"\ncontract: {_contract_summary(base.contract)}")
    return cache


def _kl_text(value) -> str:
    return "(KL -)" if value is None else f"(KL {value:.4f})"


def _final_how(args, decision) -> str:
    """The final cut's rule: the protocol that guided it (its strategy entry's ``guided_by``),
    else the strategy."""
    guide = strategy_entry(args.final_strategy).guided_by(decision, args.final_protocol)
    return f"protocol {guide}" if guide else f"strategy {args.final_strategy}"
