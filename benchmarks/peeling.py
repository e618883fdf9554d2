"""Peeling reference bounds on SmolLM2-135M and Gemma-3-270M, and over a training run.

    python benchmarks/peeling.py --threads 1

Writes ``benchmarks/results/peeling.md``, ``benchmarks/results/peeling_trajectory.png``,
``benchmarks/results/peeling_<model>.png`` and the JSON reports under
``benchmarks/results/peeling/``.

Per real model (:func:`hf_layerswap.models.load_model`, fp32 dequantized GGUF weights):

1. :func:`hf_layerswap.peeling.peel` with linear references, spans 1 and 2, plus the map
   onto the final stream; references fitted on WikiText-2 validation paragraphs
   (``../shared/data/wikitext-2/valid.txt``), hybrids scored on WikiText-2 raw *test*
   paragraphs (``../shared/data/wikitext-2-raw/wiki.test.raw``): disjoint splits;
2. the same with ``reference="deletion"`` at span 1: single-layer removal ΔCE on the same
   held-out tokens, reported as removal dPPL% = 100 (exp(ΔCE) - 1) (the PPL ratio on these
   evaluation sequences, not the sliding-window contract of ``hf_layerswap.evaluation``,
   which is too slow for 48 removals on this machine);
3. :func:`hf_layerswap.score_layers` with both protocols on adjacent pairs (validation
   paragraphs);
4. Spearman rank correlation over layers between the span-1 linear gap, the interchange
   and replacement layer scores and the removal dPPL.

Training run: ``benchmarks/train_tiny.py`` trains a 6-block Llama-style model on the
WikiText-2 validation split minus its last 6 articles; :func:`peel_trajectory` peels each
saved checkpoint (references fitted on training paragraphs, scored on the held-out
articles) and scores it with both swap-KL protocols on adjacent pairs.
"""

from __future__ import annotations

import argparse
import json
import math
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from train_tiny import sample_paragraphs, split_data, train, wikitext_articles  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DATA = REPO.parent / "shared" / "data"
VALID = DATA / "wikitext-2" / "valid.txt"
TEST_RAW = DATA / "wikitext-2-raw" / "wiki.test.raw"
MODELS = ("smollm2-135m", "gemma3-270m")
COMMAND = "python benchmarks/peeling.py --threads 1"

#: Budgets (chosen so that the whole benchmark fits in about 15 minutes on 2 idle cores).
REAL = {
    "smollm2-135m": dict(num_prompts=48, seq_len=128, eval_prompts=16, eval_seq_len=64, batch_size=8, bootstrap=1000),
    # the 262,144-way head dominates every probe: fewer evaluation tokens
    "gemma3-270m": dict(num_prompts=48, seq_len=128, eval_prompts=12, eval_seq_len=64, batch_size=6, bootstrap=1000),
}
SWAP = dict(num_prompts=8, seq_len=64)
TRAJ = dict(num_prompts=32, seq_len=128, eval_prompts=32, eval_seq_len=128, bootstrap=1000)


def paragraphs(path: Path) -> list[str]:
    """All paragraphs (one per line) of a WikiText-2 file, headings dropped."""
    return [p for article in wikitext_articles(path) for p in article]


