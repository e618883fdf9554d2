"""``hf-layerswap`` command line: ``demo``, ``score``, ``prune``, ``push``, ``peel``, ``eval`` and ``export-gguf``
(``--help`` of each verb shows its defaults).

Every verb takes the same options as the Python API (0-based layer indices everywhere).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from .calibration import build_calibration, read_text_file
from .cli_eval import add_eval_arguments, run_eval
from .cli_peel import add_peel_arguments, run_peel
from .config import LayerSwapConfig
from .evaluation import delta_ppl_percent, evaluate_perplexity
from .gguf_export import add_export_gguf_arguments, run_export_gguf
from .hub import add_push_arguments, run_push, save_for_hub
from .models import load_model
from .pipeline import prune
from .plan import interchange_plan, num_blocks
from .report import SwapReport
from .scoring import plan_kl, score_layers
from .search import search_select
from .selection import STRATEGIES, select_layers
from .surgery import remove_layers

__all__ = ["build_parser", "main"]

DEFAULT_MODEL = "smollm2-135m"


def _count(minimum: int):
    """argparse ``type=``: an int >= ``minimum`` (a bad value exits 2 with an ``error:`` line)."""

    def parse(text):
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not an int; expected an int >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an int >= {minimum}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def _count_or_auto(text):
    """argparse ``type=`` of the demo's --num-prompts: ``auto`` or an int >= 1."""
    return text if text == "auto" else _count(1)(text)


def _fraction(text):
    """argparse ``type=``: a float in [0, 1)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected a float in [0, 1)") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a float in [0, 1)")
    return value


def _seconds(text):
    """argparse ``type=``: a positive number of seconds."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected seconds > 0") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds > 0")
    return value


def _add_model_args(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    if positional:
        p.add_argument("model", help="local checkpoint dir, GGUF file, Hub id, or a bundled name (smollm2-135m, gemma3-270m)")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside MODEL (dequantized on load)")
    p.add_argument("--revision", default=None, help="Hub revision")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or Hub id, for a checkpoint that has none (default: the model's own)")


def _add_calibration_args(p: argparse.ArgumentParser, *, num_prompts_default="64") -> None:
    p.add_argument(
        "--calibration", default="embedded",
        help="calibration text: a text file (e.g. WikiText-2 valid.txt) or 'embedded' (prose shipped with Python)",
    )
    auto = num_prompts_default == "auto"
    p.add_argument(
        "--num-prompts", default=num_prompts_default, type=_count_or_auto if auto else _count(1),
        help="calibration prompts: an int >= 1" + (", or 'auto' to fit --scoring-seconds" if auto else ""),
    )
    p.add_argument("--seq-len", type=_count(2), default=128, help="tokens per prompt (truncation)")
    p.add_argument("--batch-size", type=_count(1), default=8, help="prompts per forward pass")
    p.add_argument("--seed", type=int, default=0, help="paragraph shuffle seed")


def _add_scoring_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--protocols", nargs="+", default=["replacement", "interchange"], choices=["replacement", "interchange"])
    p.add_argument("--max-gap", type=_count(1), default=1, help="pair distance bound: 1 = adjacent pairs")


def _add_selection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default="search", choices=sorted(STRATEGIES),
                   help="how the set is chosen: search = candidate sets from both protocols scored on the calibration "
                        "prompts and refined by local moves; greedy = the paper's rule on --protocol; auto = the better "
                        "protocol's greedy set")
    p.add_argument("--objective", default=None, choices=["removal_kl", "nll", "ghosted"],
                   help="what --strategy search minimises on the calibration prompts (default removal_kl)")
    p.add_argument("--max-evaluations", type=_count(1), default=None,
                   help="most candidate sets search scores (default 5 x blocks)")
    p.add_argument("--protocol", default="interchange", choices=["interchange", "replacement", "auto"],
                   help="protocol of --strategy greedy")
    p.add_argument("--spacing", type=_count(0), default=None,
                   help="selected layers stay more than this apart (default: 1 for greedy/auto, 0 for search)")
    p.add_argument("--protect", type=int, nargs="*", default=None,
                   help="layers never removed (negative = from the end; default 0 -1 for a scored selection, "
                        "none for --layers)")


def _add_repair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recovery", default=None, choices=["ghosted", "fused"],
                   help="repair the cut: ghosted (Ghosted Layers operators) or fused (folded into down_proj)")
    p.add_argument("--sparsity", type=_fraction, default=None,
                   help="one-shot sparsity target in [0, 1) after removal (default: none)")
    p.add_argument("--allocation", default="pals", choices=["uniform", "pals", "owl", "random", "gradient"],
                   help="per-block sparsity rule of --sparsity")
    p.add_argument("--sparsity-method", default="wanda", choices=["wanda", "sparsegpt", "magnitude"],
                   help="pruner of --sparsity")
    p.add_argument("--sparsity-pattern", default=None, help="N:M pattern of --sparsity, e.g. 2:4 (default unstructured)")


