"""Peeling reference bounds on SmolLM2-135M and Gemma-3-270M, and over a training run.

    python benchmarks/peeling.py --threads 1
    python benchmarks/peeling.py --render-only --models smollm2-135m gemma3-270m

Writes ``benchmarks/results/peeling.md``, ``benchmarks/results/peeling_trajectory.png``,
``benchmarks/results/peeling_<model>.png`` and the JSON under ``benchmarks/results/peeling/``:
``<model>_peel.json`` (PeelReport), ``<model>_swap.json`` (SwapReport), ``<model>_seconds.json``
(wall-clock seconds per step, model identity, command, threads and load), ``trajectory.json``
(PeelTrajectory) and ``trajectory_run.json`` (training record and budgets of the trajectory).

``--render-only`` rebuilds ``peeling.md`` from those JSON files (for the models given by
``--models``) without loading a model or computing anything, so that runs made in separate
processes end up in one results file. Totals that no JSON recorded are written as "not
recorded"; the training-trajectory section is drawn from ``trajectory.json`` +
``trajectory_run.json`` (left out, with a log line, when either is missing). ``--models``
with no name runs the training trajectory alone.

Per real model (:func:`hf_layerswap.models.load_model`, fp32 dequantized GGUF weights):

1. :func:`hf_layerswap.peeling.peel` with linear references, spans 1 and 2, plus the map
   onto the final stream; references fitted on WikiText-2 validation paragraphs
   (``../shared/data/wikitext-2/valid.txt``, variant ``lines`` of ``benchmarks/wikitext.py``:
   one paragraph per prompt, not the ``sections`` the other benchmarks calibrate on), hybrids scored on WikiText-2 raw *test*
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
import shlex
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

from train_tiny import split_data, train  # noqa: E402
from wikitext import sample_paragraphs, wikitext_prompts  # noqa: E402

from hf_layerswap.utils.jsonio import write_text_atomic  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DATA = REPO.parent / "shared" / "data"
VALID = DATA / "wikitext-2" / "valid.txt"
TEST_RAW = DATA / "wikitext-2-raw" / "wiki.test.raw"
MODELS = ("smollm2-135m", "gemma3-270m")
SCRIPT = "python benchmarks/peeling.py"
#: Command of the earlier runs whose JSON does not record its own command line.
COMMAND = f"{SCRIPT} --threads 1"

#: Budgets (chosen so that the whole benchmark fits in about 15 minutes on 2 idle cores).
REAL = {
    "smollm2-135m": dict(num_prompts=48, seq_len=128, eval_prompts=16, eval_seq_len=64, batch_size=8, bootstrap=1000),
    # the 262,144-way head dominates every probe: fewer evaluation tokens
    "gemma3-270m": dict(num_prompts=48, seq_len=128, eval_prompts=12, eval_seq_len=64, batch_size=6, bootstrap=1000),
}
SWAP = dict(num_prompts=8, seq_len=64)
TRAJ = dict(num_prompts=32, seq_len=128, eval_prompts=32, eval_seq_len=128, bootstrap=1000)


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
    metadata = dict(linear.metadata)
    if deletion.metadata.get("timings"):
        metadata["timings_deletion"] = dict(deletion.metadata["timings"])
    return PeelReport(linear.num_blocks, linear.base_ce, linear.base_ce_ci, linear.probes + deletion.probes,
                      settings, metadata)


def shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def machine_record(threads: int, load_start: float) -> dict:
    return {"cpu_count": os.cpu_count(), "threads": threads, "load_average_start": load_start,
            "load_average_end": os.getloadavg()[0]}


def identity_record(identity) -> dict | None:
    """The model identity for a stored record, without the local folder the weights were read from."""
    if not isinstance(identity, dict):
        return None
    return {k: v for k, v in identity.items() if k != "path"}


def run_real(name: str, log, command: str) -> dict:
    from hf_layerswap import score_layers
    from hf_layerswap.models import load_model
    from hf_layerswap.peeling import peel, peel_plot
    from hf_layerswap.utils.jsonio import write_json_atomic

    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    model, tokenizer = load_model(name)
    load_s = time.perf_counter() - t0
    kw = dict(REAL[name])
    calib = wikitext_prompts(kw["num_prompts"], seed=0, variant="lines")
    evals = wikitext_prompts(kw["eval_prompts"], seed=1, variant="lines", path=TEST_RAW)
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
    seconds = {
        "load": load_s, "linear_peel": linear_s, "deletion_peel": deletion_s, "swap_kl": swap_s,
        "swap_probes": len(swap.pairs) * 3, "swap_forward_passes": swap.metadata.get("forward_passes"),
    }
    identity = identity_record(getattr(model, "layerswap_identity", None))
    machine = machine_record(torch.get_num_threads(), load_start)
    write_json_atomic({"format": "peeling-benchmark-seconds/1", "model": name, "command": command,
                       "seconds": seconds, "identity": identity, "machine": machine}, out / f"{name}_seconds.json")
    peel_plot(report, RESULTS / f"peeling_{name}.png")
    return {"name": name, "report": report, "swap": swap, "seconds": seconds, "identity": identity,
            "machine": machine, "command": command}


def load_real(name: str, log) -> dict:
    """The stored result of an earlier :func:`run_real` (no model is loaded)."""
    from hf_layerswap.peeling import PeelReport, peel_plot
    from hf_layerswap.scoring.report import SwapReport

    out = RESULTS / "peeling"
    paths = {kind: out / f"{name}_{kind}.json" for kind in ("peel", "swap")}
    missing = [shown(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"--render-only for model {name!r}: missing {missing}; write them with "
                                f"`{SCRIPT} --models {name} --skip-trajectory`")
    report = PeelReport.from_json(paths["peel"])
    swap = SwapReport.from_json(paths["swap"])
    references = report.settings.get("references", [])
    if "deletion" not in references or "linear" not in references:
        raise ValueError(f"{shown(paths['peel'])}: references {references}, expected both 'linear' and 'deletion'")
    peel_model, swap_model = report.metadata.get("model") or {}, swap.metadata.get("model") or {}
    if peel_model.get("name") and swap_model.get("name") and peel_model["name"] != swap_model["name"]:
        raise ValueError(f"{shown(paths['peel'])} is for {peel_model['name']!r} but {shown(paths['swap'])} is for "
                         f"{swap_model['name']!r}")
    sidecar = out / f"{name}_seconds.json"
    side = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    png = RESULTS / f"peeling_{name}.png"
    if not png.is_file():
        peel_plot(report, png)
        log(f"[{name}] drew {shown(png)} from {shown(paths['peel'])}")
    return {"name": name, "report": report, "swap": swap, "seconds": side.get("seconds"),
            "identity": side.get("identity") or swap_model or peel_model or None,
            "machine": side.get("machine"), "command": side.get("command")}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else math.nan


def _fmt(v, spec: str) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def layer_series(res: dict) -> dict[str, list]:
    """Per-layer series compared in a model section (None / NaN where absent)."""
    report, swap = res["report"], res["swap"]
    dele = report.layer_gaps(1, "deletion")
    return {
        "linear gap (span 1)": report.layer_gaps(1, "linear"),
        "removal dPPL": [100 * math.expm1(v) if v is not None else None for v in dele],
        "interchange s(i)": swap.layer_scores("interchange"),
        "replacement s(i)": swap.layer_scores("replacement"),
        "linear gap (span 2)": report.layer_gaps(2, "linear"),
    }


def rho(series: dict, a: str, b: str) -> float:
    def arr(name):
        return [np.nan if v is None else v for v in series[name]]
    return spearman(arr(a), arr(b))


def _both(series: dict, a: str, b: str) -> int:
    return sum(1 for x, y in zip(series[a], series[b])
               if x is not None and y is not None and math.isfinite(x) and math.isfinite(y))


def _lowest(values, n: int = 3) -> list[int]:
    known = [(v, k) for k, v in enumerate(values) if v is not None and math.isfinite(v)]
    return [k for _, k in sorted(known)[:n]]


def findings(res: dict, series: dict) -> str:
    """A paragraph of what the model's data show, computed from the data."""
    report = res["report"]
    r_int, r_rep = rho(series, "removal dPPL", "interchange s(i)"), rho(series, "removal dPPL", "replacement s(i)")
    r_lin = rho(series, "linear gap (span 1)", "removal dPPL")
    r_lin_int = rho(series, "linear gap (span 1)", "interchange s(i)")
    r_lin_rep = rho(series, "linear gap (span 1)", "replacement s(i)")
    n = _both(series, "removal dPPL", "interchange s(i)")
    out = [f"Over the {n} layers with both values, removal dPPL ranks the layers like interchange s(i) with "
           f"Spearman ρ = {_fmt(r_int, '+.2f')} and like replacement s(i) with ρ = {_fmt(r_rep, '+.2f')}"]
    if math.isfinite(r_int) and math.isfinite(r_rep):
        if abs(r_int - r_rep) < 0.05:
            out[-1] += " (the two protocols agree with removal about equally)."
        else:
            better = "interchange" if r_int > r_rep else "replacement"
            out[-1] += f" ({better} is the closer of the two)."
    else:
        out[-1] += "."
    out.append(f"The span-1 linear gap agrees with removal dPPL at ρ = {_fmt(r_lin, '+.2f')}, with interchange at "
               f"ρ = {_fmt(r_lin_int, '+.2f')} and with replacement at ρ = {_fmt(r_lin_rep, '+.2f')}.")
    cheap = {key: _lowest(series[key]) for key in ("removal dPPL", "interchange s(i)", "replacement s(i)",
                                                    "linear gap (span 1)")}
    common = sorted(set(cheap["removal dPPL"]) & set(cheap["interchange s(i)"]) & set(cheap["replacement s(i)"]))
    out.append("Three lowest layers — by removal dPPL: " + ", ".join(map(str, cheap["removal dPPL"]))
               + "; by interchange: " + ", ".join(map(str, cheap["interchange s(i)"]))
               + "; by replacement: " + ", ".join(map(str, cheap["replacement s(i)"]))
               + "; by span-1 linear gap: " + ", ".join(map(str, cheap["linear gap (span 1)"]))
               + (f" ({'layer' if len(common) == 1 else 'layers'} {', '.join(map(str, common))} "
                  f"{'is' if len(common) == 1 else 'are'} among the three "
                  "lowest of removal, interchange and replacement alike)." if common
                  else " (no layer is among the three lowest of removal, interchange and replacement alike)."))
    dppl = series["removal dPPL"]
    known = [(v, k) for k, v in enumerate(dppl) if v is not None]
    if known:
        hi, lo = max(known), min(known)
        out.append(f"Removing layer {hi[1]} costs the most (dPPL {hi[0]:+,.1f}%), layer {lo[1]} the least "
                   f"({lo[0]:+,.1f}%).")
    lin, dele = report.layer_gaps(1, "linear"), report.layer_gaps(1, "deletion")
    worst = max(((v, k) for k, v in enumerate(lin) if v is not None and math.isfinite(v)), default=None)
    if worst is not None:
        probe = report.probe(worst[1], 1, "linear")
        out.append(f"The largest span-1 linear gap is at site {worst[1]}: ΔCE {worst[0]:+.4f} with held-out EV "
                   f"{probe.explained_variance:.3f} of the block's update.")
    pairs = [(a, b) for a, b in zip(lin, dele) if a is not None and b is not None]
    if pairs:
        below = sum(1 for a, b in pairs if a < b)
        out.append(f"The span-1 linear reference costs less than plain removal at {below} of {len(pairs)} layers.")
    linear_probes = [p for p in report.probes if p.reference == "linear"]
    beaten = [p for p in linear_probes if p.flag == "beaten"]
    matched = [p for p in linear_probes if p.flag == "matched"]
    if beaten:
        out.append(f"{len(beaten)} of {len(linear_probes)} linear probes beat the checkpoint (95% CI below 0): "
                   + ", ".join(f"site {p.site} span {p.span}" for p in beaten) + ".")
    else:
        out.append(f"No site is beaten: none of the {len(linear_probes)} linear probes has its 95% CI below 0"
                   + (f", and {len(matched)} are matched within tau = {report.settings.get('tau')} nats."
                      if matched else f", and none is matched within tau = {report.settings.get('tau')} nats."))
    bound = report.peel_bound
    if bound is not None:
        where = f"site {bound.site} → end" if bound.kind == "later" else f"site {bound.site}, span {bound.span}"
        out.append(f"The smallest linear gap is ΔCE {bound.dce:+.4f} [{bound.ci_low:+.4f}, {bound.ci_high:+.4f}] "
                   f"nats/token at {where} (base CE {report.base_ce:.4f}).")
    return "Findings: " + " ".join(out)


