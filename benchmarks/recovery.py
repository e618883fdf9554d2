"""Recovery benchmark: perplexity cost of block removal with no repair, the fused
(ReplaceMe-style, folded into down_proj) map and the ghosted (Ghosted Layers) operator.

For each model and budget n, two removal sets are evaluated:

- ``interchange``: the paper's rule on the interchange swap-KL (adjacent pairs), greedy,
  no two removed blocks adjacent, first and last block protected
  (:func:`hf_layerswap.select_layers`);
- ``block-influence``: ShortGPT's Block Influence, BI_i = 1 - mean over real calibration
  tokens of cos(h_i, h_{i+1}) (raw residual streams, per token), the n lowest.

Calibration: WikiText-2 validation (``../shared/data/wikitext-2/valid.txt``); the same
prompts drive scoring, BI and the recovery fits. Evaluation: the matched contract of
:func:`hf_layerswap.evaluation.evaluate_perplexity` on WikiText-2 raw test. Writes a
Markdown table and a JSON file with every number and the full contract.

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

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from hf_layerswap.selection.geometry import block_influence  # noqa: E402
from hf_layerswap.evaluation import PerplexityResult, delta_ppl_ci, delta_ppl_percent, evaluate_perplexity  # noqa: E402
from hf_layerswap.models import load_model  # noqa: E402
from hf_layerswap.provenance import library_versions, model_identity  # noqa: E402
from hf_layerswap.plan import num_blocks  # noqa: E402
from hf_layerswap.recovery import DEFAULT_EPSILON, recover  # noqa: E402
from hf_layerswap.jsonio import write_json_atomic, write_text_atomic  # noqa: E402
from hf_layerswap.report import SwapReport  # noqa: E402
from hf_layerswap.scoring import score_layers  # noqa: E402
from hf_layerswap.selection import select_layers  # noqa: E402
from wikitext import VALID as CALIBRATION  # noqa: E402
from wikitext import wikitext_calibration  # noqa: E402

EVALUATION = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
METHODS = ("none", "fused", "ghosted")


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


def evaluate(model, tokenizer):
    return evaluate_perplexity(model, str(EVALUATION), tokenizer=tokenizer, contract="matched")


def run_model(name: str, args, store: Path, header: dict) -> dict:
    """Every number for one model; written to ``store`` after each evaluation, so an
    interrupted run resumes where it stopped (same settings) and a partial run renders."""
    t0 = time.time()
    previous = json.loads(store.read_text(encoding="utf-8")) if store.is_file() else None
    done = {}
    if previous and previous.get("settings") == header["settings"]:
        done = {tuple(e["removed"]): e["results"] for e in previous["result"].get("evaluated", [])}
        print(f"[{name}] resuming: {sum(len(v) for v in done.values())} evaluations stored", flush=True)
    model, tokenizer = load_model(name)
    model.eval()
    calib = calibration_set(tokenizer, args.num_prompts, args.seq_len)
    score_calib = calibration_set(tokenizer, args.score_prompts, args.seq_len)  # the first prompts of ``calib``
    if done:
        base = PerplexityResult.from_dict({k: v for k, v in previous["result"]["base"].items() if k != "ci"})
    else:
        base = evaluate(model, tokenizer)
    print(f"[{name}] base PPL {base.ppl:.3f} ({time.time() - t0:.0f}s)", flush=True)
    cache = store.with_name(f"recovery_swap_report_{name}.json")
    report = swap_report(model, score_calib, args, cache)
    inter = report.layer_scores("interchange")
    bi = block_influence(model, calib, args.budgets, batch_size=args.batch_size)
    total = num_blocks(model)
    out = {
        "model": name,
        "identity": {k: v for k, v in model_identity(model).items() if k != "path"},
        "num_blocks": total,
        "hidden_size": model.get_input_embeddings().weight.shape[1],
        "base": {**base.to_dict(), "ci": [base.ci_low, base.ci_high]},
        "calibration": calib.spec(),
        "score_calibration": score_calib.spec(),
        "interchange_scores": inter,
        "block_influence": bi[args.budgets[0]].scores,
        "rows": [],
        "evaluated": [],
        "seconds": (previous or {}).get("result", {}).get("seconds", 0.0) if done else 0.0,
        "complete": False,
    }
    started = time.time() - out["seconds"]

    def save():
        out["evaluated"] = [{"removed": list(k), "results": v} for k, v in done.items()]
        out["seconds"] = time.time() - started
        write_json_atomic({**header, "result": out}, store)

    for n in args.budgets:
        sets = {"interchange": select_layers(report, n, protocol="interchange"), "block-influence": bi[n].removed}
        for selection, removed in sets.items():
            key = tuple(removed)
            results = done.setdefault(key, {})
            for method in METHODS:
                if method in results:
                    continue
                pruned = copy.deepcopy(model)
                try:
                    rec = recover(
                        pruned, removed, calib, method=method, num_tokens=args.num_tokens,
                        epsilon=args.epsilon, batch_size=args.batch_size,
                    )
                except ValueError as err:
                    results[method] = {"refused": str(err)}
                    print(f"[{name}] {removed} {method}: refused ({err})", flush=True)
                    save()
                    continue
                result = evaluate(pruned, tokenizer)
                results[method] = {
                    "ppl": result.ppl,
                    "ci": [result.ci_low, result.ci_high],
                    "dppl_percent": delta_ppl_percent(base, result),
                    "dppl_ci": list(delta_ppl_ci(base, result)),
                    "recovery": rec.to_dict(),
                }
                print(
                    f"[{name}] n={n} {selection} {removed} {method}: PPL {result.ppl:.3f} "
                    f"dPPL {results[method]['dppl_percent']:+.1f}% "
                    f"residuals {[(round(b.residual_before, 3), round(b.residual_after, 3)) for b in rec.boundaries]} "
                    f"({time.time() - t0:.0f}s)",
                    flush=True,
                )
                del pruned
                save()
            out["rows"].append({"n": n, "selection": selection, "removed": removed, "results": results})
            save()
    out["complete"] = True
    save()
    return out


def _fmt_method(entry: dict) -> str:
    if "refused" in entry:
        return "n/a"
    low, high = entry["dppl_ci"]
    return f"{entry['dppl_percent']:+.1f} [{low:+.1f}, {high:+.1f}]"


def _fmt_residual(entry: dict) -> str:
    if "refused" in entry:
        return "n/a"
    parts = [f"{b['residual_after']:.3f}" for b in entry["recovery"]["boundaries"]]
    return ", ".join(parts)


def _observations(model_result: dict) -> list[str]:
    notes = []
    for row in model_result["rows"]:
        res = row["results"]
        none = res["none"]["dppl_percent"]
        for method in ("fused", "ghosted"):
            entry = res.get(method, {})
            if "refused" in entry:
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
    refused = {
        (row["selection"], tuple(row["removed"])): e["refused"]
        for row in model_result["rows"]
        for m, e in row["results"].items()
        if "refused" in e
    }
    if refused:
        reason = next(iter(refused.values()))
        notes.append(f"fused is not applicable to this model: {reason}")
    return notes


def write_markdown(results: list[dict], args, path: Path, command: str, libraries: str) -> None:
    lines = [
        "# Recovery of the cut: no repair vs fused vs ghosted",
        "",
        f"Command: `{command}`",
        "",
        "Removing decoder blocks, then repairing each cut with a closed-form linear map fitted on the dense model "
        "(`hf_layerswap.recovery.recover`): **fused** = ReplaceMe-style least-squares map on the MLP output of the "
        "last kept block, folded into its `down_proj` (a plain transformers checkpoint); **ghosted** = Ghosted "
        "Layers' operator I + M on the full residual stream (a hook; needs `hf_layerswap` to load).",
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
        "ShortGPT Block Influence 1 − cos(h_i, h_{i+1}) (per token), no constraints.",
        "- Fit residual = ‖Ŷ − h_e‖_F / ‖h_e‖_F on the calibration tokens, per cut; \"before\" is plain removal "
        "(Ŷ = h_s).",
        f"- Libraries: {libraries}",
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
               f" **Partial run**: stopped after the rows below (budgets requested: {', '.join(map(str, args.budgets))})."),
            "",
            "| n | selection | removed (0-based) | dPPL% none | dPPL% fused | dPPL% ghosted | "
            "fit residual before | after fused | after ghosted |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in res["rows"]:
            r = row["results"]
            before = ", ".join(f"{b['residual_before']:.3f}" for b in r["none"]["recovery"]["boundaries"])
            lines.append(
                f"| {row['n']} | {row['selection']} | {row['removed']} | {_fmt_method(r['none'])} | "
                f"{_fmt_method(r['fused'])} | {_fmt_method(r['ghosted'])} | {before} | {_fmt_residual(r['fused'])} | "
                f"{_fmt_residual(r['ghosted'])} |"
            )
        notes = _observations(res)
        lines += ["", "Where recovery does not help (or not clearly):", ""]
        lines += [f"- {note}" for note in notes] or ["- recovery lowered dPPL in every row, outside the overlap of intervals."]
        lines.append("")
    write_text_atomic("\n".join(lines), path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"])
    parser.add_argument("--budgets", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--num-prompts", type=int, default=64, help="calibration prompts (BI, recovery fits)")
    parser.add_argument("--score-prompts", type=int, default=16, help="the first prompts, for the swap-KL")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--num-tokens", type=int, default=8192)
    parser.add_argument("--epsilon", type=float, default=None, help="relative ridge (default: per method)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: up to 2)")
    parser.add_argument("--render-only", action="store_true", help="only rewrite the Markdown from the stored JSON")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "recovery.md"))
    args = parser.parse_args(argv)
    for path in (CALIBRATION, EVALUATION):
        if not path.is_file():
            raise SystemExit(f"{path} is missing: this benchmark needs the shared WikiText-2 files")
    torch.set_num_threads(args.threads or max(1, min(2, os.cpu_count() or 1)))
    command = "python benchmarks/recovery.py " + " ".join(
        [f"--models {' '.join(args.models)}", f"--budgets {' '.join(map(str, args.budgets))}",
         f"--num-prompts {args.num_prompts}", f"--score-prompts {args.score_prompts}", f"--seq-len {args.seq_len}", f"--num-tokens {args.num_tokens}",
         *([f"--epsilon {args.epsilon:g}"] if args.epsilon is not None else [])]
    )
    out = Path(args.out)
    settings = {k: v for k, v in vars(args).items() if k not in ("models", "out", "threads", "render_only")}
    if not args.render_only:
        for name in args.models:
            # one file per model, so models run in separate processes and render together
            run_model(name, args, out.with_name(f"recovery-{name}.json"),
                      {"command": command, "settings": settings, "libraries": library_versions()})
    results, commands, libraries = [], [], []
    for path in sorted(out.parent.glob("recovery-*.json")):
        stored = json.loads(path.read_text(encoding="utf-8"))
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
