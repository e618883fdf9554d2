"""The ``hf-layerswap demo`` verb: score a real model with both protocols, compare the
removals of each budget by held-out perplexity, and save the final cut (made by
:func:`hf_layerswap.pipeline.prune` on the same report and prompts) with its card."""

from __future__ import annotations

import copy
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..calibration import build_calibration
from ..config import LayerSwapConfig
from ..evaluation import delta_ppl_percent, evaluate_perplexity
from ..pipeline import prune
from ..plan import interchange_plan, num_blocks
from ..scoring import plan_kl, score_layers
from ..search import search_select
from ..selection import select_layers
from ..surgery import remove_layers
from .common import (
    HELP_FORMATTER,
    add_calibration_args,
    add_model_args,
    calibration_source,
    check_output,
    count,
    load,
    needs_tokenizer,
    prompt_count,
    save_pruned,
    positive_seconds,
)
from .score import format_scores_table

__all__ = ["DEFAULT_MODEL", "add_parser", "demo_config", "run_demo"]

DEFAULT_MODEL = "smollm2-135m"


def add_parser(subparsers):
    """Register the ``demo`` verb on ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    demo = subparsers.add_parser("demo", formatter_class=HELP_FORMATTER,
                                 help="score a real model with both protocols, compare removals, save a pruned copy")
    demo.add_argument("--model", default=DEFAULT_MODEL, help="model to load (a bundled name, checkpoint dir, GGUF file or Hub id)")
    add_model_args(demo, positional=False)
    add_calibration_args(demo, num_prompts_default="auto")
    demo.add_argument("--eval-text", default="embedded", help="held-out text file for perplexity, or 'embedded'")
    demo.add_argument("--eval-max-words", type=count(1), default=None, help="override the matched contract's 5,000 words")
    demo.add_argument("--budgets", type=count(1), nargs="+", default=[1, 2, 3], help="numbers of layers to compare")
    demo.add_argument("--final-layers", type=count(1), default=2, help="layers removed from the saved checkpoint")
    demo.add_argument("--final-protocol", default="auto", choices=["interchange", "replacement", "auto"],
                      help="with --final-strategy greedy: the protocol whose set is removed")
    demo.add_argument("--final-strategy", default="search", choices=["search", "greedy"],
                      help="search: the searched set (removal KL on the calibration prompts); greedy: --final-protocol's set")
    demo.add_argument("--max-evaluations", type=count(1), default=None,
                      help="most candidate sets the search scores (default 3 x blocks, to keep the demo short)")
    demo.add_argument("--output", default="layerswap-demo", help="where the pruned checkpoint and report go")
    demo.add_argument("--scoring-seconds", type=positive_seconds, default=240.0, help="time budget that --num-prompts auto fits")
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


def _auto_num_prompts(model, calibration, tokenizer, seq_len, batch_size, seconds, num_probes, seed) -> int:
    """Largest prompt count (multiple of batch_size, 8..64) whose scoring fits ``seconds``."""
    probe = build_calibration(calibration, tokenizer, num_prompts=batch_size, seq_len=seq_len, seed=seed)
    mid = num_blocks(model) // 2
    t0 = time.perf_counter()
    plan_kl(model, probe, {"p": interchange_plan(num_blocks(model), mid - 1, mid)}, batch_size=batch_size)
    per_batch_probe = (time.perf_counter() - t0) / 2  # reference + one probe, averaged
    batches = int(seconds / max(per_batch_probe * (num_probes + 1), 1e-9))
    return max(8, min(64, batches * batch_size))


def demo_config(args, num_layers: int, num_prompts: int):
    """The :class:`~hf_layerswap.LayerSwapConfig` of the demo's final cut: ``--final-layers``
    blocks by ``--final-strategy`` (greedy: ``--final-protocol``'s set, ``auto`` = the better
    of the two), on the demo's calibration budget. ``num_layers`` is the model's block count
    (the search's default evaluation budget is 3 per block)."""
    search = args.final_strategy == "search"
    strategy = "search" if search else ("auto" if args.final_protocol == "auto" else "greedy")
    return LayerSwapConfig(
        num_layers=args.final_layers, strategy=strategy, **({} if search else {"protocol": args.final_protocol}),
        max_evaluations=(args.max_evaluations or 3 * num_layers) if search else None,
        calibration=calibration_source(args.calibration), num_prompts=num_prompts, seq_len=args.seq_len,
        batch_size=args.batch_size, seed=args.seed, progress=True,
    )


def run_demo(args) -> int:
    """The ``demo`` verb (its transcript is in docs/cli.md)."""
    t_start = time.perf_counter()
    check_output(args.output)
    model, tokenizer = load(args)
    needs_tokenizer(tokenizer, args.model, f"--calibration {args.calibration}")
    num_layers = num_blocks(model)
    num_probes = 3 * (num_layers - 1)
    if args.num_prompts == "auto":
        n_prompts = _auto_num_prompts(
            model, args.calibration, tokenizer, args.seq_len, args.batch_size, args.scoring_seconds, num_probes, args.seed
        )
        how = f"chosen to fit about {args.scoring_seconds:.0f} s of scoring on this machine"
    else:
        n_prompts = prompt_count(args.num_prompts)
        how = "as requested"
    calib = build_calibration(args.calibration, tokenizer, num_prompts=n_prompts, seq_len=args.seq_len, seed=args.seed)
    print(
        f"calibration budget: {calib.num_prompts} prompts x up to {args.seq_len} tokens "
        f"({calib.num_tokens} real tokens), {num_probes} probes + 1 reference pass per batch ({how})\n"
        f"calibration source: {calib.description}",
        flush=True,
    )
    report = score_layers(model, calib, batch_size=args.batch_size, progress=True, seed=args.seed)
    print(f"\nper-layer swap-KL scores, s(i) = min over adjacent partners (nats; low = removable), "
          f"{model.config.num_hidden_layers} blocks, 0-based:\n")
    print(format_scores_table(report))
    gap = report.protocol_gap()["summary"]
    print(
        f"\nprotocol gap: mean I/R = {gap['mean_ratio']:.3f}, median {gap['median_ratio']:.3f}; "
        f"interchange <= replacement on {gap['fraction_interchange_le_replacement'] * 100:.0f}% of pairs"
    )

    eval_text = None if args.eval_text == "embedded" else args.eval_text
    selected: list[tuple[int, str, list[int] | None, str | None]] = []
    for n in args.budgets:
        for protocol in ("replacement", "interchange"):
            try:
                selected.append((n, protocol, select_layers(report, n, protocol=protocol), None))
            except ValueError as err:
                selected.append((n, protocol, None, str(err)))
    search_budgets = sorted(set(args.budgets))
    searched = search_select(report, search_budgets, model=model, calibration=calib, batch_size=args.batch_size,
                             max_evaluations=args.max_evaluations or 3 * num_layers, progress=True)
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
    to_evaluate = [()] + list(dict.fromkeys(tuple(layers) for _, _, layers, _ in selected if layers is not None))
    print(f"\nperplexity on held-out text ({args.eval_text}), matched contract: the base model and "
          f"{len(to_evaluate) - 1} distinct removal sets", flush=True)
    cache: dict[tuple, object] = {}
    for key in tqdm(to_evaluate, desc="perplexity evaluations", unit="model"):
        pruned = remove_layers(copy.deepcopy(model), list(key)) if key else model
        cache[key] = evaluate_perplexity(pruned, eval_text, tokenizer=tokenizer, max_words=args.eval_max_words)
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

    # the final cut: the one pipeline, on the report and prompts above (nothing is scored twice)
    result = prune(model, demo_config(args, num_layers, n_prompts), tokenizer=tokenizer, report=report,
                   calibration=calib)
    pruned, final = result.model, result.removed
    decision = (result.provenance.search or result.provenance.auto or {}) if result.provenance else {}
    reason = ("lowest joint removal KL on the calibration prompts of the candidate sets searched"
              if args.final_strategy == "search" else decision.get("reason", "as selected"))
    key = tuple(final)
    after = cache.get(key) or evaluate_perplexity(pruned, eval_text, tokenizer=tokenizer, max_words=args.eval_max_words)
    evaluation = {"base": base, "pruned": after}
    out = save_pruned(pruned, tokenizer, report, Path(args.output), evaluation=evaluation)
    print(
        f"\nfinal: removed {final} ({_final_how(args)}: {reason}); "
        f"PPL {base.ppl:.3f} -> {after.ppl:.3f} ({delta_ppl_percent(base.ppl, after.ppl):+.1f}%)\n"
        f"pruned checkpoint, model card (README.md), layerswap_report.json and plots written to {out}/ "
        f"(loads in plain transformers: AutoModelForCausalLM.from_pretrained('{out}'))\n"
        f"total time {time.perf_counter() - t_start:.0f} s"
    )
    return 0


def _kl_text(value) -> str:
    return "(KL -)" if value is None else f"(KL {value:.4f})"


def _final_how(args) -> str:
    return "strategy search" if args.final_strategy == "search" else f"protocol {args.final_protocol}"
