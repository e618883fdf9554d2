"""The search's set at n = 2 against the exhaustive optimum of its objective, on the real models.

Command (one CPU thread per model unless told; writes
benchmarks/results/search-optimum-<model>.json and the page benchmarks/results/search_optimum.md
from every model's JSON present):

    python benchmarks/search_optimum.py --model smollm2-135m
    python benchmarks/search_optimum.py --model gemma3-270m
    python benchmarks/search_optimum.py --render-only

For each model: WikiText-2 validation calibration (variant ``sections``, 8 prompts x 64
tokens by default), the swap-KL report of both protocols on adjacent pairs
(:func:`hf_layerswap.score_layers`), then the removal KL (the search's default objective,
:class:`~hf_layerswap.selection.objectives.SetObjective`) of every pair of removable blocks
(first and last protected: 378 pairs on SmolLM2-135M, 120 on Gemma-3-270M), and
:func:`~hf_layerswap.selection.search.search_select` at n = 2 with its default allowance
(SLEB's schedule) on the same prompts, with its own evaluator. Recorded: the optimum and
its value, the search's set, value and candidate sets, SLEB's count of candidate sets for
n = 2 (U + U - 1), the rank of the search's set among all pairs, and the seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
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
from hf_layerswap.utils.jsonio import write_json_atomic, write_text_atomic  # noqa: E402
from hf_layerswap.models import BUNDLED, load_model  # noqa: E402
from hf_layerswap.layerplan import num_blocks  # noqa: E402
from hf_layerswap.scoring import score_layers  # noqa: E402
from hf_layerswap.selection.objectives import SetObjective  # noqa: E402
from hf_layerswap.selection.search import search_select  # noqa: E402
from wikitext import wikitext_calibration  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PAGE = RESULTS / "search_optimum.md"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(BUNDLED))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--render-only", action="store_true", help="write the page from the stored JSON only")
    args = p.parse_args(argv)
    if not args.render_only:
        if args.model is None:
            p.error("--model is required unless --render-only")
        run(args, argv)
    write_text_atomic(render(), PAGE)
    return 0


def run(args, argv) -> None:
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    calib = wikitext_calibration(tok, args.num_prompts, args.seq_len)
    total = num_blocks(model)
    allowed = list(range(1, total - 1))
    t0 = time.perf_counter()
    log(f"{args.model}: swap-KL report, {calib.num_prompts} x {args.seq_len}")
    report = score_layers(model, calib, batch_size=args.batch_size, progress=False)
    t_report = time.perf_counter() - t0
    pairs = [list(c) for c in itertools.combinations(allowed, 2)]
    log(f"{args.model}: removal KL of all {len(pairs)} pairs")
    t1 = time.perf_counter()
    values = SetObjective(model, calib, "removal_kl", batch_size=args.batch_size)(pairs)
    t_all = time.perf_counter() - t1
    order = sorted(range(len(pairs)), key=lambda k: (values[k], pairs[k]))
    log(f"{args.model}: search at n = 2")
    t2 = time.perf_counter()
    rec = search_select(report, 2, model=model, calibration=calib, batch_size=args.batch_size)[2]
    t_search = time.perf_counter() - t2
    rank = 1 + sum(1 for v in values if v < rec["value"])
    u = len(allowed)
    out = {
        "model": args.model, "command": command_line("search_optimum.py", argv), "threads": args.threads,
        "calibration": {"num_prompts": calib.num_prompts, "seq_len": args.seq_len, "hash": calib.content_hash},
        "num_blocks": total, "removable": u, "sets": len(pairs),
        "optimum": {"removed": pairs[order[0]], "value": values[order[0]]},
        "second": {"removed": pairs[order[1]], "value": values[order[1]]},
        "search": {"removed": rec["selected"], "value": rec["value"], "rank": rank,
                   "evaluator_calls": rec["total_cost"]["evaluator_calls"],
                   "forward_passes": rec["total_cost"]["forward_passes"],
                   "protocol_sets": rec["protocol_sets"]},
        "sleb_sets": u + (u - 1),
        "seconds": {"report": t_report, "all_pairs": t_all, "search": t_search},
    }
    write_json_atomic(out, RESULTS / f"search-optimum-{args.model}.json")
    log(f"{args.model}: optimum {out['optimum']}, search {rec['selected']} {rec['value']} (rank {rank}), "
        f"{out['search']['evaluator_calls']} sets vs SLEB {out['sleb_sets']}")


def render() -> str:
    rows = []
    for path in sorted(RESULTS.glob("search-optimum-*.json")):
        r = json.loads(path.read_text(encoding="utf-8"))
        s, o = r["search"], r["optimum"]
        gap = (s["value"] / o["value"] - 1) * 100 if o["value"] > 0 and math.isfinite(s["value"]) else float("nan")
        rows.append(
            f"| {r['model']} | {r['calibration']['num_prompts']} x {r['calibration']['seq_len']} | {r['sets']} | "
            f"{o['removed']} {o['value']:.4f} | {s['removed']} {s['value']:.4f} | {s['rank']} | {gap:+.1f}% | "
            f"{s['evaluator_calls']} | {r['sleb_sets']} | {r['seconds']['all_pairs']:.0f} s / {r['seconds']['search']:.0f} s |"
        )
    lines = [
        "# The search against the exhaustive optimum (n = 2)",
        "",
        "The search's set at n = 2 (`strategy=\"search\"`, default objective: joint removal KL in nats on the",
        "calibration prompts, default allowance: SLEB's schedule) against the best of every pair of",
        "removable blocks (first and last protected), each pair's removal KL on the same prompts.",
        "Calibration: WikiText-2 validation, variant `sections`; the swap-KL report of both protocols",
        "on adjacent pairs. *rank*: the search's set among all pairs (1 = the optimum);",
        "*sets*: candidate sets the search scored (budget 1's sweep included) against SLEB's for n = 2.",
        "One torch thread on a shared, loaded 2-core CPU: the seconds are noisy.",
        "",
        "| model | calibration | pairs | optimum | search | rank | above optimum | search sets | SLEB sets | seconds (all pairs / search) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Command (one model at a time; `--render-only` rewrites this page from the JSON beside it):",
        "",
        "```",
        "python benchmarks/search_optimum.py --model smollm2-135m",
        "python benchmarks/search_optimum.py --model gemma3-270m",
        "```",
        "",
    ]
    if not rows:
        lines.insert(11, "| (no run stored) | | | | | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
