"""Peak memory of a prune above the loaded model against its working-memory budget.

The bundled SmolLM2-135M loaded in bf16 and pruned by the default path
(``LayerSwapConfig(num_to_remove=2)``: both protocols scored, the search over removal sets)
with ``max_memory`` a share of its weight bytes (default 15%) as the one working budget of
every step. Each cell runs in a fresh child process: the model is loaded, the calibration
prompts built, the peak reset (``/proc/self/clear_refs``), and the baseline taken as the
resident memory then; the peak is the child's ``resource.getrusage(RUSAGE_SELF).ru_maxrss``
at the end of the prune. The page gives the peak above the loaded model next to the budget
and the target, budget + 64 MiB (the allocator's and the libraries' slack).

``--headroom-mib H ...`` measures the ``"auto"`` budget instead, side by side in one run: the
model loaded by ``load_model(..., max_memory={"cpu": weights + H MiB})`` and pruned with
``max_memory="auto"`` (a share of what that limit leaves after the weights), next to the same
prune with the budget a share of the machine's available memory (what ``"auto"`` gave before
it read the load's limit); the rows are kept beside the budget rows.

Usage (from the repository root; on the CPU)::

    python benchmarks/memory_budget.py --num-prompts 8
    python benchmarks/memory_budget.py --num-prompts 8 --threads 1 --headroom-mib 256
    python benchmarks/memory_budget.py --render-only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _cmdline import command_line  # noqa: E402

from hf_layerswap.utils.jsonio import write_json_atomic, write_text_atomic  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MODEL = "smollm2-135m"
SLACK = 64 << 20  # what the target allows beyond the budget


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def child(share: float, num_prompts: int, seq_len: int, threads: int) -> dict:
    """One prune in this (fresh) process; the numbers of the page's row."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_layerswap as hl

    torch.set_num_threads(threads)
    path = hl.models.bundled_checkpoint_dir(MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = hl.LayerSwapConfig(num_to_remove=2, num_prompts=num_prompts, seq_len=seq_len, progress=False)
    calib = hl.build_calibration(config.calibration, tokenizer, num_prompts=num_prompts, seq_len=seq_len,
                                 seed=config.seed)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(share * weights)
    load_peak = _maxrss()
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on: loading's own peak is not the prune's
        f.write("5")
    baseline = _rss()
    result = hl.prune(model, config, tokenizer=tokenizer, calibration=calib, max_memory=budget)
    peak = _maxrss()
    meta = result.report.metadata.get("cost", {})
    return {"model": MODEL, "dtype": "bfloat16", "num_prompts": num_prompts, "seq_len": seq_len,
            "weights": weights, "share": share, "budget": budget, "baseline_rss": baseline, "load_peak": load_peak,
            "peak_rss": peak, "above": peak - baseline, "removed": list(result.removed),
            "scoring_max_memory": meta.get("max_memory"), "threads": threads}


def limit_child(headroom_mib: int, arm: str, num_prompts: int, seq_len: int, threads: int) -> dict:
    """One prune of the model loaded under ``max_memory={"cpu": weights + headroom}``: ``arm``
    "auto" with ``max_memory="auto"``, "machine" with the share of the machine's available
    memory (``device_memory_budget("cpu")``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_layerswap as hl
    from hf_layerswap.scoring.settings import device_memory_budget

    torch.set_num_threads(threads)
    path = hl.models.bundled_checkpoint_dir(MODEL)
    with torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in shape.parameters())
    limit = weights + headroom_mib * 2**20
    model, tokenizer = hl.load_model(path, dtype="bfloat16", max_memory={"cpu": limit})
    config = hl.LayerSwapConfig(num_to_remove=2, num_prompts=num_prompts, seq_len=seq_len, progress=False)
    calib = hl.build_calibration(config.calibration, tokenizer, num_prompts=num_prompts, seq_len=seq_len,
                                 seed=config.seed)
    budget = "auto" if arm == "auto" else device_memory_budget("cpu")[0]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = _rss()
    result = hl.prune(model, config, tokenizer=tokenizer, calibration=calib, max_memory=budget)
    peak = _maxrss()
    return {"model": MODEL, "dtype": "bfloat16", "num_prompts": num_prompts, "seq_len": seq_len, "weights": weights,
            "headroom": headroom_mib * 2**20, "arm": arm, "budget": result.report.metadata["max_memory"],
            "budget_source": result.report.metadata["max_memory_source"], "baseline_rss": baseline,
            "peak_rss": peak, "above": peak - baseline, "removed": list(result.removed), "threads": threads}


def _limit_section(data: dict) -> list[str]:
    """The "auto" rows (``--headroom-mib``), or nothing where none were run."""
    rows = data.get("limit_rows")
    if not rows:
        return []
    lines = [
        "## `auto` under a load's `max_memory`",
        "",
        f"Command: `{data['limit_command']}`",
        "",
        f"Machine: {data['limit_machine']}. The model loaded by `load_model(..., dtype=\"bfloat16\", "
        "max_memory={\"cpu\": weights + headroom})`, pruned as above with `max_memory=\"auto\"` (*auto*: a share "
        "of what the limit leaves after the weights) and, in the same run, with the budget a share of the "
        "machine's available memory (*machine*: what `auto` gave before it read the limit). *Within* = the "
        "peak above the loaded model stays inside the headroom the limit leaves.",
        "",
        "| model | prompts x tokens | weights MiB | headroom MiB | budget | budget MiB | baseline MiB | peak MiB "
        "| above MiB | within | above: machine / auto | removed |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---|---:|---|",
    ]
    auto = {r["headroom"]: r["above"] for r in rows if r["arm"] == "auto"}
    for r in rows:
        ratio = f"{r['above'] / auto[r['headroom']]:.2f}" if r["arm"] == "machine" and auto.get(r["headroom"]) else ""
        lines.append(
            f"| {r['model']} ({r['dtype']}) | {r['num_prompts']} x {r['seq_len']} | {_mib(r['weights'])} "
            f"| {_mib(r['headroom'])} | {r['arm']} | {_mib(r['budget'])} | {_mib(r['baseline_rss'])} "
            f"| {_mib(r['peak_rss'])} | {_mib(r['above'])} | {'yes' if r['above'] <= r['headroom'] else 'no'} "
            f"| {ratio} | {r['removed']} |")
    lines.append("")
    return lines


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def render(data: dict) -> str:
    lines = [
        "# Peak memory of a prune against its working-memory budget",
        "",
        f"Command: `{data['command']}`",
        "",
        f"Machine: {data['machine']}. The bundled {MODEL} loaded in bf16 "
        "(`from_pretrained(..., dtype=torch.bfloat16)`), pruned by the default path "
        "(`LayerSwapConfig(num_to_remove=2)`: both protocols scored, the search over removal sets) with "
        "`prune(..., max_memory=budget)`, the budget a share of the weight bytes. Each row is a fresh process: "
        "*baseline* is its resident memory once the model is loaded and the prompts built (the peak reset "
        "there through `/proc/self/clear_refs`), *peak* its `ru_maxrss` at the end of the prune, *above* "
        "the difference; the target is budget + 64 MiB.",
        "",
        "| model | prompts x tokens | weights MiB | budget | budget MiB | baseline MiB | peak MiB | above MiB "
        "| target MiB | within | removed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in data["rows"]:
        target = r["budget"] + SLACK
        lines.append(
            f"| {r['model']} ({r['dtype']}) | {r['num_prompts']} x {r['seq_len']} | {_mib(r['weights'])} "
            f"| {r['share']:.0%} | {_mib(r['budget'])} | {_mib(r['baseline_rss'])} | {_mib(r['peak_rss'])} "
            f"| {_mib(r['above'])} | {_mib(target)} | {'yes' if r['above'] < target else 'no'} "
            f"| {r['removed']} |")
    lines.append("")
    return "\n".join(lines + _limit_section(data))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--shares", type=float, nargs="+", default=[0.15],
                   help="budgets as shares of the weight bytes, one row each")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--headroom-mib", type=int, nargs="+", default=None,
                   help="measure auto instead: the model loaded with max_memory cpu = weights + this, one pair of rows each")
    p.add_argument("--arm", choices=("auto", "machine"), default="auto", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=RESULTS / "memory_budget.md")
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        row = (limit_child(args.headroom_mib[0], args.arm, args.num_prompts, args.seq_len, args.threads)
               if args.headroom_mib else child(args.shares[0], args.num_prompts, args.seq_len, args.threads))
        print(json.dumps(row))
        return 0
    store = args.out.with_suffix(".json")
    if args.headroom_mib and not args.render_only:
        import torch

        data = json.loads(store.read_text()) if store.exists() else {"command": "", "machine": "", "rows": []}
        data.update(limit_command=command_line("memory_budget.py", argv), limit_rows=[],
                    limit_machine=f"{platform.machine()}, cpu; torch {torch.__version__}, {args.threads} torch threads")
        for headroom in args.headroom_mib:
            for arm in ("auto", "machine"):
                cmd = [sys.executable, __file__, "--child", "--headroom-mib", str(headroom), "--arm", arm,
                       "--num-prompts", str(args.num_prompts), "--seq-len", str(args.seq_len),
                       "--threads", str(args.threads)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                data["limit_rows"].append(json.loads(out.strip().splitlines()[-1]))
                write_json_atomic(data, store)  # each row as it finishes
    elif not args.render_only:
        import torch

        # the budget rows replace the stored ones; the "auto" rows (--headroom-mib) are kept
        data = json.loads(store.read_text()) if store.exists() else {}
        data.update(command=command_line("memory_budget.py", argv), rows=[],
                    machine=f"{platform.machine()}, cpu; torch {torch.__version__}, {args.threads} torch threads")
        for share in args.shares:
            cmd = [sys.executable, __file__, "--child", "--shares", str(share), "--num-prompts", str(args.num_prompts),
                   "--seq-len", str(args.seq_len), "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            data["rows"].append(json.loads(out.strip().splitlines()[-1]))
            write_json_atomic(data, store)  # each row as it finishes
    data = json.loads(store.read_text())
    write_text_atomic(render(data), args.out)
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
