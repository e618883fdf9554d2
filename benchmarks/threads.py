"""Does the second core pay, and does the estimate follow the threads a run uses?

The demo's three kinds of work run on SmolLM2-135M (fp32, in memory) at 1 and at 2 torch
threads, in one process, on the same prompts:

- **scoring**: ``hl.score_layers`` (both protocols, adjacent pairs) on the embedded calibration
  prompts;
- **search**: ``hl.selection.search_select`` for budgets 1..n on that report, with the demo's
  allowance (a third of the removable blocks per budget);
- **perplexity**: ``hl.evaluate_perplexity`` under the matched contract on the first 1,000
  words of the embedded held-out text, two windows per forward (the demo's evaluation).

Each part is timed (wall: ``time.perf_counter``; CPU: ``time.process_time``, every thread of
the process) next to its prediction: the library's cost model (``hl.estimate_cost`` for the
scoring and the search, ``cost.steps.forwards_phase`` for the perplexity) priced at the rates
``hl.cost.measure_throughput`` measures at that thread count, as the demo prints it. The
thread counts alternate part by part (1 then 2, then 2 then 1) so both see the same machine
load. Each finished part is written into the JSON at once; the same command resumes.

Usage (from the repository root)::

    python benchmarks/threads.py                 # 8 prompts x 128 tokens, budgets 1..2
    python benchmarks/threads.py --render-only
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _cmdline import command_line  # noqa: E402

from hf_layerswap.utils.jsonio import write_json_atomic, write_text_atomic  # noqa: E402

PARTS = ("scoring", "search", "perplexity")


def _timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def measure(part: str, threads: int, args, model, tok, calib, report) -> dict:
    """One part at ``threads`` torch threads: wall and CPU seconds, and the prediction."""
    import torch

    import hf_layerswap as hl
    from hf_layerswap.cli import demo
    from hf_layerswap.cost.estimate import forwards_phase
    from hf_layerswap.cost.steps import ModelShape
    from hf_layerswap.layerplan import num_blocks
    from hf_layerswap.scoring.protocols import PROTOCOLS
    from hf_layerswap.selection import search_select

    torch.set_num_threads(threads)
    total = num_blocks(model)
    rates = hl.cost.measure_throughput(model, args.num_prompts, args.seq_len)
    per_budget = demo.search_allowance(total)
    if part == "scoring":
        cfg = hl.LayerSwapConfig(num_to_remove=1, strategy="greedy", num_prompts=args.num_prompts,  # both, as scored
                                 seq_len=args.seq_len, batch_size=args.num_prompts, score_protocols=list(PROTOCOLS))
        predicted = hl.estimate_cost(model, cfg, calibration=calib, throughput=rates).phases["scoring"]["seconds"]
        _, wall, cpu = _timed(lambda: hl.score_layers(model, calib, batch_size=args.num_prompts, progress=False))
    elif part == "search":
        cfg = hl.LayerSwapConfig(num_to_remove=args.top, strategy="search", num_prompts=args.num_prompts,
                                 seq_len=args.seq_len, batch_size=args.num_prompts,
                                 strategy_options={"evaluations_per_budget": per_budget})
        predicted = hl.estimate_cost(model, cfg, calibration=calib, throughput=rates).phases["selection"]["seconds"]
        _, wall, cpu = _timed(lambda: search_select(copy.deepcopy(report), list(range(1, args.top + 1)), model=model,
                                                    calibration=calib, batch_size=args.num_prompts,
                                                    evaluations_per_budget=per_budget))
    else:
        forwards, _ = demo.eval_forwards(model, None, tok, demo.DEMO_EVAL_WORDS)
        predicted = rates.seconds(forwards_phase(ModelShape(model), forwards, total))
        _, wall, cpu = _timed(lambda: hl.evaluate_perplexity(model, None, tokenizer=tok, max_words=demo.DEMO_EVAL_WORDS,
                                                             batch_size=demo.DEMO_EVAL_BATCH))
    return {"part": part, "threads": threads, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "predicted_s": round(predicted, 2), "rates": {"block_flops_per_second": rates.block_flops_per_second,
                                                          "head_flops_per_second": rates.head_flops_per_second}}


def write_markdown(out: Path, stored: dict) -> None:
    rows = {(r["part"], r["threads"]): r for r in stored["rows"]}
    lines = [
        "# One thread or two: what the second core buys, and the estimate at each",
        "",
        f"Command: `{stored['command']}`",
        "",
        f"Machine: {stored['machine']}; torch {stored['torch']}; load average before the run "
        f"{stored['load_before']}. SmolLM2-135M (fp32, in memory), {stored['num_prompts']} embedded calibration "
        f"prompts x up to {stored['seq_len']} tokens in one batch; the search over budgets 1..{stored['top']}.",
        "",
        "*speedup*: wall at 1 thread / wall at 2. *CPU ratio*: CPU seconds at 2 threads / at 1 (1.00 = the second "
        "thread does only useful work). *predicted / wall*: the library's estimate at the rates measured at that "
        "thread count, over the wall time measured.",
        "",
        "| part | wall s, 1 thread | wall s, 2 threads | speedup | CPU s, 1 | CPU s, 2 | CPU ratio | "
        "predicted / wall, 1 | predicted / wall, 2 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    sums = {1: [0.0, 0.0, 0.0], 2: [0.0, 0.0, 0.0]}
    for part in PARTS:
        one, two = rows.get((part, 1)), rows.get((part, 2))
        if one is None or two is None:
            continue
        for t, r in ((1, one), (2, two)):
            sums[t][0] += r["wall_s"]
            sums[t][1] += r["cpu_s"]
            sums[t][2] += r["predicted_s"]
        lines.append(
            f"| {part} | {one['wall_s']:.1f} | {two['wall_s']:.1f} | {one['wall_s'] / two['wall_s']:.2f}x | "
            f"{one['cpu_s']:.1f} | {two['cpu_s']:.1f} | {two['cpu_s'] / one['cpu_s']:.2f} | "
            f"{one['predicted_s'] / one['wall_s']:.2f} | {two['predicted_s'] / two['wall_s']:.2f} |")
    if all(sums[t][0] for t in (1, 2)):
        one, two = sums[1], sums[2]
        lines.append(f"| **all three** | {one[0]:.1f} | {two[0]:.1f} | {one[0] / two[0]:.2f}x | {one[1]:.1f} | "
                     f"{two[1]:.1f} | {two[1] / one[1]:.2f} | {one[2] / one[0]:.2f} | {two[2] / two[0]:.2f} |")
    write_text_atomic("\n".join(lines) + "\n", out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--top", type=int, default=2, help="the search's largest budget")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "threads.md"))
    ap.add_argument("--render-only", action="store_true", help="rewrite the page from the JSON beside it")
    args = ap.parse_args(argv)
    out = Path(args.out)
    state = out.with_suffix(".json")
    if not args.render_only:
        import torch

        import hf_layerswap as hl
        from hf_layerswap.calibration import build_calibration
        from hf_layerswap.models import bundled_checkpoint_dir, load_model

        settings = {"num_prompts": args.num_prompts, "seq_len": args.seq_len, "top": args.top}
        stored = json.loads(state.read_text(encoding="utf-8")) if state.is_file() else {}
        if any(stored.get(k) != v for k, v in settings.items()):
            stored = {}  # other settings: a run of its own
        stored.update(settings, command=command_line("threads.py", argv), torch=torch.__version__,
                      machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
                      load_before=stored.get("load_before") or round(os.getloadavg()[0], 2))
        rows = stored.setdefault("rows", [])
        model, tok = load_model(bundled_checkpoint_dir("smollm2-135m"), device_map=None)
        calib = build_calibration("embedded", tok, num_prompts=args.num_prompts, seq_len=args.seq_len)
        report = None
        for k, part in enumerate(PARTS):
            for threads in ((1, 2) if k % 2 == 0 else (2, 1)):
                if any(r["part"] == part and r["threads"] == threads for r in rows):
                    continue  # stored by an earlier run of this command
                if part == "search" and report is None:
                    torch.set_num_threads(2)
                    report = hl.score_layers(model, calib, batch_size=args.num_prompts, progress=False)
                rows.append(measure(part, threads, args, model, tok, calib, report))
                write_json_atomic(stored, state)
                print(rows[-1], flush=True)
    write_markdown(out, json.loads(state.read_text(encoding="utf-8")))


if __name__ == "__main__":
    main()
