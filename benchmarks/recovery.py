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
import random
import re
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hf_layerswap.calibration import build_calibration, split_paragraphs  # noqa: E402
from hf_layerswap.evaluation import delta_ppl_ci, delta_ppl_percent, evaluate_perplexity  # noqa: E402
from hf_layerswap.models import load_model, model_identity  # noqa: E402
from hf_layerswap.plan import capture_residual_stream, num_blocks  # noqa: E402
from hf_layerswap.recovery import DEFAULT_EPSILON, recover  # noqa: E402
from hf_layerswap.report import SwapReport, write_json_atomic  # noqa: E402
from hf_layerswap.scoring import library_versions, score_layers  # noqa: E402
from hf_layerswap.selection import greedy_select, select_layers  # noqa: E402

CALIBRATION = REPO.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
EVALUATION = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
METHODS = ("none", "fused", "ghosted")


@torch.no_grad()
def block_influence(model, calib, batch_size: int) -> list[float]:
    """ShortGPT Block Influence per block: 1 - mean per-token cos(h_i, h_{i+1})."""
    num_layers = num_blocks(model)
    sums = torch.zeros(num_layers, dtype=torch.float64)
    count = 0
    for ids, mask in calib.batches(batch_size):
        streams, _ = capture_residual_stream(model, ids, mask)
        keep = mask.bool()
        for i in range(num_layers):
            cos = torch.nn.functional.cosine_similarity(streams[i][keep].double(), streams[i + 1][keep].double(), dim=-1)
            sums[i] += cos.sum()
        count += int(keep.sum())
    return [1.0 - float(s) / count for s in sums]


def calibration_set(tokenizer, num_prompts: int, seq_len: int):
    """WikiText-2 validation paragraphs (seeded shuffle, seed 0). Its blank lines hold a
    space; if the library's paragraph splitter does not treat them as blank, they are
    normalised first (the same paragraphs and the same shuffle either way)."""
    try:
        return build_calibration(str(CALIBRATION), tokenizer, num_prompts=num_prompts, seq_len=seq_len, seed=0)
    except ValueError as err:
        if "empty calibration set" not in str(err):
            raise
    text = re.sub(r"\n[ \t]+(?=\n)", "\n", CALIBRATION.read_text(encoding="utf-8"))
    paragraphs = split_paragraphs(text)
    random.Random(0).shuffle(paragraphs)
    return build_calibration(paragraphs[:num_prompts], tokenizer, num_prompts=num_prompts, seq_len=seq_len)


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


def run_model(name: str, args) -> dict:
    t0 = time.time()
    model, tokenizer = load_model(name)
    model.eval()
    calib = calibration_set(tokenizer, args.num_prompts, args.seq_len)
    score_calib = calibration_set(tokenizer, args.score_prompts, args.seq_len)  # the first prompts of ``calib``
    base = evaluate(model, tokenizer)
    print(f"[{name}] base PPL {base.ppl:.3f} ({time.time() - t0:.0f}s)", flush=True)
    cache = Path(args.out).with_name(f"recovery_swap_report_{name}.json")
    report = swap_report(model, score_calib, args, cache)
    inter = report.layer_scores("interchange")
    bi = block_influence(model, calib, args.batch_size)
    num_layers = num_blocks(model)
    rows, evaluated = [], {}
    for n in args.budgets:
        sets = {
            "interchange": select_layers(report, n, protocol="interchange"),
            "block-influence": greedy_select(bi, n, spacing=0, protect=()),
        }
        for selection, removed in sets.items():
            key = tuple(removed)
            if key not in evaluated:
                evaluated[key] = {}
                for method in METHODS:
                    pruned = copy.deepcopy(model)
                    try:
                        rec = recover(
                            pruned, removed, calib, method=method, num_tokens=args.num_tokens,
                            epsilon=args.epsilon, batch_size=args.batch_size,
                        )
                    except ValueError as err:
                        evaluated[key][method] = {"refused": str(err)}
                        print(f"[{name}] {removed} {method}: refused ({err})", flush=True)
                        continue
                    result = evaluate(pruned, tokenizer)
                    evaluated[key][method] = {
                        "ppl": result.ppl,
                        "ci": [result.ci_low, result.ci_high],
                        "dppl_percent": delta_ppl_percent(base, result),
                        "dppl_ci": list(delta_ppl_ci(base, result)),
                        "recovery": rec.to_dict(),
                    }
                    print(
                        f"[{name}] n={n} {selection} {removed} {method}: PPL {result.ppl:.3f} "
                        f"dPPL {evaluated[key][method]['dppl_percent']:+.1f}% "
                        f"residuals {[(round(b.residual_before, 3), round(b.residual_after, 3)) for b in rec.boundaries]} "
                        f"({time.time() - t0:.0f}s)",
                        flush=True,
                    )
                    del pruned
            rows.append({"n": n, "selection": selection, "removed": removed, "results": evaluated[key]})
    return {
        "model": name,
        "identity": model_identity(model),
        "num_layers": num_layers,
        "hidden_size": model.get_input_embeddings().weight.shape[1],
        "base": {"ppl": base.ppl, "ci": [base.ci_low, base.ci_high], "contract": base.contract},
        "calibration": calib.spec(),
        "score_calibration": score_calib.spec(),
        "interchange_scores": inter,
        "block_influence": bi,
        "rows": rows,
        "seconds": time.time() - t0,
    }


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


def write_markdown(results: list[dict], args, path: Path, command: str) -> None:
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
        f"- Libraries: {json.dumps(library_versions())}",
        "",
    ]
    for res in results:
        base = res["base"]
        lines += [
            f"## {res['model']} ({res['num_layers']} blocks, hidden size {res['hidden_size']})",
            "",
            f"Base PPL {base['ppl']:.3f} (95% CI {base['ci'][0]:.3f}–{base['ci'][1]:.3f}); "
            f"{res['base']['contract'].get('scored_tokens', '?')} scored tokens; calibration "
            f"{res['calibration']['num_tokens']} real tokens, sha256 {res['calibration']['content_hash'][:12]}; "
            f"run time {res['seconds'] / 60:.0f} min.",
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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines), encoding="utf-8")
    os.replace(tmp, path)


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
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "recovery.md"))
    args = parser.parse_args(argv)
    for path in (CALIBRATION, EVALUATION):
        if not path.is_file():
            raise SystemExit(f"{path} is missing: this benchmark needs the shared WikiText-2 files")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    command = "python benchmarks/recovery.py " + " ".join(
        [f"--models {' '.join(args.models)}", f"--budgets {' '.join(map(str, args.budgets))}",
         f"--num-prompts {args.num_prompts}", f"--score-prompts {args.score_prompts}", f"--seq-len {args.seq_len}", f"--num-tokens {args.num_tokens}",
         *([f"--epsilon {args.epsilon:g}"] if args.epsilon is not None else [])]
    )
    results = [run_model(name, args) for name in args.models]
    out = Path(args.out)
    write_json_atomic({"command": command, "args": vars(args), "results": results}, out.with_suffix(".json"))
    write_markdown(results, args, out, command)
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
