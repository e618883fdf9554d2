"""What a prune with a strategy that reads no swap-KL score saves by not scoring: ``hl.prune``
with such a strategy (Block Influence, single-removal KL, SLEB: each reads its own passes
over the model) as it runs now, scoring nothing, against the same prune with
``score_protocols=["replacement", "interchange"]``, the swap-KL scoring every prune ran
before it (both protocols, adjacent pairs), whose tables the strategy never read.

Both run in one process with ``torch.set_num_threads(1)`` (the machine is shared: CPU time is
then the work's), alternating on fresh copies of the model; the page gives per strategy the
decoder-block passes forward hooks count, the CPU time of the prune, their ratios, the
passes ``hl.estimate_cost`` predicts for each, and whether both chose the same blocks (they
must: the scores are not read). Each finished strategy is written into the JSON at once; the
same command resumes a stopped run.

Usage (from the repository root; fp32 on the CPU)::

    python benchmarks/unscored_selection.py --num-prompts 4 --seq-len 32
    python benchmarks/unscored_selection.py --render-only
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _cmdline import command_line  # noqa: E402

from hf_layerswap.utils.jsonio import write_json_atomic, write_text_atomic  # noqa: E402

BOTH = ["replacement", "interchange"]


def _counted(model, config, calib) -> tuple[int, float, list[int]]:
    """(block passes that forward hooks count, CPU seconds, removed blocks) of ``hl.prune`` on a copy of ``model``."""
    import hf_layerswap as hl
    from hf_layerswap.layerplan import decoder_blocks

    copied = copy.deepcopy(model)
    count = [0]
    for block in decoder_blocks(copied)[2]:
        block.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    c0 = time.process_time()
    result = hl.prune(copied, config, calibration=calib)
    return count[0], time.process_time() - c0, list(result.removed)


def measure(model_name: str, strategy: str, num_to_remove: int, num_prompts: int, seq_len: int) -> dict:
    import torch

    import hf_layerswap as hl
    from hf_layerswap.cost import Throughput
    from hf_layerswap.models import bundled_checkpoint_dir, load_model
    from wikitext import wikitext_calibration

    model, tok = load_model(bundled_checkpoint_dir(model_name), device_map=None)
    calib = wikitext_calibration(tok, num_prompts, seq_len)
    rates = Throughput(1e9, 1e9, 1e9, source="unit rates: only the pass counts are read")
    row = {"model": model_name, "strategy": strategy, "num_to_remove": num_to_remove, "torch": torch.__version__}
    for name, protocols in (("unscored", None), ("scored", BOTH)):
        config = hl.LayerSwapConfig(num_to_remove=num_to_remove, strategy=strategy, score_protocols=protocols,
                                    batch_size=num_prompts, progress=False)
        estimate = hl.estimate_cost(model, config, calibration=calib, throughput=rates)
        blocks, cpu, removed = _counted(model, config, calib)
        row[name] = {"block_passes": blocks, "cpu_s": round(cpu, 2), "removed": removed,
                     "estimated_block_passes": estimate.block_passes, "estimate_exact": estimate.exact,
                     "estimated_scoring_passes": estimate.phases["scoring"]["block_passes"]}
    return row


def write_markdown(out: Path, stored: dict) -> None:
    lines = [
        "# A strategy that reads no swap-KL score no longer pays for the scoring",
        "",
        f"Command: `{stored['command']}`",
        "",
        f"Machine: {stored['machine']}; torch {stored['torch']}, one torch thread. fp32 models held in memory, "
        f"{stored['num_prompts']} WikiText-2 validation prompts x {stored['seq_len']} tokens in one batch, "
        f"`hl.prune` removing {stored['num_to_remove']} blocks.",
        "",
        "*now*: the prune as it runs a strategy guided by no protocol, scoring nothing. *scored*: the same "
        "prune with `score_protocols=['replacement', 'interchange']`, the swap-KL scoring of the adjacent pairs "
        "that every prune ran before the selection, whose tables these strategies never read. Both alternate "
        "in one process on fresh copies of the model. Block passes are what forward hooks on the decoder "
        "blocks count (the estimate: `hl.estimate_cost`'s prediction, exact where marked); CPU s is "
        "`time.process_time()` of the prune. *same set*: both removed the same blocks.",
        "",
        "| model | strategy | block passes, now | block passes, scored | passes ratio | estimate now | "
        "estimate scored | CPU s, now | CPU s, scored | CPU ratio | same set |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in stored["rows"]:
        now, old = r["unscored"], r["scored"]

        def est(part):
            return f"{part['estimated_block_passes']:,}" + ("" if part["estimate_exact"] else " (bound)")

        lines.append(
            f"| {r['model']} | {r['strategy']} | {now['block_passes']:,} | {old['block_passes']:,} | "
            f"{now['block_passes'] / old['block_passes']:.3f}x | {est(now)} | {est(old)} | {now['cpu_s']:.1f} | "
            f"{old['cpu_s']:.1f} | {now['cpu_s'] / old['cpu_s']:.2f}x | "
            f"{'yes' if now['removed'] == old['removed'] else 'no'} |")
    write_text_atomic("\n".join(lines) + "\n", out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--strategies", nargs="+", default=["block_influence", "single_removal_kl", "sleb"])
    ap.add_argument("--num-to-remove", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "unscored_selection.md"))
    ap.add_argument("--render-only", action="store_true", help="rewrite the page from the JSON beside it")
    args = ap.parse_args(argv)
    out = Path(args.out)
    state = out.with_suffix(".json")
    if not args.render_only:
        import torch

        torch.set_num_threads(1)
        settings = {"command": command_line("unscored_selection.py", argv), "machine": f"{platform.machine()}, cpu",
                    "num_prompts": args.num_prompts, "seq_len": args.seq_len, "num_to_remove": args.num_to_remove}
        stored = json.loads(state.read_text(encoding="utf-8")) if state.is_file() else {}
        if any(stored.get(k) != v for k, v in settings.items() if k not in ("command", "machine")):
            stored = {}  # other settings: a run of its own
        rows = stored.get("rows", [])
        for model in args.models:
            for strategy in args.strategies:
                if any(r["model"] == model and r["strategy"] == strategy for r in rows):
                    continue  # stored by an earlier run of this command
                rows.append(measure(model, strategy, args.num_to_remove, args.num_prompts, args.seq_len))
                write_json_atomic({**settings, "torch": rows[0]["torch"], "rows": rows}, state)
    write_markdown(out, json.loads(state.read_text(encoding="utf-8")))


if __name__ == "__main__":
    main()
