"""The CPU cost of the engine's one KL arithmetic: swap-KL scoring of a model held in memory
with the whole vocabulary folded in as one slice of the float64 online KL
(:class:`hf_layerswap.scoring.kl.OnlineKL`, what the engine does for every head it runs)
against the former whole-vocabulary arithmetic, an fp32 ``log_softmax`` per block
(:func:`hf_layerswap.scoring.kl.kl_rows`, kept here as the baseline).

Both run in one process with ``torch.set_num_threads(1)`` (the machine is shared: CPU time is
then the work's), alternating, ``--repeats`` times each; the page gives each one's least CPU
time of ``score_layers``, their ratio, and the largest relative difference of any pair KL
between the two (the fp32 arithmetic's rounding).

Usage (from the repository root; fp32 on the CPU)::

    python benchmarks/kl_arithmetic.py --num-prompts 2 --seq-len 16
    python benchmarks/kl_arithmetic.py --render-only
"""

from __future__ import annotations

import argparse
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

FIELDS = ("replacement_ij", "replacement_ji", "interchange")


def fp32_head_phase(self, ref_hidden, hiddens, prompt_of_row, counts, bsz, done=None):
    """The former whole-vocabulary head phase (``StreamedKL.head_phase`` before the one
    arithmetic): per block of positions, the reference's fp32 log-softmax and each probe's
    :func:`kl_rows` on row blocks; float64 sums per prompt."""
    import torch

    from hf_layerswap.scoring.kl import chunk_bounds, kl_rows, row_blocks

    vocab = self.head.vocab
    self.stats["head_rows"] += ref_hidden.shape[0] * (1 + len(hiddens))
    per_row = [[] for _ in hiddens]
    for a, c in chunk_bounds(ref_hidden.shape[0], self.kl_chunk):
        ref_lp = torch.log_softmax(self.logits(ref_hidden[a:c], 0, vocab), dim=-1)
        for n, h in enumerate(hiddens):
            logits = self.logits(h[a:c], 0, vocab)
            kl = torch.empty(logits.shape[0], device=logits.device)
            for r0, r1 in row_blocks(*logits.shape, self.block_bytes):
                kl[r0:r1] = kl_rows(ref_lp[r0:r1], logits[r0:r1])
            per_row[n].append(kl)
            del logits
    self.release()
    out = []
    for parts in per_row:
        sums = torch.zeros(bsz, dtype=torch.float64)
        sums.index_add_(0, prompt_of_row, torch.cat(parts).double().cpu())
        out.append(sums / counts)
    return out


def measure(model_name: str, num_prompts: int, seq_len: int, repeats: int) -> dict:
    import torch

    import hf_layerswap as hl
    from hf_layerswap.models import bundled_checkpoint_dir, load_model
    from hf_layerswap.scoring.streamed import StreamedKL
    from wikitext import wikitext_calibration

    model, tok = load_model(bundled_checkpoint_dir(model_name), device_map=None)
    calib = wikitext_calibration(tok, num_prompts, seq_len)
    vocab = model.get_output_embeddings().weight.shape[0]
    online = StreamedKL.head_phase
    cpu = {"float64 online": [], "fp32 log_softmax": []}
    pairs = {}
    try:
        for _ in range(repeats):
            for name, phase in (("float64 online", online), ("fp32 log_softmax", fp32_head_phase)):
                StreamedKL.head_phase = phase
                c0 = time.process_time()
                report = hl.score_layers(model, calib, progress=False)
                cpu[name].append(time.process_time() - c0)
                assert report.metadata["kl_chunk_vocab"] == vocab  # the whole vocabulary in one block
                pairs[name] = [[p.i, p.j, *(getattr(p, f) for f in FIELDS)] for p in report.pairs]
    finally:
        StreamedKL.head_phase = online
    worst = max(abs(u - v) / max(abs(u), 1e-30) for x, y in zip(pairs["float64 online"], pairs["fp32 log_softmax"])
                for u, v in zip(x[2:], y[2:]))
    return {"model": model_name, "cpu_s": cpu, "max_rel": worst, "torch": torch.__version__}


def write_markdown(out: Path, stored: dict) -> None:
    lines = [
        "# The KL arithmetic's CPU cost: float64 online KL vs fp32 log-softmax",
        "",
        f"Command: `{stored['command']}`",
        "",
        f"Machine: {stored['machine']}; torch {stored['torch']}, one torch thread. fp32 models held in memory, "
        f"{stored['num_prompts']} WikiText-2 validation prompts x {stored['seq_len']} tokens, `score_layers` "
        "defaults (adjacent pairs, replacement and interchange; the whole vocabulary in one head/KL block).",
        "",
        "*float64 online*: the engine's one KL arithmetic, the whole vocabulary folded in as one slice of "
        "`OnlineKL` (float64 sums, the same as for an offloaded head read in vocabulary slices). *fp32 "
        "log_softmax*: the former whole-vocabulary arithmetic (`kl_rows` per block). Both alternate in one "
        f"process, {stored['repeats']} runs each; CPU s is each one's least `time.process_time()` of "
        "`score_layers`. *max rel* is the largest relative difference of any pair KL between the two.",
        "",
        "| model | CPU s, float64 online | CPU s, fp32 log_softmax | ratio | max rel |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in stored["rows"]:
        a, b = min(r["cpu_s"]["float64 online"]), min(r["cpu_s"]["fp32 log_softmax"])
        lines.append(f"| {r['model']} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {r['max_rel']:.1e} |")
    write_text_atomic("\n".join(lines) + "\n", out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kl_arithmetic.md"))
    ap.add_argument("--render-only", action="store_true", help="rewrite the page from the JSON beside it")
    args = ap.parse_args(argv)
    out = Path(args.out)
    state = out.with_suffix(".json")
    if not args.render_only:
        import torch

        torch.set_num_threads(1)
        rows = [measure(m, args.num_prompts, args.seq_len, args.repeats) for m in args.models]
        write_json_atomic({"command": command_line("kl_arithmetic.py", argv), "machine": f"{platform.machine()}, cpu",
                           "torch": rows[0]["torch"], "num_prompts": args.num_prompts, "seq_len": args.seq_len,
                           "repeats": args.repeats, "rows": rows}, state)
    write_markdown(out, json.loads(state.read_text(encoding="utf-8")))


if __name__ == "__main__":
    main()