def spearman(a, b) -> float:
    """Spearman rank correlation (average ranks for ties) over the finite pairs."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    if a.size < 3:
        return math.nan

    def ranks(x):
        order = np.argsort(x, kind="mergesort")
        r = np.empty(x.size)
        r[order] = np.arange(x.size, dtype=float)
        for v in np.unique(x):  # average ranks of ties
            tie = x == v
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def merged(linear, deletion):
    """One PeelReport holding the linear and the deletion probes (same model, same tokens)."""
    from hf_layerswap.peeling import PeelReport

    if linear.metadata["evaluation"]["content_hash"] != deletion.metadata["evaluation"]["content_hash"]:
        raise ValueError("linear and deletion reports were scored on different evaluation sets")
    settings = dict(linear.settings, references=["linear", "deletion"])
    return PeelReport(linear.num_layers, linear.base_ce, linear.base_ce_ci, linear.probes + deletion.probes,
                      settings, dict(linear.metadata))


def run_real(name: str, log) -> dict:
    from hf_layerswap import score_layers
    from hf_layerswap.models import load_model
    from hf_layerswap.peeling import peel, peel_plot

    t0 = time.perf_counter()
    model, tokenizer = load_model(name)
    load_s = time.perf_counter() - t0
    kw = dict(REAL[name])
    calib = sample_paragraphs(paragraphs(VALID), kw["num_prompts"], seed=0)
    evals = sample_paragraphs(paragraphs(TEST_RAW), kw["eval_prompts"], seed=1)
    log(f"[{name}] loaded in {load_s:.0f} s; linear peel ...")
    t1 = time.perf_counter()
    linear = peel(model, calib, evals, tokenizer=tokenizer, spans=(1, 2), targets="own+later", **kw)
    linear_s = time.perf_counter() - t1
    log(f"[{name}] linear peel {linear_s:.0f} s; deletion probes ...")
    t2 = time.perf_counter()
    deletion = peel(model, calib, evals, tokenizer=tokenizer, spans=(1,), targets="own", reference="deletion", **kw)
    deletion_s = time.perf_counter() - t2
    log(f"[{name}] deletion {deletion_s:.0f} s; swap-KL ...")
    t3 = time.perf_counter()
    swap = score_layers(model, calib[: SWAP["num_prompts"]], tokenizer=tokenizer, max_gap=1, progress=False,
                        num_prompts=SWAP["num_prompts"], seq_len=SWAP["seq_len"], batch_size=8)
    swap_s = time.perf_counter() - t3
    log(f"[{name}] swap-KL {swap_s:.0f} s")
    report = merged(linear, deletion)
    out = RESULTS / "peeling"
    report.to_json(out / f"{name}_peel.json")
    swap.to_json(out / f"{name}_swap.json")
    peel_plot(report, RESULTS / f"peeling_{name}.png")
    return {"name": name, "report": report, "swap": swap, "seconds": {
        "load": load_s, "linear_peel": linear_s, "deletion_peel": deletion_s, "swap_kl": swap_s,
        "swap_probes": len(swap.pairs) * 3, "swap_forward_passes": swap.metadata.get("forward_passes"),
    }, "identity": getattr(model, "layerswap_identity", None)}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else math.nan


def real_section(res: dict) -> str:
    from hf_layerswap.peeling import peel_table_markdown

    name, report, swap, sec = res["name"], res["report"], res["swap"], res["seconds"]
    L = report.num_layers
    lin1 = report.layer_gaps(1, "linear")
    lin2 = report.layer_gaps(2, "linear")
    dele = report.layer_gaps(1, "deletion")
    dppl = [100 * math.expm1(v) if v is not None else None for v in dele]
    inter, repl = swap.layer_scores("interchange"), swap.layer_scores("replacement")
    meta = report.metadata
    t = meta["timings"]
    by_kind = {}
    for p in report.probes:
        key = "deletion, span 1" if p.reference == "deletion" else ("k → end" if p.kind == "later" else f"linear, span {p.span}")
        by_kind.setdefault(key, []).append(p.seconds)
    ident = res.get("identity") or {}
    lines = [f"## {name}", ""]
    lines.append(
        f"Model: {ident.get('name', name)} ({ident.get('revision', '')}), {L} blocks, hidden {meta['hidden_size']}, "
        f"fp32. Base CE {report.base_ce:.4f} nats/token (PPL {math.exp(report.base_ce):.2f}) on "
        f"{meta['evaluation_predicted_tokens']} predicted tokens ({meta['evaluation_sequences']} WikiText-2 test "
        f"paragraphs, first {REAL[name]['eval_seq_len']} tokens each). References fitted on "
        f"{meta['calibration_tokens_used']} tokens ({REAL[name]['num_prompts']} validation paragraphs, at most "
        f"{REAL[name]['seq_len']} tokens each), ridge {report.settings['ridge']}, affine."
    )
    lines += ["", "### Per-layer reference gaps (ΔCE = CE(hybrid) − CE(model), nats/token, 95% CI)", ""]
    lines.append(peel_table_markdown(report))
    lines += ["### Against swap-KL and removal", ""]
    lines.append("| layer | linear ΔCE k | linear ΔCE k..k+1 | removal dPPL % | interchange s(i) | replacement s(i) |")
    lines.append("|---|---|---|---|---|---|")
    for k in range(L):
        def f(v, spec):
            return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
        lines.append(f"| {k} | {f(lin1[k], '+.4f')} | {f(lin2[k], '+.4f')} | {f(dppl[k], '+.2f')} | "
                     f"{f(inter[k], '.4f')} | {f(repl[k], '.4f')} |")
    series = {"linear gap (span 1)": lin1, "removal dPPL": dppl, "interchange s(i)": inter,
              "replacement s(i)": repl, "linear gap (span 2)": lin2}
    names = list(series)
    lines += ["", "Spearman rank correlation over layers (layers where both values exist):", ""]
    lines.append("| | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for a in names:
        vals = [[np.nan if v is None else v for v in series[a]], None]
        row = []
        for b in names:
            vals[1] = [np.nan if v is None else v for v in series[b]]
            rho = spearman(*vals)
            row.append("—" if math.isnan(rho) else f"{rho:+.2f}")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    lines += ["", "### Cost", ""]
    lines.append("| step | seconds |")
    lines.append("|---|---|")
    lines.append(f"| load | {sec['load']:.1f} |")
    solves = sum(1 for p in report.probes if p.reference == "linear")
    lines.append(f"| calibration pass + {solves} float64 solves (linear fits) | "
                 f"{t['linear_fit_seconds']:.1f} |")
    lines.append(f"| reference forward over the evaluation set | {t['evaluation_base_seconds']:.1f} |")
    for key, vals in by_kind.items():
        lines.append(f"| per probe, {key} ({len(vals)} probes; mean) | {_mean(vals):.2f} |")
    lines.append(f"| linear peel, total | {sec['linear_peel']:.1f} |")
    lines.append(f"| deletion probes, total | {sec['deletion_peel']:.1f} |")
    lines.append(f"| swap-KL, both protocols, {sec['swap_probes']} probes on {swap.metadata.get('num_tokens')} "
                 f"tokens, total | {sec['swap_kl']:.1f} |")
    lines.append("")
    lines.append(f"![per-layer peeling gaps of {name}](peeling_{name}.png)")
    beaten = [(p.site, p.span) for p in report.flagged("beaten") if p.reference == "linear"]
    matched = [(p.site, p.span) for p in report.flagged("matched") if p.reference == "linear"]
    bound = report.peel_bound
    lines += ["", "Flags: " + (
        f"linear reference beats the checkpoint (CI below 0) at (site, span) {beaten}; " if beaten
        else "no site where a linear reference beats the checkpoint (no CI entirely below 0); "
    ) + (f"matched within tau = {report.settings['tau']} nats at {matched}. " if matched else "no site matched within "
         f"tau = {report.settings['tau']} nats. ") + (
        f"Peel bound: ΔCE {bound.dce:+.4f} at site {bound.site}, span {bound.span} ({bound.kind})." if bound else ""), ""]
    return "\n".join(lines)


def run_trajectory(out_dir: Path, reuse: bool, log) -> dict:
    from hf_layerswap.peeling import peel_trajectory, trajectory_plot

    run_file = out_dir / "run.json"
    if reuse and run_file.is_file():
        record = json.loads(run_file.read_text())
        log(f"[trajectory] reusing checkpoints in {out_dir}")
    else:
        log("[trajectory] training ...")
        record = train(out_dir, log=log)
    data = split_data()
    calib = sample_paragraphs(data["train"], TRAJ["num_prompts"], seed=0)
    evals = sample_paragraphs(data["heldout"], TRAJ["eval_prompts"], seed=1)
    t0 = time.perf_counter()
    traj = peel_trajectory(record["checkpoints"], calib, evals, spans=(1, 2), targets="own+later",
                           max_gap=1, swap_prompts=TRAJ["num_prompts"], swap_seq_len=TRAJ["seq_len"],
                           **{k: TRAJ[k] for k in ("num_prompts", "seq_len", "eval_prompts", "eval_seq_len", "bootstrap")})
    seconds = time.perf_counter() - t0
    log(f"[trajectory] peeled {len(traj.points)} checkpoints in {seconds:.0f} s")
    traj.to_json(RESULTS / "peeling" / "trajectory.json")
    trajectory_plot(traj, RESULTS / "peeling_trajectory.png")
    return {"trajectory": traj, "record": record, "seconds": seconds}


def trajectory_section(res: dict) -> str:
    from hf_layerswap.peeling import trajectory_table_markdown

    traj, rec = res["trajectory"], res["record"]
    split, model, tr = rec["split"], rec["model"], rec["training"]
    lines = ["## Training trajectory (small Llama-style model trained here)", ""]
    lines.append(
        f"`python benchmarks/train_tiny.py` (called by this script): {model['layers']} blocks, hidden {model['hidden']}, "
        f"{model['parameters']:,} parameters, BPE vocabulary {rec['tokenizer']['vocab_size']} trained on the training "
        f"articles; {tr['steps']} AdamW steps of {tr['batch']} x {tr['seq_len']} tokens (lr {tr['lr']}, cosine), "
        f"{rec['seconds']['training']:.0f} s of training. Data: `{rec['data']}` cut into articles at top-level "
        f"headings; training = the first {split['train_articles']} articles ({split['train_tokens']:,} tokens), "
        f"held out = the last {split['heldout_articles']} ({split['heldout_paragraphs']} paragraphs). References are "
        f"fitted on {TRAJ['num_prompts']} training paragraphs and scored on {TRAJ['eval_prompts']} held-out "
        f"paragraphs ({TRAJ['eval_seq_len']} tokens max); swap-KL on the training paragraphs, adjacent pairs. "
        f"Peeling + swap-KL of {len(traj.points)} checkpoints: {res['seconds']:.0f} s."
    )
    lines += ["", "Span-1 linear gaps per checkpoint (ΔCE, nats/token; negative = the linear map beats the block):", ""]
    lines.append(trajectory_table_markdown(traj))
    lines += ["Map onto the final stream (k → end) per checkpoint:", ""]
    lines.append(trajectory_table_markdown(traj, span=0))
    lines += ["![training trajectory](peeling_trajectory.png)", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="peeling benchmark")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--skip-trajectory", action="store_true")
    parser.add_argument("--checkpoints", type=Path, default=None, help="training-run folder (default: cache)")
    parser.add_argument("--reuse-checkpoints", action="store_true", help="reuse an earlier training run")
    parser.add_argument("--smoke", action="store_true", help="tiny budgets and 2 sites: checks the script, no results")
    args = parser.parse_args(argv)
    if args.smoke:
        for budget in REAL.values():
            budget.update(num_prompts=8, seq_len=32, eval_prompts=4, eval_seq_len=32, bootstrap=100, sites=[1, 2])
        SWAP.update(num_prompts=2, seq_len=16)
        TRAJ.update(num_prompts=8, seq_len=32, eval_prompts=4, eval_seq_len=32, bootstrap=100)
        global RESULTS
        RESULTS = Path(os.environ.get("TMPDIR", "/tmp")) / "peeling-smoke"
    torch.set_num_threads(args.threads)
    import transformers

    from train_tiny import default_out

    start = time.perf_counter()
    load_start = os.getloadavg()

    def log(msg):
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    real = [run_real(name, log) for name in args.models]
    traj = None if args.skip_trajectory else run_trajectory(args.checkpoints or default_out(), args.reuse_checkpoints, log)
    total = time.perf_counter() - start
    load_end = os.getloadavg()
    head = [
        "# Peeling reference bounds: real checkpoints and a training run",
        "",
        f"Command: `{COMMAND}`",
        "",
        "Method: `hf_layerswap.peeling` (per-site form of the peeling reference bounds of Eamaz, Yeganegi and "
        "Soltanalian, arXiv 2605.02853). At site k a reference replaces blocks k..k+m-1: a closed-form float64 ridge "
        "regression of the residual stream entering block k onto the stream leaving block k+m-1 (toward the "
        "identity, affine), or onto the stream leaving the last block (`k → end`); `deletion` is plain removal. "
        "ΔCE = CE(hybrid) − CE(model) on held-out text, nats per predicted token, with a 95% paired bootstrap CI "
        "over sequences. ΔCE < 0 with the CI below 0: the trained blocks are beaten by their reference. EV = "
        "held-out explained variance of the blocks' update.",
        "",
        f"Machine: {os.cpu_count()} CPU cores shared with other jobs (load average {load_start[0]:.1f} at the start, "
        f"{load_end[0]:.1f} at the end), torch {torch.__version__} with {args.threads} thread(s), transformers "
        f"{transformers.__version__}, Python {platform.python_version()}. Wall-clock times below include that "
        f"sharing. Whole benchmark: {total:.0f} s.",
        "",
        "Data: references fitted on WikiText-2 *validation* paragraphs (`../shared/data/wikitext-2/valid.txt`), "
        "hybrids scored on WikiText-2 raw *test* paragraphs (`../shared/data/wikitext-2-raw/wiki.test.raw`); "
        "paragraphs = lines of the files, headings dropped, seeded samples (seeds 0 and 1). Removal dPPL% = "
        "100 (exp(ΔCE of deletion) − 1) on the same evaluation tokens (the ratio of the token-level perplexities "
        "of these sequences; not the sliding-window contract of `hf_layerswap.evaluation`). Swap-KL: "
        f"`score_layers`, both protocols, adjacent pairs, {SWAP['num_prompts']} validation paragraphs x "
        f"{SWAP['seq_len']} tokens (KL, not CE: it needs no labels). Layer indices are 0-based.",
        "",
    ]
    body = [real_section(r) for r in real]
    if traj is not None:
        body.append(trajectory_section(traj))
    text = "\n".join(head) + "\n" + "\n".join(body)
    path = RESULTS / "peeling.md"
    tmp = path.with_name(".peeling.md.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    summary = {"seconds": total, "models": {r["name"]: r["seconds"] for r in real},
               "trajectory_seconds": traj["seconds"] if traj else None}
    (RESULTS / "peeling" / "timings.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
