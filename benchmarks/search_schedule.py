"""The search's default allowance (SLEB's schedule) rerun on the quality runs' calibration.

Command (one CPU thread per model; writes benchmarks/results/search-schedule-<model>.json,
read by ``benchmarks/scale.py --render-only`` for scale.md):

    python benchmarks/search_schedule.py --model smollm2-135m
    python benchmarks/search_schedule.py --model gemma3-270m

It rebuilds the calibration of ``benchmarks/quality.py`` exactly (WikiText-2 validation,
variant ``sections``, the stored run's prompt count and length: 16 x 128; its content hash
is checked against the stored quality run), loads
that run's swap-KL reports (both protocols, adjacent pairs, as the run's ``search``
criterion read them) and runs :func:`hf_layerswap.selection.search_select` with its
default allowance for budgets 1..6. Per n it records the selected set, its removal KL
(``float.hex`` too), the cumulative evaluator calls and forward passes, and the stored
run's set and value. A set that differs from the stored one gets its perplexity under the
quality page's contract (WikiText-2 test, first 5,000 words, window 512, stride 256, a
deep copy with the blocks removed: what ``quality.py`` runs), unless the stored run already
evaluated that set.
"""

from __future__ import annotations

import argparse
import json
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
from hf_layerswap.comparison import evaluate_removed, merge_reports  # noqa: E402
from hf_layerswap.utils.jsonio import write_json_atomic  # noqa: E402
from hf_layerswap.models import BUNDLED_MODELS, load_model  # noqa: E402
from hf_layerswap.scoring.protocols import PROTOCOLS  # noqa: E402
from hf_layerswap.scoring.report import SwapReport, set_key  # noqa: E402
from hf_layerswap.selection.criterion import adjacent_report  # noqa: E402
from hf_layerswap.selection.search import search_select  # noqa: E402
from wikitext import wikitext_calibration  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
EVALUATION = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(BUNDLED_MODELS), required=True)
    p.add_argument("--budgets", type=int, default=6, help="search budgets 1..this")
    p.add_argument("--num-prompts", type=int, default=None, help="default: the stored quality run's")
    p.add_argument("--seq-len", type=int, default=None, help="default: the stored quality run's")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-ppl", action="store_true", help="skip the perplexity of changed sets")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    stored = json.loads((RESULTS / f"quality-{args.model}.json").read_text())
    spec = stored["comparison"]["calibration"]
    args.num_prompts, args.seq_len = args.num_prompts or spec["num_prompts"], args.seq_len or spec["seq_len"]
    model, tok = load_model(args.model)
    calib = wikitext_calibration(tok, args.num_prompts, args.seq_len)
    if calib.content_hash != stored["fingerprint"]["calibration"]:
        raise SystemExit(f"calibration hash {calib.content_hash[:12]} differs from the stored quality run's "
                         f"{stored['fingerprint']['calibration'][:12]}: not the same prompts")
    # what compare_criteria hands the search criterion: the protocols' reports merged, adjacent pairs
    report = adjacent_report(merge_reports(*[SwapReport.from_dict(stored["reports"][p]) for p in PROTOCOLS]))
    budgets = list(range(1, args.budgets + 1))
    log(f"{args.model}: search n = 1..{args.budgets}, calibration {calib.num_prompts} x {args.seq_len}")
    out = {"model": args.model, "threads": args.threads, "calibration": calib.content_hash,
           "num_prompts": args.num_prompts, "seq_len": args.seq_len, "seconds": None,
           "command": command_line("search_schedule.py", argv), "allowances": None, "budgets": {}}
    path = RESULTS / f"search-schedule-{args.model}.json"
    t0 = time.perf_counter()

    def keep(n, rec):  # each budget as it finishes: a run stopped early keeps what it has
        out["budgets"][str(n)] = _row(rec, stored["criteria"]["search"][str(n)])
        out["allowances"], out["seconds"] = rec["allowances"], time.perf_counter() - t0
        row = out["budgets"][str(n)]
        log(f"n = {n}: {row['removed']} {row['value']:.6f} (stored {row['stored']['removed']} "
            f"{row['stored']['value']:.6f}), {row['evaluator_calls']} sets, {row['forward_passes']} forward passes")
        write_json_atomic(out, path)

    search_select(report, budgets, model=model, calibration=calib, batch_size=args.batch_size, on_budget=keep)
    out["seconds"] = time.perf_counter() - t0
    for n in budgets:
        row = out["budgets"][str(n)]
        if not row["same_set"] and not args.no_ppl:
            key = set_key(row["removed"])
            if key in stored["ppl"]:
                row["ppl"], row["ppl_source"] = stored["ppl"][key]["ppl"], "stored quality run"
            else:
                log(f"perplexity with removed = {row['removed']}")
                row["ppl"] = evaluate_removed(model, row["removed"], EVALUATION, tok, "matched", "copy", {}).ppl
                row["ppl_source"] = "measured here"
            row["stored"]["ppl"] = stored["ppl"][set_key(row["stored"]["removed"])]["ppl"]
            write_json_atomic(out, path)
    return 0


def _row(rec: dict, old: dict) -> dict:
    """One budget's record of the new search next to the stored run's."""
    new_set, old_set = list(rec["selected"]), list(old["removed"])
    return {"removed": new_set, "value": rec["value"], "value_hex": float(rec["value"]).hex(),
            "evaluator_calls": rec["cost"]["evaluator_calls"], "forward_passes": rec["cost"]["forward_passes"],
            "block_passes": rec["cost"]["block_passes"],
            "stored": {"removed": old_set, "value": old["details"]["value"],
                       "value_hex": float(old["details"]["value"]).hex(),
                       "evaluator_calls": old["details"]["search_cost"]["evaluator_calls"],
                       "forward_passes": old["details"]["search_cost"]["forward_passes"]},
            "same_set": new_set == old_set}


if __name__ == "__main__":
    raise SystemExit(main())
