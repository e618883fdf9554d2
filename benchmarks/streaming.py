"""Streaming benchmark: swap-KL scoring of a model held in memory vs the same model with
only a share of its weights in CPU memory and the rest offloaded to disk (accelerate's
device map, ``max_memory`` capped at 1/2, 1/4 and 1/8 of the weights), scored by the
engine's slot-major streaming (:mod:`hf_layerswap.scoring.slotmajor`: each offloaded
block read once per batch).

Every configuration runs in its own subprocess (``--worker``), so that its peak resident
set size (``resource.getrusage``, the whole process: loading included) is its own, with
``torch.set_num_threads(1)`` (the machine is shared; CPU time is then the work's). One
more subprocess per model scores the 1/4 configuration depth-first (``slot_major=False``,
probe after probe: every block call reads the block again) to show the movement
streaming saves, with ``--depth-first-rows`` (slow). One more runs the model in memory with its head taken in
the vocabulary slices an offloaded head is streamed in (the same KL arithmetic). The pair KLs of every
configuration are compared with the in-memory run's (one KL arithmetic: equal to float64 rounding), and with the
in-memory run of the same slices (bit for bit).

Targets (issue 29): streamed with 1/4 of the weights in memory at most 1.5x the in-memory
CPU time, peak RSS at most the in-memory peak less half the weights, and pair KLs equal to
the in-memory run's (<= 1e-5 relative).

Running, resuming and merging are the benchmark runner's (``benchmarks/runner.py``,
``experiments/streaming.toml``: the option defaults and the configurations): each model and
configuration is one cell, stored as one record of the ``rows`` list of the JSON
(:class:`runner.ListCellStore`, keyed by :func:`row_key`) as soon as its process ends; a rerun
with the same calibration skips a stored row; ``--merge-from`` first merges runs of other
models or configurations made elsewhere (a row stored with different values in two files is
refused).

Usage (from the repository root; fp32 on the CPU)::

    python benchmarks/streaming.py                  # both models, 4 prompts x 32 tokens
    python benchmarks/streaming.py --render-only    # rewrite the page from the JSON
    python benchmarks/streaming.py --render-only --merge-from other/streaming.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _cmdline import command_line  # noqa: E402
from runner import (  # noqa: E402
    ListCellStore,
    add_runner_arguments,
    experiment_cells,
    load_experiment,
    merge_files,
    read_state,
    run_cells,
)

from hf_layerswap.utils.jsonio import write_json_atomic, write_text_atomic  # noqa: E402

EXPERIMENT = load_experiment("streaming")
SETTINGS = EXPERIMENT["settings"]
IN_MEMORY = "in memory"  # the experiment's cap of the model loaded whole (TOML has no null)
FIELDS = ("replacement_ij", "replacement_ji", "interchange")


def rss_parts() -> dict:
    """Resident memory now, in bytes: anonymous (``RssAnon``) and file-backed (``RssFile``,
    mmapped weights among them) from ``/proc/self/status`` (Linux; empty elsewhere)."""
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key = line.split(":")[0]
                if key in ("RssAnon", "RssFile"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- one configuration
def worker(args) -> None:
    """Load, score, write one JSON record (in a fresh process)."""
    import torch

    torch.set_num_threads(1)
    import hf_layerswap as hl
    from hf_layerswap.models import bundled_checkpoint_dir, load_model
    from wikitext import wikitext_calibration

    from hf_layerswap.scoring.engine import STREAMED_HEAD_SLICES

    ckpt = bundled_checkpoint_dir(args.model)
    weights = (ckpt / "model.safetensors").stat().st_size
    with tempfile.TemporaryDirectory(prefix="offload-") as folder:
        if args.cap is None:
            model, tok = load_model(ckpt, device_map=None)
        else:
            model, tok = load_model(ckpt, max_memory={"cpu": int(args.cap * weights)}, offload_folder=folder)
        rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        calib = wikitext_calibration(tok, args.num_prompts, args.seq_len)
        options = {"slot_major": False} if args.depth_first else {}
        if args.head_slices:  # the vocabulary slices a streamed head is read in
            options["vocab_chunk"] = -(-model.get_output_embeddings().weight.shape[0] // STREAMED_HEAD_SLICES)
        c0, t0 = time.process_time(), time.perf_counter()
        report = hl.score_layers(model, calib, progress=False, **options)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    meta = report.metadata
    record = {
        "model": args.model, "cap": args.cap, "depth_first": args.depth_first, "head_slices": args.head_slices,
        "weights_bytes": weights, "kl_chunk_vocab": meta["kl_chunk_vocab"],
        "cpu_s": cpu, "wall_s": wall, "peak_rss": meta["peak_memory"]["cpu"], "peak_rss_after_load": rss_loaded,
        "slot_major": meta["slot_major"], "movement": meta["movement"], "block_evaluations": meta["block_evaluations"],
        "head_streaming": meta["head_streaming"],
        "num_blocks": report.num_blocks,
        "rss_after_scoring": rss_parts(),
        "pairs": [[p.i, p.j, *(getattr(p, f) for f in FIELDS)] for p in report.pairs],
    }
    Path(args.record).write_text(json.dumps(record))


def run_config(model: str, cap, depth_first: bool, head_slices: bool, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        record = fh.name
    cmd = [sys.executable, __file__, "--worker", "--models", model, "--record", record,
           "--num-prompts", str(args.num_prompts), "--seq-len", str(args.seq_len)]
    if cap is not None:
        cmd += ["--cap", str(cap)]
    if depth_first:
        cmd += ["--depth-first"]
    if head_slices:
        cmd += ["--head-slices"]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO)
    out = json.loads(Path(record).read_text())
    Path(record).unlink()
    log(f"{model} cap={cap} depth_first={depth_first}: {time.perf_counter() - t:.0f} s")
    return out


def _max_rel(a: list, b: list) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x[2:], y[2:]):
            worst = max(worst, abs(u - v) / max(abs(u), 1e-30))
    return worst


def configurations(depth_first_rows: bool) -> list[tuple[float | None, bool, bool]]:
    """``(cap, depth_first, head_slices)`` of each row per model, in the page's order
    (experiments/streaming.toml; cap None: the model in memory)."""
    groups = experiment_cells(EXPERIMENT)
    cells = groups["configs"] + groups["same_slices"] + (groups["depth_first"] if depth_first_rows else [])
    return [(None if c["cap"] == IN_MEMORY else float(c["cap"]), bool(c["depth_first"]), bool(c.get("head_slices")))
            for c in cells]


def row_key(row: dict) -> str:
    """The cell key of a stored row: ``model/cap/streamed`` (cap ``in-memory`` or the share;
    ``depth-first``, or ``vocabulary-slices`` for the in-memory run with a streamed head's slices)."""
    cap = "in-memory" if row["cap"] is None else f"{row['cap']:g}"
    kind = "depth-first" if row["depth_first"] else "vocabulary-slices" if row.get("head_slices") else "streamed"
    return f"{row['model']}/{cap}/{kind}"


def sort_rows(state: dict) -> None:
    """Rows in the page's order: by the state's model list, then configuration (depth-first last)."""
    models = {m: i for i, m in enumerate(state["models"])}
    configs = {c: i for i, c in enumerate(configurations(True))}
    state["rows"].sort(key=lambda r: (models.get(r["model"], len(models)),
                                      configs.get((r["cap"], r["depth_first"], bool(r.get("head_slices"))), len(configs))))


# ----------------------------------------------------------------------------- the page
def _label(r: dict) -> str:
    if r["cap"] is None:
        return f"in memory, head in vocabulary slices of {r['kl_chunk_vocab']}" if r.get("head_slices") else "in memory"
    frac = f"1/{round(1 / r['cap'])}"
    return f"{frac} of the weights, " + ("depth-first" if r["depth_first"] else "streamed")


def write_markdown(out: Path, stored: dict) -> None:
    lines = [
        "# Scoring a model larger than the memory at hand: slot-major streaming",
        "",
        f"Command: `{stored['command']}`",
        "",
        f"Machine: {stored['machine']}; torch {stored['torch']}, one torch thread per configuration "
        "(`torch.set_num_threads(1)`: the machine is shared, so CPU time is the work's own). fp32.",
        "",
        f"Calibration: {stored['num_prompts']} WikiText-2 validation prompts x {stored['seq_len']} tokens "
        "(one batch; a modest set so that the whole page runs in about a quarter of an hour), "
        "`score_layers` defaults (adjacent pairs, replacement and interchange).",
        "",
        "Each row is its own process: the model loaded in memory, or with `max_memory={'cpu': cap}` and the rest "
        "offloaded to disk by accelerate (`offload_folder`). Peak RSS is the whole process's "
        "(`resource.getrusage`, loading included). *Blocks moved* counts the decoder blocks read from the offload "
        "per batch (`movement` in the report's metadata); *max rel* is the largest relative difference of any pair "
        "KL from the in-memory run. *RSS anon / file* splits the resident memory after scoring "
        "(`/proc/self/status`): anonymous memory, and file-backed pages (the mmapped safetensors weights: an "
        "in-memory model's weights are file pages of its checkpoint, an offloaded block's while it is onloaded).",
        "",
        "What the peaks are made of (measured per phase with `/proc/self/status`): about 470 MiB is the imports "
        "(torch, transformers) before anything loads, and Gemma-3's tokenizer adds about 320 MiB of anonymous "
        "memory to every row. Loading with an offload map reads no offloaded weight. A head held in memory under "
        "an accelerate hook that does not offload it (SmolLM2 at 1/2 and 1/4: embeddings and head on the map's "
        "\"cpu\" entry) writes into the reused logit buffer like a head in memory.",
        "",
        "An offloaded head (Gemma-3-270M's tied embedding and head, 640 MiB or 62.5% of its weights, at every cap; "
        "SmolLM2's at 1/8) is never mapped whole: it is read from the offload's own storage (here the checkpoint's "
        "safetensors file) in vocabulary slices of 1/16 of the vocabulary, each slice once per head phase for all "
        "positions and probes, and the KL runs slice by slice with an online log-sum-exp in float64 "
        "(`head_streaming` in the report's metadata); the first batch's head check reads the head twice more "
        "(ours and the model's own call, which runs in the same slices); an offloaded embedding reads only the rows "
        "of the batch's ids. *Head MiB read* counts both (`head_bytes_moved` + `embedding_bytes_moved` in "
        "`movement`). The KL is one arithmetic for every head the engine runs (`OnlineKL`: float64 sums; the "
        "whole vocabulary of a head in memory is one slice), so *max rel* against the in-memory run is float64 "
        "rounding whatever the placement, cap or slices; *max rel, same slices* compares each row with the "
        "in-memory run of the same blocks (the whole vocabulary for a head in memory, the row *in memory, head in "
        "vocabulary slices* for a streamed head), bit for bit. Its CPU cost against the former whole-vocabulary "
        "fp32 `log_softmax`: [kl_arithmetic.md](kl_arithmetic.md).",
        "",
    ]
    for model in stored["models"]:
        rows = [r for r in stored["rows"] if r["model"] == model]
        base = next(r for r in rows if r["cap"] is None)
        w = base["weights_bytes"]
        lines += [f"## {model} ({base['num_blocks']} blocks, weights {w / 2**20:.0f} MiB)", "",
                  "| configuration | CPU s | CPU vs in memory | wall s | peak RSS MiB | peak RSS after load MiB "
                  "| RSS anon / file after scoring MiB | blocks moved per batch | MiB moved | head MiB read | block calls "
                  "| max rel | max rel, same slices |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        sliced = next((r for r in rows if r.get("head_slices")), None)
        for r in rows:
            mv = r["movement"]
            parts = r.get("rss_after_scoring") or {}
            anon_file = (f"{parts['RssAnon'] / 2**20:.0f} / {parts['RssFile'] / 2**20:.0f}"
                         if "RssAnon" in parts else "n/a")
            same = sliced if r["kl_chunk_vocab"] != base["kl_chunk_vocab"] else base
            head_read = (mv.get("head_bytes_moved", 0) + mv.get("embedding_bytes_moved", 0)) / 2**20
            lines.append(
                f"| {_label(r)} | {r['cpu_s']:.1f} | {r['cpu_s'] / base['cpu_s']:.2f}x | {r['wall_s']:.1f} "
                f"| {r['peak_rss'] / 2**20:.0f} | {r['peak_rss_after_load'] / 2**20:.0f} "
                f"| {anon_file} | {', '.join(map(str, mv['block_onloads_per_batch']))} | {mv['bytes_moved'] / 2**20:.0f} "
                f"| {head_read:.0f} | {r['block_evaluations']} | {_max_rel(base['pairs'], r['pairs']):.1e} "
                f"| {'n/a' if same is None else format(_max_rel(same['pairs'], r['pairs']), '.1e')} |")
        quarter = next((r for r in rows if r["cap"] == 0.25 and not r["depth_first"]), None)
        if quarter is not None:
            ratio = quarter["cpu_s"] / base["cpu_s"]
            saved = (base["peak_rss"] - quarter["peak_rss"]) / w
            rel = _max_rel(base["pairs"], quarter["pairs"])
            lines += ["", f"Targets at 1/4 of the weights: CPU time {ratio:.2f}x the in-memory run (target <= 1.5x: "
                      f"{'met' if ratio <= 1.5 else 'missed'}); peak RSS {saved:.0%} of the weights below the "
                      f"in-memory peak (target >= 50%: {'met' if saved >= 0.5 else 'missed'}); pair KLs within "
                      f"{rel:.1e} relative of the in-memory run's (target <= 1e-5: {'met' if rel <= 1e-5 else 'missed'}; "
                      f"the largest *max rel* of any row: {max(_max_rel(base['pairs'], r['pairs']) for r in rows):.1e}). "
                      f"Head at 1/4: {quarter.get('head_streaming', 'in memory')}."]
        lines.append("")
    write_text_atomic("\n".join(lines) + "\n", out)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SETTINGS["models"]))
    ap.add_argument("--num-prompts", type=int, default=SETTINGS["num_prompts"])
    ap.add_argument("--seq-len", type=int, default=SETTINGS["seq_len"])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "streaming.md"),
                    help="Markdown page; its JSON goes beside it")
    ap.add_argument("--depth-first-rows", action="store_true",
                    help="also score the 1/4 configuration depth-first (slot_major=False): slow, for the contrast")
    add_runner_arguments(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cap", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--depth-first", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--head-slices", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)
    return ap


def merge(state_path: Path, sources: list[Path]) -> dict:
    """``--merge-from``: rows measured elsewhere into ``state_path``; the first file's command,
    machine and torch are kept, the models listed in any; a row stored with different values
    in two files, or another calibration, is refused (:class:`runner.MergeConflict`)."""
    merged = merge_files(state_path, sources, union=("models",), keyed={"rows": row_key},
                         first=("command", "machine", "torch"))
    sort_rows(merged)
    write_json_atomic(merged, state_path)
    return merged


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.worker:
        args.model = args.models[0]
        worker(args)
        return
    out = Path(args.out)
    state = out.with_suffix(".json")
    if args.merge_from:
        merge(state, args.merge_from)
    if args.render_only:
        write_markdown(out, read_state(state, "--render-only: results file"))
        log("wrote", out)
        return
    import torch

    header = {
        "command": command_line("streaming.py", argv),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "torch": torch.__version__,
        "num_prompts": args.num_prompts, "seq_len": args.seq_len,
    }
    store = ListCellStore(state, fresh=lambda: {**header, "models": [], "rows": []}, key=row_key, cells="rows")
    if (store.state.get("num_prompts"), store.state.get("seq_len")) != (args.num_prompts, args.seq_len):
        if state.is_file():  # another calibration: a new run (the old rows do not resume)
            log(f"{state}: stored with another calibration; starting anew")
        store.state = store.fresh()
    store.state.update(header)  # the latest command; stored rows are kept
    store.state["models"] = list(dict.fromkeys([*store.state.get("models", []), *args.models]))
    cells = [(row_key({"model": m, "cap": cap, "depth_first": d, "head_slices": h}), (m, cap, d, h))
             for m in args.models for cap, d, h in configurations(args.depth_first_rows)]
    run_cells(store, cells, lambda cell: run_config(*cell, args), tag="streaming",
              describe=lambda r: f"cpu {r['cpu_s']:.1f} s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB")
    store.update(sort_rows)
    write_markdown(out, store.state)
    log("wrote", out)


if __name__ == "__main__":
    main()