_HELP = argparse.ArgumentDefaultsHelpFormatter


def build_parser(prog: str = "hf-layerswap") -> argparse.ArgumentParser:
    """The ``hf-layerswap`` argument parser (shared with ``optimum-cli layerswap``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Swap-KL layer redundancy (replacement vs interchange), layer removal and publishing.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", formatter_class=_HELP, help="score a real model with both protocols, compare removals, save a pruned copy")
    demo.add_argument("--model", default=DEFAULT_MODEL, help="model to load (a bundled name, checkpoint dir, GGUF file or Hub id)")
    _add_model_args(demo, positional=False)
    _add_calibration_args(demo, num_prompts_default="auto")
    demo.add_argument("--eval-text", default="embedded", help="held-out text file for perplexity, or 'embedded'")
    demo.add_argument("--eval-max-words", type=_count(1), default=None, help="override the matched contract's 5,000 words")
    demo.add_argument("--budgets", type=_count(1), nargs="+", default=[1, 2, 3], help="numbers of layers to compare")
    demo.add_argument("--final-layers", type=_count(1), default=2, help="layers removed from the saved checkpoint")
    demo.add_argument("--final-protocol", default="auto", choices=["interchange", "replacement", "auto"],
                      help="with --final-strategy greedy: the protocol whose set is removed")
    demo.add_argument("--final-strategy", default="search", choices=["search", "greedy"],
                      help="search: the searched set (removal KL on the calibration prompts); greedy: --final-protocol's set")
    demo.add_argument("--max-evaluations", type=_count(1), default=None,
                      help="most candidate sets the search scores (default 3 x blocks, to keep the demo short)")
    demo.add_argument("--output", default="layerswap-demo", help="where the pruned checkpoint and report go")
    demo.add_argument("--scoring-seconds", type=_seconds, default=240.0, help="time budget that --num-prompts auto fits")
    demo.set_defaults(func=run_demo)

    score = sub.add_parser("score", formatter_class=_HELP, help="score block pairs and write the SwapReport JSON")
    _add_model_args(score)
    _add_calibration_args(score)
    _add_scoring_args(score)
    score.add_argument("--output", "-o", default="layerswap_report.json", help="report JSON path")
    score.set_defaults(func=run_score)

    prune = sub.add_parser("prune", formatter_class=_HELP, help="remove layers (scored or explicit) and save a plain transformers checkpoint")
    _add_model_args(prune)
    prune.add_argument("output", help="directory for the pruned checkpoint (must not exist)")
    group = prune.add_mutually_exclusive_group(required=True)
    group.add_argument("--num-layers", type=_count(1), help="remove this many layers chosen by swap-KL")
    group.add_argument("--layers", type=int, nargs="+", help="remove exactly these 0-based layers")
    prune.add_argument("--report", default=None, help="reuse an existing report JSON instead of scoring")
    _add_calibration_args(prune)
    prune.add_argument("--protocols", nargs="+", default=None, choices=["replacement", "interchange"],
                       help="deprecated and ignored: the protocols scored follow --strategy and --protocol")
    prune.add_argument("--max-gap", type=_count(1), default=1, help="pair distance bound: 1 = adjacent pairs")
    _add_selection_args(prune)
    _add_repair_args(prune)
    prune.set_defaults(func=run_prune)

    push = sub.add_parser("push", formatter_class=_HELP, help="upload a pruned checkpoint with its card to the Hub")
    add_push_arguments(push)
    push.set_defaults(func=run_push)
    peel = sub.add_parser("peel", formatter_class=_HELP, help="per-layer peeling reference bounds (linear reference vs the trained blocks)")
    add_peel_arguments(peel)
    peel.set_defaults(func=run_peel)
    evaluate = sub.add_parser("eval", formatter_class=_HELP, help="perplexity and/or lm-eval tasks of a checkpoint, as JSON")
    add_eval_arguments(evaluate).set_defaults(func=run_eval)
    export = sub.add_parser("export-gguf", formatter_class=_HELP, help="convert a checkpoint to GGUF (llama.cpp), layout kept")
    add_export_gguf_arguments(export).set_defaults(func=run_export_gguf)
    return parser


def _num_prompts(value) -> int:
    """--num-prompts as an int (argparse has checked it; a direct caller gets ValueError)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--num-prompts {value!r}: expected an int >= 1") from None
    if n < 1:
        raise ValueError(f"--num-prompts {value!r}: expected an int >= 1")
    return n


