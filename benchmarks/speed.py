"""Speed benchmark: naive full-forward swap-KL scoring vs the hf_layerswap engine.

For each model the adjacent sweep with both protocols (3 (L-1) probes) is scored on the
same calibration prompts (WikiText-2 validation paragraphs, ``../shared/data``) in two ways,
batch by batch and alternating which goes first (so both see the same machine load):

- **naive** (the reference scheme of the paper's scripts, written out below): for every
  probe a full forward of the model under the layer plan, the whole ``(B, T, V)``
  log-softmax kept, KL(p_M || p_probe) per real position, mean per prompt;
- **ours**: :func:`hf_layerswap.scoring.plan_kl` (prefix reuse with shared prefixes,
  vocabulary-streamed KL).

Measured in the same run: wall time, scored tokens per second, peak resident memory of
each phase (sampled every 5 ms), model calls / block forward calls / head positions, the
largest difference between the two methods' KL values, a float64 recomputation of the
naive KL on the first batch, and per-block and head timings from which the lower bound
(reference pass + every probe's suffix blocks + head) is computed. A second part measures
how the cost grows with depth L, prompts, sequence length and vocabulary size.

Peak memory of ours is also measured alone, in a fresh process on the first batch: in the
comparison process the allocator keeps memory the other method freed, which inflates the
later batches' peaks.

Running, resuming and merging are the benchmark runner's (``benchmarks/runner.py``,
``experiments/speed.toml``: the option defaults, the models and the cost-growth rows). A model is
one cell, a record of the ``models`` list of ``speed.json`` (:class:`runner.ListCellStore`)
stored after every batch, so a stopped run continues from its next batch (only with the same
settings and scoring engine: a file measured otherwise is started anew) and the cell is finished
with ours' fresh-process peak; each cost-growth row is a cell of the ``growth`` list.
``--merge-from`` first merges runs of other processes (e.g. one per model, each with its own
``--out``): of two records of one model the one with more finished batches is kept, the run then
measures what the pieces lack (a fresh-process peak, the growth rows), and the page states how
many runs were merged and the longest one. ``--render-only`` rewrites the page from the JSON.

One module on purpose: the measurements, the cells and the page share the record's fields.

Usage (from the repository root; fp32 on the CPU)::

    python benchmarks/speed.py                      # both models, 64 prompts x 128 tokens
    python benchmarks/speed.py --smoke --out /tmp/speed-smoke.md   # a tiny random model, seconds
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from hf_layerswap.calibration import CalibrationSet, build_calibration  # noqa: E402
from hf_layerswap.layerplan import apply_plan, decoder_blocks  # noqa: E402
from hf_layerswap.utils.jsonio import write_text_atomic  # noqa: E402
from _cmdline import command_line  # noqa: E402
from runner import CellStore, ListCellStore, add_runner_arguments, experiment_cells, load_experiment, merge_files, read_state, run_cells  # noqa: E402
from wikitext import wikitext_calibration  # noqa: E402
from hf_layerswap import scoring  # noqa: E402
from hf_layerswap.utils.provenance import library_versions  # noqa: E402
from hf_layerswap.scoring import Head, kl_rows, make_probes, plan_kl, row_blocks, schedule, swap_plans  # noqa: E402

#: The engine measured: a digest of the scoring package's source. Batches measured with
#: another version are not resumed (their times would mix two engines).
ENGINE = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(scoring.__file__).parent.glob("*.py")))).hexdigest()[:12]
PAGE = os.sysconf("SC_PAGE_SIZE")
#: The experiment: the option defaults ([settings]), the models, the cost-growth rows
#: (``benchmarks/experiments/speed.toml``).
EXPERIMENT = load_experiment("speed")
SETTINGS = EXPERIMENT["settings"]
GROWTH = EXPERIMENT["growth"]
#: What a stored record was measured with: a file measured otherwise is not resumed or merged.
SETTING_KEYS = ("threads", "batch_size", "engine", "num_prompts", "seq_len")
#: The run's description: a merge keeps the first file's (a run then writes its own).
HEADER = ("machine", "libraries", "started", "load_before", "load_after", "requested", "command", "calibration",
          "total_seconds", "merged_runs", "longest_run_seconds")
#: CPU seconds of the work: the main thread's with one torch thread (the RSS sampler's own
#: time excluded), the whole process's with more. Set in main().
cpu_clock = time.process_time


# ----------------------------------------------------------------------------- measurement
class PeakRSS:
    """Peak resident set size of this process while the context is active (sampled)."""

    def __init__(self, every: float = 0.005):
        self.every = every
        self.peak = 0

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * PAGE

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self._stop.wait(self.every)

    def __enter__(self):
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def adjacent_plans(num_blocks: int) -> dict:
    return swap_plans(num_blocks, 1)


@torch.no_grad()
def naive_scores(model, ids, mask, plans, *, float64_check: bool = False):
    """The naive scheme: a full forward per probe and the whole log-softmax in memory.

    Returns ``({name: (B,) float64}, model_calls, {name: (B,) float64 recomputation})``.
    """
    counts = mask.sum(dim=1).double()
    maskf = mask.double()
    ref = torch.log_softmax(model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float(), dim=-1)
    p = ref.exp()
    out, exact = {}, {"seconds": 0.0, "cpu_seconds": 0.0}
    for name, plan in plans.items():
        with apply_plan(model, plan):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        lq = torch.log_softmax(logits.float(), dim=-1)
        if float64_check:  # not part of the scheme: its time is reported and subtracted
            t, c = time.perf_counter(), cpu_clock()
            exact[name] = _float64_kl(ref, logits, maskf, counts)
            exact["seconds"] += time.perf_counter() - t
            exact["cpu_seconds"] += cpu_clock() - c
        del logits
        kl = lq.neg_().add_(ref).mul_(p).sum(dim=-1).clamp_min(0.0)  # sum_v p (log p - log q), fp32
        del lq
        out[name] = (kl.double() * maskf).sum(dim=1) / counts
    return out, 1 + len(plans), exact


def _float64_kl(ref_lp, logits, maskf, counts):
    """KL from the same fp32 logits, in float64 (position chunks to bound memory)."""
    bsz, seq, _ = logits.shape
    per = torch.zeros(bsz, seq, dtype=torch.float64)
    for t0 in range(0, seq, 16):
        lp = ref_lp[:, t0 : t0 + 16].double()
        lq = torch.log_softmax(logits[:, t0 : t0 + 16].double(), dim=-1)
        per[:, t0 : t0 + 16] = (lp.exp() * (lp - lq)).sum(dim=-1)
    return (per * maskf).sum(dim=1) / counts


#: Positions on which the per-probe KL arithmetic is timed (scaled to the batch's).
KL_TIMING_ROWS = 256


@torch.no_grad()
def block_and_head_times(model, ids, mask, reps: int = 2):
    """Mean CPU seconds of every block's forward (identity plan, this batch), of the output
    head (final norm excluded: it is inside the decoder) over the batch's real positions, and
    of one probe's KL arithmetic over those positions (the engine's whole-vocabulary KL of
    fp32 logits against reference log-probs, head excluded; timed on up to
    :data:`KL_TIMING_ROWS` positions and scaled)."""
    _, _, blocks = decoder_blocks(model)
    times = [[] for _ in blocks]
    starts = {}
    handles = []
    for k, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, k=k: starts.__setitem__(k, cpu_clock())))
        handles.append(block.register_forward_hook(lambda m, a, o, k=k: times[k].append(cpu_clock() - starts[k])))
    decoder = decoder_blocks(model)[0]
    final = {}

    def grab(module, args, output):
        final["h"] = output.last_hidden_state

    handles.append(decoder.register_forward_hook(grab))
    head = Head(model)
    head_times, kl_times = [], []
    try:
        for _ in range(reps):
            model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
            rows = final["h"][mask.bool()]
            t = cpu_clock()
            logits = head(rows)
            head_times.append(cpu_clock() - t)
            part = logits[:KL_TIMING_ROWS].float().clone()
            del logits
            ref_lp = torch.log_softmax(part, dim=-1)
            t = cpu_clock()
            for a, b in row_blocks(*part.shape):
                kl_rows(ref_lp[a:b], part[a:b])
            kl_times.append((cpu_clock() - t) * rows.shape[0] / part.shape[0])
            del part, ref_lp
    finally:
        for h in handles:
            h.remove()
    return [statistics.fmean(t) for t in times], statistics.fmean(head_times), statistics.fmean(kl_times)


def lower_bound(plans, block_t, head_t, *, shared: bool) -> float:
    """Reference pass + for every probe the blocks of its suffix (from its first changed
    slot) and the head; ``shared``: blocks run once for probes sharing a prefix."""
    _, probes, _ = make_probes(plans, len(block_t))
    total = sum(block_t) + head_t
    for probe, depth0, _ in schedule(list(probes.values()), "shared" if shared else "start"):
        total += sum(block_t[b] for b in probe.run[depth0:]) + head_t
    return total


def smoke_model_and_calibration(num_prompts: int, seq_len: int):
    """The smoke run's tiny random Gemma-3 model and random-token calibration set."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import tiny_model

    model = tiny_model("gemma3", num_blocks=4)
    ids = torch.randint(1, 128, (num_prompts, seq_len), generator=torch.Generator().manual_seed(0))
    return model, build_calibration({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def measure_fresh_peak(args, name: str) -> dict:
    """Peak RSS of ours alone on the first batch, in a new process (``--fresh-peak``):
    ``{"ours": bytes, "rss_before": bytes}``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--fresh-peak", name, "--threads", str(args.threads),
           "--num-prompts", str(args.num_prompts), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size)] + (["--smoke", "--out", args.out] if args.smoke else [])
    log(name, "peak RSS of ours alone in a fresh process")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fresh-process peak measurement of {name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fresh_peak_child(args) -> None:
    """The child of :func:`measure_fresh_peak`: load, then score the first batch with ours only."""
    if args.smoke:
        model, calib = smoke_model_and_calibration(args.num_prompts, args.seq_len)
    else:
        from hf_layerswap.models import load_model

        model, tokenizer = load_model(args.fresh_peak)
        calib = wikitext_calibration(tokenizer, args.num_prompts, args.seq_len)
    torch.set_num_threads(args.threads)
    part = subset(calib, 0, args.batch_size)
    plans = adjacent_plans(len(decoder_blocks(model)[2]))
    gc.collect()
    before = PeakRSS.now()
    with PeakRSS() as rss:
        plan_kl(model, part, plans, batch_size=args.batch_size)
    print(json.dumps({"ours": rss.peak, "rss_before": before}))


def subset(calib: CalibrationSet, lo: int, hi: int) -> CalibrationSet:
    return CalibrationSet(calib.input_ids[lo:hi], calib.attention_mask[lo:hi], f"{calib.description} [{lo}:{hi}]")


def model_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def log(*args):
    print(time.strftime("%H:%M:%S"), *args, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- main comparison
def run_model(name, model, calib, batch_size, num_batches, publish, checks=True, resume=None):
    """Naive vs ours on the first ``num_batches`` batches. ``checks``: also the float64
    recomputation of the naive KL and the first-slot-reuse timing on batch 0 (run on the
    first model only: they cost as much again and do not depend on the model). ``resume``:
    the record of an interrupted run with the same settings and engine; its batches are
    kept and the run goes on from the next one."""
    num_blocks = len(decoder_blocks(model)[2])
    plans = adjacent_plans(num_blocks)
    starts = list(range(0, calib.num_prompts, batch_size))
    rec = resume or {
        "model": name, "engine": ENGINE, "calibration": calib.description, "num_blocks": num_blocks, "vocab": Head(model).vocab, "probes": len(plans),
        "model_bytes": model_bytes(model), "rss_before": PeakRSS.now(), "num_prompts": calib.num_prompts,
        "seq_len": calib.seq_len, "real_tokens_all": calib.num_tokens, "batch_size": batch_size,
        "batches_total": len(starts), "batches_done": 0, "real_tokens": 0, "prompts_done": 0,
        "naive": {"seconds": 0.0, "cpu_seconds": 0.0, "peak_rss": 0, "model_calls": 0, "block_evaluations": 0,
                  "head_positions": 0},
        "ours": {"seconds": 0.0, "cpu_seconds": 0.0, "peak_rss": 0, "model_calls": 0, "block_evaluations": 0,
                 "head_positions": 0},
        "lower_bound": 0.0, "lower_bound_shared": 0.0, "block_seconds": [], "head_seconds": [],
        "values": {"naive": [], "ours": []},  # per batch: per probe (plan order), per prompt KL
    }
    keys = list(plans)
    if resume:
        log("resuming", name, "after", rec["batches_done"], "batches")
    naive_vals = {k: [torch.tensor(b[i], dtype=torch.float64) for b in rec["values"]["naive"]] for i, k in enumerate(keys)}
    ours_vals = {k: [torch.tensor(b[i], dtype=torch.float64) for b in rec["values"]["ours"]] for i, k in enumerate(keys)}
    for n, lo in enumerate(starts[:num_batches]):
        if n < rec["batches_done"]:
            continue
        part = subset(calib, lo, lo + batch_size)
        ids, mask = next(part.batches(batch_size))

        def ours():
            with PeakRSS() as rss:
                t, c = time.perf_counter(), cpu_clock()
                values, stats = plan_kl(model, part, plans, batch_size=batch_size)
                seconds, cpu = time.perf_counter() - t, cpu_clock() - c
            r = rec["ours"]
            r["seconds"] += seconds
            r["cpu_seconds"] += cpu
            r["peak_rss"] = max(r["peak_rss"], rss.peak)
            r["model_calls"] += stats["model_calls"]
            r["block_evaluations"] += stats["block_evaluations"]
            r["head_positions"] += stats["head_rows"]
            r.setdefault("settings", {k: stats[k] for k in ("kl_chunk_positions", "kl_chunk_vocab", "kl_streaming",
                                                              "prefix_reuse", "max_memory", "compute_dtype")})
            for k in plans:
                ours_vals[k].append(values[k])
            if n == 0:
                rec["ours_batch0_seconds"] = cpu
                rec["ours_batch0_blocks"] = stats["block_evaluations"]
            log(name, f"batch {n}: ours {seconds:.1f}s peak {rss.peak / 2**30:.2f} GiB")

        def naive():
            with PeakRSS() as rss:
                t, c = time.perf_counter(), cpu_clock()
                values, calls, exact = naive_scores(model, ids, mask, plans, float64_check=n == 0 and checks)
                seconds = time.perf_counter() - t - exact["seconds"]
                cpu = cpu_clock() - c - exact["cpu_seconds"]
            r = rec["naive"]
            r["seconds"] += seconds
            r["cpu_seconds"] += cpu
            r["peak_rss"] = max(r["peak_rss"], rss.peak)
            r["model_calls"] += calls
            r["block_evaluations"] += calls * num_blocks
            r["head_positions"] += calls * ids.numel()
            for k in plans:
                naive_vals[k].append(values[k])
            if n == 0:
                rec["float64"] = exact
            log(name, f"batch {n}: naive {seconds:.1f}s peak {rss.peak / 2**30:.2f} GiB")

        for step in ((ours, naive) if n % 2 == 0 else (naive, ours)):
            step()
        block_t, head_t, kl_t = block_and_head_times(model, ids, mask)
        rec["block_seconds"].append(block_t)
        rec["head_seconds"].append(head_t)
        rec.setdefault("kl_seconds", []).append(kl_t)
        rec["lower_bound"] += lower_bound(plans, block_t, head_t, shared=False)
        rec["lower_bound_shared"] += lower_bound(plans, block_t, head_t, shared=True)
        rec["values"]["naive"].append([naive_vals[k][n].tolist() for k in keys])
        rec["values"]["ours"].append([ours_vals[k][n].tolist() for k in keys])
        rec["batches_done"] = n + 1
        rec["prompts_done"] += ids.shape[0]
        rec["real_tokens"] += int(mask.sum())
        if n == 0:
            exact = rec.pop("float64")
            seconds = exact.pop("seconds")
            exact.pop("cpu_seconds")
            if checks:
                rec["float64_check"] = {
                    "seconds": seconds,
                    "naive": max(float(((naive_vals[k][0] - exact[k]).abs() / exact[k]).max()) for k in plans),
                    "ours": max(float(((ours_vals[k][0] - exact[k]).abs() / exact[k]).max()) for k in plans),
                }
            rec["sharing"] = {"predicted_saving_seconds": sum(block_t[i + 1] for i in range(num_blocks - 1))}
            if checks:
                c = cpu_clock()
                _, stats = plan_kl(model, part, plans, batch_size=batch_size, prefix_reuse="start")
                rec["sharing"]["start_seconds"] = cpu_clock() - c
                rec["sharing"]["start_block_evaluations"] = stats["block_evaluations"]
                log(name, f"sharing check: first-slot reuse only {rec['sharing']['start_seconds']:.1f}s")
        naive_all = {k: torch.cat(v) for k, v in naive_vals.items()}
        ours_all = {k: torch.cat(v) for k, v in ours_vals.items()}
        rec["max_rel_diff_pair"] = max(
            abs(float(ours_all[k].mean() - naive_all[k].mean())) / float(naive_all[k].mean()) for k in plans
        )
        rec["max_rel_diff_prompt"] = max(float(((ours_all[k] - naive_all[k]).abs() / naive_all[k]).max()) for k in plans)
        rec["kl_range"] = [min(float(v.mean()) for v in ours_all.values()), max(float(v.mean()) for v in ours_all.values())]
        publish(rec)
    publish(rec)  # also when every batch was stored already
    return rec


# ----------------------------------------------------------------------------- growth
def growth_row(label, model, calib, plans, batch_size, *, naive=True):
    row = {"label": label, "probes": len(plans), "num_prompts": calib.num_prompts, "seq_len": calib.seq_len,
           "num_blocks": len(decoder_blocks(model)[2]), "vocab": Head(model).vocab}
    with PeakRSS() as rss:
        c = cpu_clock()
        _, stats = plan_kl(model, calib, plans, batch_size=batch_size)
        row["ours_seconds"] = cpu_clock() - c
    row["ours_peak_rss"] = rss.peak
    row["ours_block_evaluations"] = stats["block_evaluations"]
    if naive:
        c = cpu_clock()
        for ids, mask in calib.batches(batch_size):
            naive_scores(model, ids, mask, plans)
        row["naive_seconds"] = cpu_clock() - c
    block_t, head_t, _ = block_and_head_times(model, *next(calib.batches(batch_size)))
    row["block_seconds_mean"] = statistics.fmean(block_t)
    row["head_seconds"] = head_t
    log("growth", label, f"ours {row['ours_seconds']:.1f}s", f"naive {row.get('naive_seconds', float('nan')):.1f}s")
    return row


def random_llama(vocab, num_blocks, like):
    from transformers import AutoModelForCausalLM, LlamaConfig

    c = like.config
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      num_hidden_layers=num_blocks, tie_word_embeddings=True, max_position_embeddings=2048)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def growth_cells(load, batch_size: int, seq_len: int) -> list[tuple[str, object]]:
    """The cells of the cost-growth table (``[growth]`` of the experiment), in the page's order:
    ``(label, measure)``, ``measure()`` giving the row. ``load()`` gives the growth model and its
    tokenizer (loaded on the first row measured, so a run with every row stored loads nothing)."""
    from hf_layerswap.surgery import remove_layers

    blocks, cells = GROWTH["blocks"], []

    def first_blocks(label):
        model, tokenizer = load()
        small = remove_layers(copy.deepcopy(model), list(range(blocks, len(decoder_blocks(model)[2]))))
        return growth_row(label, small, wikitext_calibration(tokenizer, batch_size, seq_len), adjacent_plans(blocks),
                          batch_size)

    def prompts_row(label, prompts):
        model, tokenizer = load()
        full = len(decoder_blocks(model)[2])
        sample = {k: v for k, v in adjacent_plans(full).items() if k[1] in (full // 2, full // 2 + 1)}
        return growth_row(label, model, wikitext_calibration(tokenizer, prompts, seq_len), sample, batch_size,
                          naive=False)

    def short_row(label):
        model, tokenizer = load()
        return growth_row(label, model, wikitext_calibration(tokenizer, batch_size, seq_len // GROWTH["seq_len_divisor"]),
                          adjacent_plans(len(decoder_blocks(model)[2])), batch_size)

    def vocab_row(label, vocab):
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
        part = build_calibration({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return growth_row(label, random_llama(vocab, GROWTH["vocab_blocks"], load()[0]), part,
                          adjacent_plans(GROWTH["vocab_blocks"]), batch_size)

    cells.append((f"L = {blocks} (first {blocks} blocks)", first_blocks))
    for k in GROWTH["prompts"]:
        label = f"prompts = {k * batch_size} (6 probes)"
        cells.append((label, lambda label, p=k * batch_size: prompts_row(label, p)))
    cells.append((f"T = {seq_len // GROWTH['seq_len_divisor']}", short_row))
    for vocab in GROWTH["vocab"]:
        label = f"V = {vocab} (random weights, L = {GROWTH['vocab_blocks']})"
        cells.append((label, lambda label, v=vocab: vocab_row(label, v)))
    return [(label, lambda label=label, measure=measure: measure(label)) for label, measure in cells]


def run_growth(store: ListCellStore, load, batch_size: int, seq_len: int) -> list[dict]:
    """Measure the rows of the cost-growth table that ``store`` lacks (the runner's cells,
    stored as the ``growth`` list); returns every row."""
    def measure(cell) -> dict:
        row = cell()
        gc.collect()
        return row

    run_cells(store, growth_cells(load, batch_size, seq_len), measure, tag="speed",
              describe=lambda row: f"ours {row['ours_seconds']:.1f}s")
    return store.records()


# ----------------------------------------------------------------------------- report
def gib(x):
    return f"{x / 2**30:.2f} GiB"


def write_markdown(path: Path, command: str, results: dict) -> None:
    models = [r for r in results["models"] if r.get("batches_done")]
    lines = [
        "# Scoring speed: naive full-forward vs hf_layerswap",
        "",
        "```",
        command,
        "```",
        "",
        f"Machine: {results['machine']}; {results['threads']} torch threads, fp32. Libraries: {results['libraries']}. "
        + (f"Measured in {results['merged_runs'] - 1} separate run(s) (one per model or growth table; the first "
         f"started {results['started']}, the longest ran {results.get('longest_run_seconds', 0.0) / 3600:.2f} h), "
         "their records merged with `--merge-from` by a run that measures only what they lack; every record is "
         "cached, so the command above reproduces this page."
         if results.get("merged_runs") else
         f"Started {results['started']}; this file was written after {results['total_seconds'] / 3600:.2f} h."),
        "",
        "Noise: the machine is shared with other jobs running at the same time (load average "
        f"{results['load_before']} at the start, {results['load_after']} at the last write, on 2 cores). Wall "
        "times are therefore several times what an idle machine gives and vary from batch to batch. Times "
        "below are CPU seconds of the scoring thread (one torch thread), which depend much less on the other "
        "jobs (they still share caches and memory bandwidth); naive and ours run on the same batch back to "
        "back, alternating which goes first, and the lower bound is timed on the same batch right after.",
        "",
        "Calibration: " + (results.get("calibration") or next((r["calibration"] for r in models if r.get("calibration")), "?"))
        + ".",
        "",
        "## Adjacent sweep, both protocols (3 (L-1) probes)",
        "",
        "| | " + " | ".join(r["model"] for r in models) + " |",
        "|---|" + "---|" * len(models),
    ]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in models) + " |")

    def blk(r):
        return statistics.fmean(statistics.fmean(b) for b in r["block_seconds"])

    row("blocks L / vocabulary V / probes", lambda r: f"{r['num_blocks']} / {r['vocab']:,} / {r['probes']}")
    row("calibration set: prompts x tokens (real tokens)",
        lambda r: f"{r['num_prompts']} x {r['seq_len']} ({r['real_tokens_all']:,})")
    row("compared on (real tokens)", lambda r: f"{r['batches_done']} of {r['batches_total']} batches of "
        f"{r['batch_size']}: the first {r['prompts_done']} prompts ({r['real_tokens']:,})")
    row("naive: CPU time (wall time)", lambda r: f"{r['naive']['cpu_seconds']:.0f} s ({r['naive']['seconds']:.0f} s)")
    row("ours: CPU time (wall time)", lambda r: f"{r['ours']['cpu_seconds']:.0f} s ({r['ours']['seconds']:.0f} s)")
    row("**speed-up, naive / ours, CPU time** (target >= 1.6)",
        lambda r: f"**{r['naive']['cpu_seconds'] / r['ours']['cpu_seconds']:.2f}x**")
    row("speed-up, wall time", lambda r: f"{r['naive']['seconds'] / r['ours']['seconds']:.2f}x")
    row("scored tokens per CPU second (real tokens x probes / s), naive",
        lambda r: f"{r['real_tokens'] * r['probes'] / r['naive']['cpu_seconds']:,.0f}")
    row("scored tokens per CPU second, ours", lambda r: f"{r['real_tokens'] * r['probes'] / r['ours']['cpu_seconds']:,.0f}")
    row("lower bound: reference + per probe its suffix blocks + head (CPU)", lambda r: f"{r['lower_bound']:.0f} s")
    row("**ours / lower bound** (target <= 1.2)", lambda r: f"**{r['ours']['cpu_seconds'] / r['lower_bound']:.2f}**")
    row("lower bound with shared prefixes", lambda r: f"{r['lower_bound_shared']:.0f} s")
    row("KL arithmetic of one probe per batch, head excluded (CPU)",
        lambda r: f"{statistics.fmean(r['kl_seconds']):.3f} s" if kl_measured(r) else "not measured")
    row("ours / (lower bound + every probe's KL arithmetic)", lambda r: f"{r['ours']['cpu_seconds'] / kl_bound(r):.2f}"
        if kl_measured(r) else "not measured")
    row("naive / lower bound: the most any prefix reuse can gain",
        lambda r: f"{r['naive']['cpu_seconds'] / r['lower_bound']:.2f}x")
    row("mean block / head CPU time per batch", lambda r: f"{blk(r):.3f} s / {statistics.fmean(r['head_seconds']):.3f} s")
    row("head / block", lambda r: f"{statistics.fmean(r['head_seconds']) / blk(r):.1f}")
    row("model size (fp32 weights)", lambda r: gib(r["model_bytes"]))
    row("RSS before scoring", lambda r: gib(r["rss_before"]))
    row("peak RSS, naive", lambda r: gib(r["naive"]["peak_rss"]))
    row("peak RSS, ours, in the comparison process (max over batches)", lambda r: gib(r["ours"]["peak_rss"]))
    row("**peak RSS, ours alone in a fresh process, first batch** (target: under model + 1.5 GiB)",
        lambda r: f"**{gib(ours_peak(r))}** ({'<=' if ours_peak(r) <= r['model_bytes'] + 1.5 * 2**30 else '>'} "
        f"{gib(r['model_bytes'] + 1.5 * 2**30)})" if "fresh_peak" in r else "not measured")
    row("model calls, naive / ours", lambda r: f"{r['naive']['model_calls']} / {r['ours']['model_calls']}")
    row("block forward calls, naive / ours",
        lambda r: f"{r['naive']['block_evaluations']:,} / {r['ours']['block_evaluations']:,}")
    row("head positions, naive / ours", lambda r: f"{r['naive']['head_positions']:,} / {r['ours']['head_positions']:,}")
    row("max rel. KL difference naive vs ours, probe means (target <= 1e-5)", lambda r: f"{r['max_rel_diff_pair']:.1e}")
    row("max rel. KL difference naive vs ours, single prompts", lambda r: f"{r['max_rel_diff_prompt']:.1e}")
    row("batch 0: max rel. error vs float64 KL of the naive logits, naive / ours",
        lambda r: f"{r['float64_check']['naive']:.1e} / {r['float64_check']['ours']:.1e}" if "float64_check" in r
        else "not run (first model only, or --no-checks)")
    row("probe KL range (nats)", lambda r: f"{r['kl_range'][0]:.3g} .. {r['kl_range'][1]:.3g}")
    row("our settings", lambda r: ", ".join(f"{k}={v}" for k, v in r["ours"]["settings"].items()))

    lines += ["", "### Sharing prefixes beyond the first changed slot (batch 0)", "",
              "| model | blocks run: first-slot reuse / shared | ours, shared (CPU s) | first-slot reuse only (CPU s) | "
              "saving predicted from block timings (CPU s) |", "|---|---|---|---|---|"]
    for r in models:
        sh = r["sharing"]
        start_blocks = sh.get("start_block_evaluations", r["ours_batch0_blocks"] + r["num_blocks"] - 1)
        start_seconds = f"{sh['start_seconds']:.1f}" if "start_seconds" in sh else "not run"
        lines.append(
            f"| {r['model']} | {start_blocks} / {r['ours_batch0_blocks']} | "
            f"{r['ours_batch0_seconds']:.1f} | {start_seconds} | {sh['predicted_saving_seconds']:.2f} |"
        )
    if results.get("growth"):
        lines += ["", f"## How the cost grows ({results.get('growth_model')} unless noted; one batch of "
                  f"{results['batch_size']} prompts unless noted)", "",
                  "| setting | L | V | prompts x T | probes | ours (CPU s) | naive (CPU s) | naive / ours | block (CPU s) | "
                  "head (CPU s) | ours peak RSS |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in results["growth"]:
            naive = g.get("naive_seconds")
            cells = [g["label"], str(g["num_blocks"]), f"{g['vocab']:,}", f"{g['num_prompts']} x {g['seq_len']}",
                     str(g["probes"]), f"{g['ours_seconds']:.1f}", f"{naive:.1f}" if naive else "-",
                     f"{naive / g['ours_seconds']:.2f}x" if naive else "-", f"{g['block_seconds_mean']:.3f}",
                     f"{g['head_seconds']:.3f}", gib(g["ours_peak_rss"])]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Findings", "", *findings(results, models), ""]
    write_text_atomic("\n".join(lines), path)


def ours_peak(r: dict) -> int:
    """Peak RSS of ours held against the memory target: alone in a fresh process where
    measured, else the comparison process's maximum."""
    return r["fresh_peak"]["ours"] if "fresh_peak" in r else r["ours"]["peak_rss"]


def kl_measured(r: dict) -> bool:
    """The KL arithmetic was timed on every batch of the record."""
    return len(r.get("kl_seconds", [])) == r["batches_done"]


def kl_bound(r: dict) -> float:
    """The lower bound plus the KL arithmetic every probe does on every batch (CPU s)."""
    return r["lower_bound"] + r["probes"] * sum(r["kl_seconds"])


def findings(results: dict, models: list[dict]) -> list[str]:
    """Each target of the benchmark, met or missed and by how much, computed from the numbers."""
    out = []
    for r in models:
        naive, ours = r["naive"]["cpu_seconds"], r["ours"]["cpu_seconds"]
        speedup, bound, best = naive / ours, ours / r["lower_bound"], naive / r["lower_bound"]
        head_blocks = statistics.fmean(r["head_seconds"]) / statistics.fmean(
            statistics.fmean(b) for b in r["block_seconds"])
        limit = r["model_bytes"] + 1.5 * 2**30

        def verdict(ok, miss):
            return "met" if ok else f"missed by {miss:.0%}" if miss >= 0.01 else f"missed by {miss:.1%}"

        out.append(
            f"- **{r['model']}** (compared on {r['batches_done']} of {r['batches_total']} batches, "
            f"{r['real_tokens']:,} real tokens): ours is **{speedup:.2f}x** faster than naive in CPU time "
            f"(target 1.6x: {verdict(speedup >= 1.6, 1 - speedup / 1.6)}). The most any prefix reuse can gain on "
            f"this model is naive / lower bound = {best:.2f}x: every probe still runs the blocks after its first "
            f"changed slot and the LM head on every position, and the head alone costs {head_blocks:.1f} blocks "
            f"(vocabulary {r['vocab']:,}). Ours / lower bound = **{bound:.2f}** (target 1.2: "
            f"{verdict(bound <= 1.2, bound / 1.2 - 1)}). Peak RSS {gib(ours_peak(r))}"
            + (" (ours alone in a fresh process)" if "fresh_peak" in r else "")
            + f" against model + 1.5 GiB = {gib(limit)} ({verdict(ours_peak(r) <= limit, ours_peak(r) / limit - 1)})"
            + (f"; in the comparison process it reached {gib(r['ours']['peak_rss'])}, memory the naive scheme "
               "freed being kept by the allocator" if r["ours"]["peak_rss"] > 1.02 * ours_peak(r) else "")
            + ". "
            f"Largest relative KL difference from naive: {r['max_rel_diff_prompt']:.1e} per prompt "
            f"(target 1e-5: {verdict(r['max_rel_diff_prompt'] <= 1e-5, r['max_rel_diff_prompt'] / 1e-5 - 1)})."
        )
        if kl_measured(r) and ours > r["lower_bound"]:
            kl = r["probes"] * sum(r["kl_seconds"])
            out[-1] += (
                f" The bound leaves out the KL arithmetic each probe does over the whole vocabulary (naive does it "
                f"too): {kl:.0f} s of CPU time, against ours' {ours - r['lower_bound']:.0f} s above the bound; "
                f"ours / (bound + KL arithmetic) = {ours / kl_bound(r):.2f}."
            )
    missing = [m for m in results.get("requested", []) if m not in {r["model"] for r in models}]
    if missing:
        out.append(f"- Not measured in this run (stopped before they finished a batch): {', '.join(missing)}.")
    if not results.get("growth"):
        out.append("- The cost-growth table was not run (it runs after all models).")
    prompts = sorted((g for g in results.get("growth", []) if g["label"].startswith("prompts =")),
                     key=lambda g: g["num_prompts"])
    if len(prompts) >= 2:
        first, last = prompts[0], prompts[-1]
        peaks = [g["ours_peak_rss"] for g in prompts]
        out.append(
            f"- Growth with the calibration set ({results.get('growth_model')}, same 6 probes): "
            f"{last['num_prompts'] // first['num_prompts']}x the prompts ({first['num_prompts']} -> "
            f"{last['num_prompts']}) costs {last['ours_seconds'] / first['ours_seconds']:.1f}x the CPU time, while "
            f"ours' peak RSS stays within {gib(min(peaks))} - {gib(max(peaks))}: memory does not grow with the "
            "number of prompts beyond one batch."
        )
    return out


def model_key(record: dict) -> str:
    """The cell key of a model record (the ``models`` list of ``speed.json``)."""
    return record["model"]


def growth_key(row: dict) -> str:
    """The cell key of a cost-growth row (the ``growth`` list)."""
    return row["label"]


def batches_done(record: dict) -> int:
    """How far a model's cell has got: its finished batches (a merge keeps the further record)."""
    return record.get("batches_done", 0)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=[c["model"] for c in experiment_cells(EXPERIMENT)["models"]])
    ap.add_argument("--num-prompts", type=int, default=SETTINGS["num_prompts"])
    ap.add_argument("--seq-len", type=int, default=SETTINGS["seq_len"])
    ap.add_argument("--batch-size", type=int, default=SETTINGS["batch_size"])
    ap.add_argument("--batches", type=int, default=None,
                    help="compare on the first N batches of the calibration set only (default: all)")
    ap.add_argument("--threads", type=int, default=SETTINGS["threads"],
                    help="torch threads (1: CPU time is the main thread's, robust to other jobs on the machine)")
    ap.add_argument("--no-growth", action="store_true", help="skip the cost-growth table")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random model, few prompts (checks the script); needs --out")
    ap.add_argument("--out", default=None, help="Markdown page; its JSON goes beside it "
                    "(default: benchmarks/results/speed.md; a smoke run must name another)")
    ap.add_argument("--no-checks", action="store_true",
                    help="skip the batch-0 float64 recomputation and first-slot-reuse timing (default: run them "
                         "on the first model)")
    add_runner_arguments(ap)  # --render-only; --merge-from: runs of other models (same settings and engine)
    ap.add_argument("--fresh-peak", default=None, metavar="MODEL", help=argparse.SUPPRESS)
    return ap


def merge_pieces(path: Path, sources, settings: dict | None) -> None:
    """``--merge-from``: the records of runs in other processes (e.g. one per model, each with its
    own ``--out``) into ``path`` by the runner: a model's record with more finished batches replaces
    one with fewer, a record or growth row stored with different values at the same point is
    refused. ``settings`` (a run, not ``--render-only``): each piece must have been measured with
    them, and the page's facts of a merged run are recorded (the runs merged, the first start, the
    longest run).

    Raises:
        SystemExit: a missing piece, or one measured with other settings or another engine.
    """
    pieces = []
    for source in sources:
        if not Path(source).is_file():
            raise SystemExit(f"--merge-from {source}: no such file (the JSON beside another run's --out page)")
        pieces.append(read_state(Path(source), "--merge-from results file"))
        measured = {k: pieces[-1].get(k) for k in SETTING_KEYS}
        if settings is not None and measured != settings:
            raise SystemExit(f"--merge-from {source}: measured with {measured}, not this run's {settings}")
    merge_files(path, sources, union=(), first=HEADER, keyed={"models": model_key, "growth": growth_key},
                progress={"models": batches_done})
    if settings is not None:
        def facts(state):
            state["started"] = min([state["started"], *(p["started"] for p in pieces)])
            state["longest_run_seconds"] = max([state.get("longest_run_seconds", 0.0),
                                                *(float(p.get("total_seconds", 0.0)) for p in pieces)])
            state["merged_runs"] = 1 + len(sources)

        CellStore(path, fresh=dict).update(facts)
    log("merged", len(sources), "run(s) into", path.name)


def open_stores(path: Path, args, header: dict) -> tuple[ListCellStore, ListCellStore]:
    """The model cells and the growth cells of ``path`` (one file; both stores re-read it before
    each write). A file measured with other settings or another engine is started anew."""
    def model_done(record: dict) -> bool:
        return "fresh_peak" in record and record["batches_done"] >= min(args.batches, record["batches_total"])

    models = ListCellStore(path, fresh=lambda: {**header, "models": []}, key=model_key, cells="models",
                           shared=True, done=model_done)
    if not path.is_file():
        pass
    elif {k: models.state.get(k) for k in SETTING_KEYS} != {k: header[k] for k in SETTING_KEYS}:
        log(f"{path.name}: measured with other settings or another engine; starting anew")
        models.update(lambda state: (state.clear(), state.update(models.fresh())))
    else:
        log("resuming: stored", ", ".join(r["model"] for r in models.records()) or "no model",
            f"and {len(models.state.get('growth', []))} growth rows")
        header["started"] = models.state["started"]
    growth = ListCellStore(path, fresh=dict, key=growth_key, cells="growth", shared=True)
    return models, growth


def main(argv=None):
    args = parser().parse_args(argv)
    if args.fresh_peak:
        fresh_peak_child(args)
        return
    if args.smoke and args.out is None:
        parser().error("--smoke needs --out (a smoke run must not replace the measured results page)")
    out = Path(args.out or REPO / "benchmarks" / "results" / "speed.md")
    args.out = str(out)
    path = out.with_suffix(".json")
    if args.render_only:
        if args.merge_from:
            merge_pieces(path, args.merge_from, None)
        stored = read_state(path, "--render-only: results file")
        write_markdown(out, stored["command"], stored)
        log("wrote", out)
        return
    if args.smoke:
        args.models = ["tiny-gemma3"]
    torch.set_num_threads(args.threads)
    global cpu_clock
    cpu_clock = time.thread_time if args.threads == 1 else time.process_time
    args.batches = args.batches or -(-args.num_prompts // args.batch_size)
    command = command_line("speed.py", argv)
    header = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "libraries": ", ".join(f"{k} {v}" for k, v in library_versions().items()),
        "started": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads, "batch_size": args.batch_size,
        "engine": ENGINE, "num_prompts": args.num_prompts, "seq_len": args.seq_len,
        "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg()), "requested": list(args.models),
        "command": command,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    models, growth = open_stores(path, args, header)
    t0 = time.perf_counter() - float(models.state.get("total_seconds", 0.0))
    models.update(lambda state: state.update(header))  # this run's command and machine; the cells are kept
    if args.merge_from:
        merge_pieces(path, args.merge_from, {k: header[k] for k in SETTING_KEYS})

    def page() -> None:
        state = models.update(lambda s: s.update({"total_seconds": time.perf_counter() - t0,
                                                  "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg())}))
        write_markdown(out, command, state)

    run_models(args, models, page)
    if not args.no_growth:
        def growth_model(state: dict) -> None:
            if state.get("growth_model") not in (None, args.models[0]):  # rows of another model: measure anew
                state.pop("growth", None)
            state["growth_model"] = args.models[0]

        models.update(growth_model)
        loaded = {}

        def load():
            if not loaded:
                from hf_layerswap.models import load_model

                loaded["model"] = load_model(args.models[0])
                torch.set_num_threads(args.threads)
            return loaded["model"]

        run_growth(growth, load, args.batch_size, args.seq_len)
    page()
    log("wrote", out)


def run_models(args, store: ListCellStore, page) -> None:
    """The model cells: naive vs ours batch by batch (each batch stored at once; a stored record
    continues from its next batch), then ours' peak memory alone in a fresh process."""
    def publish(rec: dict) -> None:
        store.put(rec["model"], rec)
        page()

    def run_one(name: str) -> dict:
        stored = store.get(name)
        if stored is None or stored["batches_done"] < min(args.batches, stored["batches_total"]):
            if args.smoke:
                model, calib = smoke_model_and_calibration(args.num_prompts, args.seq_len)
                description = "random token ids (smoke run)"
            else:
                from hf_layerswap.models import load_model

                model, tokenizer = load_model(name)
                torch.set_num_threads(args.threads)
                calib = wikitext_calibration(tokenizer, args.num_prompts, args.seq_len)
                description = calib.description
            store.update(lambda state: state.__setitem__("calibration", description))
            if stored is not None:
                stored["calibration"] = description
            log("start", name, calib.num_tokens, "real tokens")
            stored = run_model(name, model, calib, args.batch_size, args.batches, publish,
                               checks=args.smoke or (name == args.models[0] and not args.no_checks), resume=stored)
            del model
            gc.collect()
        if "fresh_peak" not in stored:
            stored["fresh_peak"] = measure_fresh_peak(args, name)
        return stored

    run_cells(store, [(name, name) for name in args.models], run_one, tag="speed",
              describe=lambda r: f"{r['batches_done']} batches")


if __name__ == "__main__":
    main()