def _sec(sec: dict | None, key: str) -> str:
    v = (sec or {}).get(key)
    return "not recorded" if v is None else f"{v:.1f}"


def real_section(res: dict) -> str:
    from hf_layerswap.peeling import peel_table_markdown

    name, report, swap, sec = res["name"], res["report"], res["swap"], res.get("seconds")
    L = report.num_blocks
    series = layer_series(res)
    lin1, lin2 = series["linear gap (span 1)"], series["linear gap (span 2)"]
    dppl, inter, repl = series["removal dPPL"], series["interchange s(i)"], series["replacement s(i)"]
    meta = report.metadata
    calib, evals = meta.get("calibration") or {}, meta.get("evaluation") or {}
    t = meta["timings"]
    by_kind = {}
    for p in report.probes:
        key = "deletion, span 1" if p.reference == "deletion" else ("k → end" if p.kind == "later" else f"linear, span {p.span}")
        by_kind.setdefault(key, []).append(p.seconds)
    ident = res.get("identity") or {}
    model = ident.get("name") or name
    if ident.get("revision"):
        model += f" ({ident['revision']})"
    lines = [f"## {name}", ""]
    lines.append(
        f"Model: {model}, {L} blocks, hidden {meta['hidden_size']}, "
        f"{meta.get('dtype', 'float32')}. Base CE {report.base_ce:.4f} nats/token (PPL {math.exp(report.base_ce):.2f}) "
        f"on {meta['evaluation_predicted_tokens']} predicted tokens ({meta['evaluation_sequences']} WikiText-2 test "
        f"paragraphs, first {evals.get('seq_len')} tokens each). References fitted on "
        f"{meta['calibration_tokens_used']} tokens ({calib.get('num_prompts')} validation paragraphs, at most "
        f"{calib.get('seq_len')} tokens each), ridge {report.settings['ridge']}, "
        f"{'affine' if report.settings.get('bias', True) else 'linear, no bias'}."
    )
    lines += ["", "### Per-layer reference gaps (ΔCE = CE(hybrid) − CE(model), nats/token, 95% CI)", ""]
    lines.append(peel_table_markdown(report))
    lines += ["### Against swap-KL and removal", ""]
    lines.append("| layer | linear ΔCE k | linear ΔCE k..k+1 | removal dPPL % | interchange s(i) | replacement s(i) |")
    lines.append("|---|---|---|---|---|---|")
    for k in range(L):
        lines.append(f"| {k} | {_fmt(lin1[k], '+.4f')} | {_fmt(lin2[k], '+.4f')} | {_fmt(dppl[k], '+,.2f')} | "
                     f"{_fmt(inter[k], '.4f')} | {_fmt(repl[k], '.4f')} |")
    names = list(series)
    lines += ["", "Spearman rank correlation over layers (layers where both values exist):", ""]
    lines.append("| | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for a in names:
        lines.append(f"| {a} | " + " | ".join(_fmt(rho(series, a, b), "+.2f") for b in names) + " |")
    lines += ["", findings(res, series), "", "### Cost", ""]
    lines.append("| step | seconds |")
    lines.append("|---|---|")
    lines.append(f"| load | {_sec(sec, 'load')} |")
    solves = sum(1 for p in report.probes if p.reference == "linear")
    lines.append(f"| calibration pass + {solves} float64 solves (linear fits) | {t['linear_fit_seconds']:.1f} |")
    lines.append(f"| reference forward over the evaluation set (linear run) | {t['evaluation_base_seconds']:.1f} |")
    t_del = meta.get("timings_deletion") or {}
    if t_del.get("evaluation_base_seconds") is not None:
        lines.append(f"| reference forward over the evaluation set (deletion run) | "
                     f"{t_del['evaluation_base_seconds']:.1f} |")
    for key, vals in by_kind.items():
        lines.append(f"| per probe, {key} ({len(vals)} probes): mean, and sum over the probes | "
                     f"{_mean(vals):.2f}, {sum(vals):.1f} |")
    lines.append(f"| linear peel, total | {_sec(sec, 'linear_peel')} |")
    lines.append(f"| deletion probes, total | {_sec(sec, 'deletion_peel')} |")
    probes = (sec or {}).get("swap_probes") or swap.metadata.get("distinct_probes")
    lines.append(f"| swap-KL, both protocols, {probes} probes on {swap.metadata.get('num_tokens')} tokens, total | "
                 f"{_sec(sec, 'swap_kl')} |")
    if swap.metadata.get("seconds") is not None:
        lines.append(f"| swap-KL, time inside `score_layers` ({swap.metadata.get('forward_passes')} forward passes; "
                     f"the report's own timer) | {swap.metadata['seconds']:.1f} |")
    absent = [label for key, label in (("load", "load"), ("linear_peel", "linear peel"),
                                       ("deletion_peel", "deletion probes"), ("swap_kl", "swap-KL"))
              if (sec or {}).get(key) is None]
    if absent:
        lines += ["", f"Not recorded: the {', '.join(absent)} total(s) — no `{name}_seconds.json` was stored with "
                      f"this run; the other rows are what its stored reports record."]
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


def run_trajectory(out_dir: Path, reuse: bool, log, command: str, threads: int) -> dict:
    from hf_layerswap.peeling import peel_trajectory, trajectory_plot
    from hf_layerswap.utils.jsonio import write_json_atomic

    load_start = os.getloadavg()[0]
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
    for point in traj.points:  # the checkpoint folders by name only: the local cache stays out of the results
        point.checkpoint = Path(point.checkpoint).name
    traj.to_json(RESULTS / "peeling" / "trajectory.json")
    # what trajectory_section needs besides trajectory.json; checkpoint folders by name only
    stored = dict(record, checkpoints=[Path(c).name for c in record["checkpoints"]])
    write_json_atomic({"format": "peeling-benchmark-trajectory-run/1", "command": command, "record": stored,
                       "seconds": seconds, "budget": dict(TRAJ), "machine": machine_record(threads, load_start)},
                      RESULTS / "peeling" / "trajectory_run.json")
    trajectory_plot(traj, RESULTS / "peeling_trajectory.png")
    return {"trajectory": traj, "record": stored, "seconds": seconds, "budget": dict(TRAJ), "command": command,
            "machine": machine_record(threads, load_start)}


TRAJECTORY_HEADING = "## Training trajectory"


def load_trajectory(log) -> dict | None:
    """The stored trajectory run (trajectory.json + trajectory_run.json), or None if either is missing."""
    from hf_layerswap.peeling import PeelTrajectory, trajectory_plot

    traj_path, run_path = RESULTS / "peeling" / "trajectory.json", RESULTS / "peeling" / "trajectory_run.json"
    if not (traj_path.is_file() and run_path.is_file()):
        return None
    traj = PeelTrajectory.from_json(traj_path)
    run = json.loads(run_path.read_text())
    png = RESULTS / "peeling_trajectory.png"
    if not png.is_file():
        trajectory_plot(traj, png)
        log(f"[trajectory] drew {shown(png)} from {shown(traj_path)}")
    return {"trajectory": traj, "record": run["record"], "seconds": run["seconds"], "budget": run.get("budget"),
            "command": run.get("command"), "machine": run.get("machine")}


def _pairs_phrase(max_gap, num_blocks) -> str:
    if max_gap is None:
        return "pairs"
    if max_gap == 1:
        return "adjacent pairs"
    if num_blocks is not None and max_gap >= num_blocks - 1:
        return "all pairs"
    return f"pairs at most {max_gap} apart"


def trajectory_section(res: dict) -> str:
    from hf_layerswap.peeling import trajectory_table_markdown

    traj, rec = res["trajectory"], res["record"]
    budget = res.get("budget") or TRAJ
    split, model, tr = rec["split"], rec["model"], rec["training"]
    pairs = _pairs_phrase(traj.metadata.get("max_gap"), model.get("layers"))
    lines = [f"{TRAJECTORY_HEADING} (small Llama-style model trained here)", ""]
    lines.append(
        f"`python benchmarks/train_tiny.py` (called by this script): {model['layers']} blocks, hidden {model['hidden']}, "
        f"{model['parameters']:,} parameters, BPE vocabulary {rec['tokenizer']['vocab_size']} trained on the training "
        f"articles; {tr['steps']} AdamW steps of {tr['batch']} x {tr['seq_len']} tokens (lr {tr['lr']}, cosine), "
        f"{rec['seconds']['training']:.0f} s of training. Data: `{rec['data']}` cut into articles at top-level "
        f"headings; training = the first {split['train_articles']} articles ({split['train_tokens']:,} tokens), "
        f"held out = the last {split['heldout_articles']} ({split['heldout_paragraphs']} paragraphs). References are "
        f"fitted on {budget['num_prompts']} training paragraphs and scored on {budget['eval_prompts']} held-out "
        f"paragraphs ({budget['eval_seq_len']} tokens max); swap-KL on the training paragraphs, {pairs}. "
        f"Peeling + swap-KL of {len(traj.points)} checkpoints: {res['seconds']:.0f} s."
    )
    lines += ["", "Span-1 linear gaps per checkpoint (ΔCE, nats/token; negative = the linear map beats the block):", ""]
    lines.append(trajectory_table_markdown(traj))
    lines += ["Map onto the final stream (k → end) per checkpoint:", ""]
    lines.append(trajectory_table_markdown(traj, span=0))
    lines += ["![training trajectory](peeling_trajectory.png)", ""]
    return "\n".join(lines)


METHOD = (
    "Method: `hf_layerswap.peeling` (per-site form of the peeling reference bounds of Eamaz, Yeganegi and "
    "Soltanalian, arXiv 2605.02853). At site k a reference replaces blocks k..k+m-1: a closed-form float64 ridge "
    "regression of the residual stream entering block k onto the stream leaving block k+m-1 (toward the "
    "identity, affine), or onto the stream leaving the last block (`k → end`); `deletion` is plain removal. "
    "ΔCE = CE(hybrid) − CE(model) on held-out text, nats per predicted token, with a 95% paired bootstrap CI "
    "over sequences. ΔCE < 0 with the CI below 0: the trained blocks are beaten by their reference. EV = "
    "held-out explained variance of the blocks' update."
)


def data_line(real: list[dict]) -> str:
    swaps = {(r["swap"].metadata.get("num_prompts"), r["swap"].metadata.get("seq_len")) for r in real}
    prompts, seq_len = swaps.pop() if len(swaps) == 1 else (SWAP["num_prompts"], SWAP["seq_len"])
    return (
        "Data: references fitted on WikiText-2 *validation* paragraphs (`../shared/data/wikitext-2/valid.txt`), "
        "hybrids scored on WikiText-2 raw *test* paragraphs (`../shared/data/wikitext-2-raw/wiki.test.raw`); "
        "paragraphs = lines of the files, headings dropped, seeded samples (seeds 0 and 1). Removal dPPL% = "
        "100 (exp(ΔCE of deletion) − 1) on the same evaluation tokens (the ratio of the token-level perplexities "
        "of these sequences; not the sliding-window contract of `hf_layerswap.evaluation`). Swap-KL: "
        f"`score_layers`, both protocols, adjacent pairs, {prompts} validation paragraphs x "
        f"{seq_len} tokens (KL, not CE: it needs no labels). Layer indices are 0-based."
    )


def _versions(real: list[dict], traj: dict | None) -> str:
    """Library versions stored in the reports (one phrase, or one per source where they differ)."""
    found = {}
    for r in real:
        v = r["report"].metadata.get("library_versions") or r["swap"].metadata.get("library_versions") or {}
        found[r["name"]] = v
    if traj is not None and traj["trajectory"].points:
        found["training run"] = traj["trajectory"].points[0].peel.metadata.get("library_versions") or {}

    def phrase(v):
        return (f"torch {v.get('torch', '?')}, transformers {v.get('transformers', '?')}, "
                f"Python {v.get('python', '?')}")

    distinct = {phrase(v) for v in found.values()}
    if len(distinct) == 1:
        return distinct.pop()
    return "; ".join(f"{k}: {phrase(v)}" for k, v in found.items())


def recorded_times(res: dict) -> str:
    """The seconds a stored model run recorded, as one phrase."""
    report, swap, sec = res["report"], res["swap"], res.get("seconds") or {}
    t = report.metadata.get("timings", {})
    parts = []
    if sec.get("load") is not None:
        parts.append(f"load {sec['load']:.0f} s")
    if sec.get("linear_peel") is not None:
        parts.append(f"linear peel {sec['linear_peel']:.0f} s")
    else:
        linear = sum(p.seconds for p in report.probes if p.reference == "linear")
        parts.append(f"linear fits {t.get('linear_fit_seconds', 0):.0f} s + reference forward "
                     f"{t.get('evaluation_base_seconds', 0):.0f} s + linear probes {linear:.0f} s")
    if sec.get("deletion_peel") is not None:
        parts.append(f"deletion probes {sec['deletion_peel']:.0f} s")
    else:
        parts.append(f"deletion probes {sum(p.seconds for p in report.probes if p.reference == 'deletion'):.0f} s")
    if sec.get("swap_kl") is not None:
        parts.append(f"swap-KL {sec['swap_kl']:.0f} s")
    elif swap.metadata.get("seconds") is not None:
        parts.append(f"swap-KL {swap.metadata['seconds']:.0f} s (inside `score_layers`)")
    machine = res.get("machine")
    if machine:
        parts.append(f"{machine['threads']} thread(s) on {machine['cpu_count']} cores, load average "
                     f"{machine['load_average_start']:.1f} → {machine['load_average_end']:.1f}")
    return f"{res['name']}: " + ", ".join(parts)


def render_header(real: list[dict], traj: dict | None, render_command: str) -> list[str]:
    """Header of a file rebuilt from stored JSON: which commands made the data, and what they recorded."""
    sources = [(r["name"], r.get("command") or COMMAND) for r in real]
    if traj is not None:
        sources.append(("training run", traj.get("command") or COMMAND))
    by_command = {}
    for who, cmd in sources:
        by_command.setdefault(cmd, []).append(who)
    made = "; ".join(f"`{cmd}` ({', '.join(who)})" for cmd, who in by_command.items())
    times = [recorded_times(r) for r in real]
    unrecorded = [r["name"] for r in real if not r.get("seconds")]
    if traj is not None:
        machine = traj.get("machine")
        extra = (f", {machine['threads']} thread(s) on {machine['cpu_count']} cores, load average "
                 f"{machine['load_average_start']:.1f} → {machine['load_average_end']:.1f}" if machine else "")
        times.append(f"training run: peeling + swap-KL of {len(traj['trajectory'].points)} checkpoints "
                     f"{traj['seconds']:.0f} s, training {traj['record']['seconds']['training']:.0f} s{extra}")
    return [
        f"Commands: the data come from {made}, each run in its own process; this file was rendered from their "
        f"stored JSON by `{render_command}`.",
        "",
        METHOD,
        "",
        f"Machine: not re-measured — rendered from the stored JSON under `{shown(RESULTS / 'peeling')}/` without "
        f"loading a model or computing anything. The runs used {_versions(real, traj)} (from the stored reports); "
        f"their wall-clock times include whatever else shared the CPU then. Recorded times: "
        + "; ".join(times) + "." + (
            f" Not recorded for {', '.join(unrecorded)}: the model load and the per-step totals (no "
            "`<model>_seconds.json` was stored with those runs); the times above are what their reports record."
            if unrecorded else "") + " No whole-benchmark time: the runs were separate processes.",
    ]


def write_results(head: list[str], body: list[str], page: Path | None = None) -> Path:
    """Write the page (default ``results/peeling.md``) from its header and sections."""
    text = "\n".join(["# Peeling reference bounds: real checkpoints and a training run", ""] + head) + "\n" + \
        "\n".join(body)
    return write_text_atomic(text, page or RESULTS / "peeling.md")


def render_only(args, log, render_command: str) -> int:
    """Rebuild peeling.md from the stored JSON of earlier runs (no model is loaded)."""
    real = [load_real(name, log) for name in args.models]
    traj = None if args.skip_trajectory else load_trajectory(log)
    if traj is None and not args.skip_trajectory:
        log("[trajectory] no trajectory.json + trajectory_run.json under results/peeling/: section left out")
    head = render_header(real, traj, render_command)
    head += ["", data_line(real), ""] if real else [""]
    body = [real_section(r) for r in real]
    if traj is not None:
        body.append(trajectory_section(traj))
    path = write_results(head, body, args.out)
    log(f"wrote {path}")
    return 0


def without_option(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``flag VALUE`` or ``flag=VALUE``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            kept.append(arg)
    return kept


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="peeling benchmark")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS),
                        help="real checkpoints to run or render (no name: the training trajectory alone)")
    parser.add_argument("--skip-trajectory", action="store_true")
    parser.add_argument("--checkpoints", type=Path, default=None, help="training-run folder (default: cache)")
    parser.add_argument("--reuse-checkpoints", action="store_true", help="reuse an earlier training run")
    parser.add_argument("--smoke", action="store_true", help="tiny budgets and 2 sites: checks the script, no results")
    parser.add_argument("--render-only", action="store_true",
                        help="rebuild peeling.md from the JSON of earlier runs under benchmarks/results/peeling/ "
                             "for --models (and the trajectory): loads no model, computes nothing")
    parser.add_argument("--out", type=Path, default=None,
                        help="page written by --render-only (default benchmarks/results/peeling.md; the stored "
                             "JSON is read from benchmarks/results/peeling/ either way; not named in the page)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    shown_argv = without_option(argv, "--out")
    command = " ".join([SCRIPT] + ([shlex.join(shown_argv)] if shown_argv else []))
    if args.render_only:
        clash = [flag for flag, on in (("--smoke", args.smoke), ("--reuse-checkpoints", args.reuse_checkpoints),
                                       ("--checkpoints", args.checkpoints is not None)) if on]
        if clash:
            parser.error(f"--render-only computes nothing and cannot be combined with {', '.join(clash)}")
    elif args.out is not None:
        parser.error("--out names the page of --render-only; a run writes benchmarks/results/peeling.md")
    if args.smoke:
        for budget in REAL.values():
            budget.update(num_prompts=8, seq_len=32, eval_prompts=4, eval_seq_len=32, bootstrap=100, sites=[1, 2])
        SWAP.update(num_prompts=2, seq_len=16)
        TRAJ.update(num_prompts=8, seq_len=32, eval_prompts=4, eval_seq_len=32, bootstrap=100)
        global RESULTS
        RESULTS = Path(os.environ.get("TMPDIR", "/tmp")) / "peeling-smoke"
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    if args.render_only:
        return render_only(args, log, command)

    torch.set_num_threads(args.threads)
    import transformers

    from train_tiny import default_out

    load_start = os.getloadavg()
    real = [run_real(name, log, command) for name in args.models]
    traj = None if args.skip_trajectory else run_trajectory(args.checkpoints or default_out(), args.reuse_checkpoints,
                                                            log, command, args.threads)
    total = time.perf_counter() - start
    load_end = os.getloadavg()
    head = [
        f"Command: `{command}`",
        "",
        METHOD,
        "",
        f"Machine: {os.cpu_count()} CPU cores shared with other jobs (load average {load_start[0]:.1f} at the start, "
        f"{load_end[0]:.1f} at the end), torch {torch.__version__} with {args.threads} thread(s), transformers "
        f"{transformers.__version__}, Python {platform.python_version()}. Wall-clock times below include that "
        f"sharing. Whole benchmark: {total:.0f} s.",
        "",
        data_line(real) if real else "",
        "",
    ]
    body = [real_section(r) for r in real]
    if traj is not None:
        body.append(trajectory_section(traj))
    path = write_results(head, body)
    summary = {"seconds": total, "models": {r["name"]: r["seconds"] for r in real},
               "trajectory_seconds": traj["seconds"] if traj else None}
    write_text_atomic(json.dumps(summary, indent=2) + "\n", RESULTS / "peeling" / "timings.json")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