def _check_text_files(args) -> None:
    """Refuse a --calibration or --eval-text that is missing or not UTF-8 text before the model loads."""
    for flag in ("calibration", "eval_text"):
        value = getattr(args, flag, "embedded")
        if value != "embedded":
            option = "--" + flag.replace("_", "-")
            if not Path(value).is_file():
                raise FileNotFoundError(f"{option} {value!r} is not a file; give a text file or 'embedded'")
            read_text_file(value, option)


def _load(args):
    _check_text_files(args)

    name = getattr(args, "model", None)
    print(f"loading {name} ...", file=sys.stderr, flush=True)
    return load_model(name, gguf_file=args.gguf_file, revision=args.revision, tokenizer=getattr(args, "tokenizer", None))


def _calibration_source(value: str):
    """--calibration as a config value: ``embedded`` is the default source (``None``)."""
    return None if value == "embedded" else value


def _needs_tokenizer(tokenizer, model_name, what: str) -> None:
    if tokenizer is None:
        raise ValueError(f"{what} needs a tokenizer and the checkpoint {model_name!r} has none: "
                         "pass --tokenizer with a tokenizer folder or Hub id")


def _check_output(output) -> None:
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"output {output} exists and is not an empty folder; choose another or remove it")


def _contract_summary(contract: dict) -> str:
    """One line naming the evaluation contract a perplexity was measured under (no local paths)."""
    bos = contract.get("bos") or {}
    boot = contract.get("bootstrap") or {}
    words = f"first {contract['max_words']} words of " if contract.get("max_words") else ""
    return (
        f"{contract.get('name')}: {words}{contract.get('source')} (text sha256 {str(contract.get('text_sha256'))[:12]}), "
        f"window {contract.get('window')}, stride {contract.get('stride')}, {contract.get('scored_tokens')} scored tokens "
        f"in {contract.get('windows')} windows, BOS {'added' if bos.get('add_bos') else 'not added'} "
        f"({bos.get('bos_choice')}), {contract.get('dtype')}; 95% CI: bootstrap over windows "
        f"({boot.get('resamples')} resamples, seed {boot.get('seed')})"
    )


def _save_pruned(model, tokenizer, report, output: Path, evaluation: dict | None = None) -> Path:
    """The checkpoint, tokenizer, card, report sidecar and plots, written atomically."""
    _check_output(output)
    return save_for_hub(model, output, tokenizer=tokenizer, report=report, evaluation=evaluation)


def run_score(args) -> int:
    if Path(args.output).is_dir():  # found out before loading and scoring, not after
        example = Path(args.output) / "layerswap_report.json"
        raise FileExistsError(f"--output {args.output} is a folder; give the report's file path, e.g. {example}")
    model, tokenizer = _load(args)
    _needs_tokenizer(tokenizer, args.model, f"--calibration {args.calibration}")
    report = score_layers(
        model, args.calibration, tokenizer=tokenizer, protocols=args.protocols, max_gap=args.max_gap,
        num_prompts=_num_prompts(args.num_prompts), seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
    )
    path = report.to_json(args.output)
    print(format_scores_table(report))
    print(f"report written to {path}")
    return 0


def prune_config(args):
    """The :class:`~hf_layerswap.LayerSwapConfig` of the prune verb's flags (checked here,
    before any model loads).

    Raises:
        ValueError: a bad or contradictory flag value (the message names it).
    """
    if args.max_evaluations is not None and args.strategy != "search":
        raise ValueError(f"--max-evaluations applies to --strategy search, not {args.strategy!r}")
    return LayerSwapConfig(
        num_layers=args.num_layers, layers=args.layers, protocol=args.protocol, max_gap=args.max_gap,
        spacing=args.spacing, protect=args.protect, calibration=_calibration_source(args.calibration),
        num_prompts=_num_prompts(args.num_prompts), seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
        strategy=args.strategy, objective=args.objective, max_evaluations=args.max_evaluations,
        recovery=args.recovery, sparsity=args.sparsity, allocation=args.allocation, method=args.sparsity_method,
        sparsity_pattern=args.sparsity_pattern, progress=True,
    )


def run_prune(args) -> int:
    _check_output(args.output)
    config = prune_config(args)
    report = None
    if args.report:
        if not Path(args.report).is_file():
            raise FileNotFoundError(f"--report {args.report!r} is not a file; give a report JSON written by 'score'")
        report = SwapReport.from_json(args.report)
    if args.protocols is not None:
        print("note: --protocols is ignored by prune; the protocols scored follow --strategy and --protocol",
              file=sys.stderr)
    model, tokenizer = _load(args)
    result = prune(model, config, tokenizer=tokenizer, report=report)
    out = _save_pruned(model, tokenizer, result.report, Path(args.output))
    print(f"removed layers {result.removed} (0-based); pruned checkpoint written to {out}")
    return 0


def format_scores_table(report) -> str:
    """Per-layer scores of both protocols side by side (nats), with ranks."""
    protocols = list(report.protocols)
    scores = {p: report.layer_scores(p) for p in protocols}
    ranks = {p: {layer: r + 1 for r, layer in enumerate(report.ranking(p))} for p in protocols}
    header = "| layer | " + " | ".join(f"{p} s(i) | rank" for p in protocols) + " |"
    sep = "|---:|" + "---:|---:|" * len(protocols)
    lines = [header, sep]
    for layer in range(report.num_layers):
        cells = " | ".join(f"{_fmt(scores[p][layer])} | {ranks[p][layer]}" for p in protocols)
        lines.append(f"| {layer} | {cells} |")
    return "\n".join(lines)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4f}" if abs(x) >= 1e-3 else f"{x:.2e}"


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
        calibration=_calibration_source(args.calibration), num_prompts=num_prompts, seq_len=args.seq_len,
        batch_size=args.batch_size, seed=args.seed, progress=True,
    )


def run_demo(args) -> int:
    t_start = time.perf_counter()
    _check_output(args.output)
    model, tokenizer = _load(args)
    _needs_tokenizer(tokenizer, args.model, f"--calibration {args.calibration}")
    num_layers = num_blocks(model)
    num_probes = 3 * (num_layers - 1)
    if args.num_prompts == "auto":
        n_prompts = _auto_num_prompts(
            model, args.calibration, tokenizer, args.seq_len, args.batch_size, args.scoring_seconds, num_probes, args.seed
        )
        how = f"chosen to fit about {args.scoring_seconds:.0f} s of scoring on this machine"
    else:
        n_prompts = _num_prompts(args.num_prompts)
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
    print(f"| 0 | (base) | - | {base.ppl:.3f} | [{base.ci_low:.3f}, {base.ci_high:.3f}] | 0.0 |")
    for n, protocol, layers, res, err in rows:
        if res is None:
            print(f"| {n} | {protocol} | ({err}) | - | - | - |")
        else:
            print(
                f"| {n} | {protocol} | {layers} | {res.ppl:.3f} | [{res.ci_low:.3f}, {res.ci_high:.3f}] | "
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
    out = _save_pruned(pruned, tokenizer, report, Path(args.output), evaluation=evaluation)
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


def main(argv=None, prog: str = "hf-layerswap") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
