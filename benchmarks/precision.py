"""bf16 vs fp32 weights: how far the swap-KL scores, the selections and their cost move.

For each real model (SmolLM2-135M, Gemma-3-270M) the same checkpoint is loaded twice,
with ``dtype=torch.float32`` and ``dtype=torch.bfloat16`` (``load_model(dtype=...)``), and
both are scored on the same calibration prompts (WikiText-2 validation paragraphs, seed 0;
few prompts, to keep the CPU cost to minutes per model). Reported per model:

- Spearman correlation of the per-layer scores of each protocol (bf16 vs fp32);
- max and median relative error of the pair KLs (every probe value of every pair);
- the greedy set of each protocol at n = 1..6 from each dtype's scores;
- dPPL% (matched WikiText-2 contract, fp32 model) of every set on which the dtypes
  differ, with the paired 95% bootstrap interval of the fp32 set's dPPL;
- the CPU time of the two scoring runs (process CPU seconds, same thread count).

Running, resuming and merging are the benchmark runner's (``benchmarks/runner.py``,
``experiments/precision.toml``: the option defaults and the models): each model is one cell,
a record of the ``models`` list of ``benchmarks/results/precision.json``
(:class:`runner.ListCellStore`), written after its scoring and after its search; a rerun with
the same settings skips a stored model; ``--merge-from`` first merges runs of other models
made in other processes; ``benchmarks/results/precision.md`` is rendered from the JSON, and
``--render-only`` re-renders it without loading a model.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _cmdline import command_line  # noqa: E402
from runner import ListCellStore, add_runner_arguments, experiment_cells, load_experiment, merge_files, read_state, run_cells  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
CALIBRATION = REPO.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
EVALUATION = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
PROTOCOLS = ("replacement", "interchange")
FIELDS = ("replacement_ij", "replacement_ji", "interchange")
#: Targets of the issue: Spearman per protocol, and bf16 / fp32 scoring CPU time.
SPEARMAN_TARGET = 0.98
CPU_RATIO_TARGET = 0.7
#: The experiment: the option defaults ([settings]) and the models (one cell each).
EXPERIMENT = load_experiment("precision")
SETTINGS = EXPERIMENT["settings"]


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def score(name: str, dtype, calib_args, threads: int):
    import torch

    from hf_layerswap.models import load_model
    from hf_layerswap.scoring import score_layers
    from wikitext import wikitext_calibration

    torch.set_num_threads(threads)
    model, tokenizer = load_model(name, dtype=dtype, device_map=None)
    calib = wikitext_calibration(tokenizer, calib_args["num_prompts"], calib_args["seq_len"], seed=0)
    c0, w0 = time.process_time(), time.perf_counter()
    report = score_layers(model, calib, protocols=PROTOCOLS, max_gap=1, batch_size=calib_args["batch_size"],
                          progress=False)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return model, tokenizer, calib, report, cpu, wall


def _key(removed) -> str:
    return ",".join(map(str, removed))


def run_model(name: str, args, save) -> dict:
    """Every number of one model; ``save(out)`` is called after the scoring and after the search."""
    import copy

    import torch

    from hf_layerswap.evaluation import delta_ppl_ci, delta_ppl_percent, evaluate_perplexity
    from hf_layerswap.selection import search_select, select_layers
    from hf_layerswap.surgery import remove_layers

    calib_args = {"num_prompts": args.num_prompts, "seq_len": args.seq_len, "batch_size": args.batch_size}
    runs = {}
    for label, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model, tokenizer, calib, report, cpu, wall = score(name, dtype, calib_args, args.threads)
        runs[label] = {"model": model, "tokenizer": tokenizer, "calib": calib, "report": report, "cpu": cpu,
                       "wall": wall}
        print(f"[{name}] {label}: scoring {cpu:.0f} CPU s ({wall:.0f} s wall)", flush=True)
    r32, r16 = runs["float32"]["report"], runs["bfloat16"]["report"]
    fp32_model, fp32_tok = runs["float32"]["model"], runs["float32"]["tokenizer"]
    out = {
        "model": name,
        "settings": {k: getattr(args, k) for k in ("num_prompts", "seq_len", "batch_size", "threads")},
        "num_blocks": r32.num_blocks,
        "calibration": runs["float32"]["calib"].spec(),
        "scoring": {k: {"cpu_seconds": round(v["cpu"], 1), "wall_seconds": round(v["wall"], 1)}
                    for k, v in runs.items()},
        "spearman": {p: spearman(r32.layer_scores(p), r16.layer_scores(p)) for p in PROTOCOLS},
        "pair_kl_relative_error": {},
        "scores": {k: {p: v["report"].layer_scores(p) for p in PROTOCOLS} for k, v in runs.items()},
        "selections": [],
        "evaluated": {},
    }
    every = sorted(abs(getattr(b, f) - getattr(a, f)) / abs(getattr(a, f))
                   for a, b in zip(r32.pairs, r16.pairs) for f in FIELDS)
    out["pair_kl_relative_error"] = {"max": every[-1], "median": every[len(every) // 2], "values": len(every)}
    budgets = list(range(1, args.max_n + 1))
    for n in budgets:
        for p in PROTOCOLS:
            out["selections"].append({"n": n, "protocol": p,
                                      "float32": select_layers(r32, n, strategy="greedy", protocol=p),
                                      "bfloat16": select_layers(r16, n, strategy="greedy", protocol=p)})
    base = {}

    def evaluate_differing():
        pending = {tuple(r[k]) for r in out["selections"] for k in ("float32", "bfloat16")
                   if r["float32"] != r["bfloat16"]} - {tuple(map(int, k.split(","))) for k in out["evaluated"]}
        if pending and not base:
            base["result"] = evaluate_perplexity(fp32_model, str(EVALUATION), tokenizer=fp32_tok, contract="matched")
            out["base_ppl"] = base["result"].ppl
        for removed in sorted(pending):
            pruned = remove_layers(copy.deepcopy(fp32_model), list(removed))
            result = evaluate_perplexity(pruned, str(EVALUATION), tokenizer=fp32_tok, contract="matched")
            low, high = delta_ppl_ci(base["result"], result)
            out["evaluated"][_key(removed)] = {"dppl": delta_ppl_percent(base["result"].ppl, result.ppl),
                                               "ci": [low, high]}
            print(f"[{name}] {list(removed)}: dPPL {out['evaluated'][_key(removed)]['dppl']:+.1f}%", flush=True)
            del pruned

    evaluate_differing()
    save(out)
    if args.search:
        found, seconds = {}, {}
        for label, run in runs.items():
            c0 = time.process_time()
            result = search_select(run["report"], budgets, model=run["model"], calibration=run["calib"],
                                   batch_size=args.batch_size)
            seconds[label] = round(time.process_time() - c0, 1)
            found[label] = {n: sorted(result[n]["selected"]) for n in budgets}
            print(f"[{name}] {label}: search {seconds[label]:.0f} CPU s", flush=True)
        for n in budgets:
            out["selections"].append({"n": n, "protocol": "search", "float32": found["float32"][n],
                                      "bfloat16": found["bfloat16"][n]})
        out["search_cpu_seconds"] = seconds
        evaluate_differing()
        save(out)
    return out


def _own_run(name: str, ms: dict, s: dict) -> str:
    """The command of a model run in a process of its own with other calibration settings."""
    flags = {"num_prompts": "--num-prompts", "seq_len": "--seq-len", "batch_size": "--batch-size", "threads": "--threads"}
    other = [f"{flag} {ms[k]}" for k, flag in flags.items() if ms[k] != s[k]]
    if not other:
        return ""
    return (f" Run in a process of its own (`python benchmarks/precision.py --models {name} {' '.join(other)}`), "
            "merged into this page with `--merge-from`.")


def _sets_ok(m: dict) -> bool:
    """Every set identical, or the bf16 set's dPPL inside the paired 95% CI of the fp32 set's."""
    return all(r["float32"] == r["bfloat16"] or (
        m["evaluated"][_key(r["float32"])]["ci"][0] <= m["evaluated"][_key(r["bfloat16"])]["dppl"]
        <= m["evaluated"][_key(r["float32"])]["ci"][1]) for r in m["selections"])


def _targets(models: list[dict], max_n: int) -> list[str]:
    """The issue's targets, each met or missed (or not measured), one row per target and model."""
    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    rows = ["## Targets", "", "| target | model | measured | verdict |", "|---|---|---|---|"]
    for m in models:
        rho = min(m["spearman"].values())
        rows.append(f"| Spearman >= {SPEARMAN_TARGET} for each protocol's per-layer scores | {m['model']} | "
                    f"lowest {rho:.4f} | {verdict(rho >= SPEARMAN_TARGET)} |")
        kinds = "greedy per protocol" + (" and the default search" if "search_cpu_seconds" in m else "")
        same = sum(r["float32"] == r["bfloat16"] for r in m["selections"])
        rows.append(f"| sets identical at n = 1..{max_n}, or dPPL inside the fp32 set's paired 95% CI | {m['model']} | "
                    f"{kinds}: {same} of {len(m['selections'])} identical | {verdict(_sets_ok(m))} |")
        sc = m["scoring"]
        ratio = sc["bfloat16"]["cpu_seconds"] / sc["float32"]["cpu_seconds"]
        rows.append(f"| bf16 scoring CPU time <= {CPU_RATIO_TARGET}x fp32, one run | {m['model']} | {ratio:.2f}x | "
                    f"{verdict(ratio <= CPU_RATIO_TARGET)} |")
    rows += ["| offloaded (CPU + disk) swap-KLs equal in-memory (relative difference <= 1e-5) | tiny Llama, blocks "
             "3-5 on disk | asserted by tests/test_utils_devices.py, with the same search set, perplexity and ghosted fit | "
             "**met** |",
             "| GPU: default prune of an 8B-shaped model under 3 minutes, within 3x of its compute bound | | no GPU "
             "for this run | not measured |", "",
             "The bf16 CPU time includes the output head, which the half-precision contract runs in fp32 in both runs "
             "(the upcast final hidden state times the upcast weight), so that part of the work costs the same in "
             "both. On Gemma-3-270M the 262,144-entry head costs about as much as 35 blocks, against its 18 "
             "([speed.md](speed.md)): a large part of its scoring is that fp32 GEMM.", ""]
    return rows


def _set(s) -> str:
    return "{" + ", ".join(map(str, s)) + "}"


def render(state: dict) -> str:
    s = state["settings"]
    lines = ["# Precision: bf16 vs fp32 weights", "", "```", state["command"], "```", "",
             f"Machine: {state['machine']}. Libraries: "
             + ", ".join(f"{k} {v}" for k, v in state["versions"].items()) + ".", "",
             "Each model is loaded twice from the same checkpoint, with `load_model(name, dtype=torch.float32)` and "
             "`dtype=torch.bfloat16` (the bundled checkpoints are dequantized GGUF weights stored in fp32; bf16 "
             "is their cast), and both are scored on the same calibration set: WikiText-2 validation "
             "paragraphs, seed 0, the first few (below, per model). Few prompts keep each model's run to "
             "minutes of CPU time; the numbers are those of this small calibration set. Adjacent pairs, both "
             "protocols. The head computes fp32 logits from the upcast final hidden state in both runs "
             "(docs/how-it-works.md, half precision). The machine was shared with other jobs: wall times are "
             "several times the CPU times; the CPU times of one torch thread compare.", ""]
    lines += _targets(state["models"], s["max_n"])
    for m in state["models"]:
        name = m["model"]
        ms = m.get("settings", s)
        lines += [f"## {name} ({m['num_blocks']} blocks)", "",
                  f"Calibration: {ms['num_prompts']} prompts truncated to {ms['seq_len']} tokens, batches of "
                  f"{ms['batch_size']}; {ms['threads']} torch thread(s)." + _own_run(name, ms, s), ""]
        sc = m["scoring"]
        ratio = sc["bfloat16"]["cpu_seconds"] / sc["float32"]["cpu_seconds"]
        lines += ["| | value | target | met |", "|---|---|---|---|"]
        for p in PROTOCOLS:
            rho = m["spearman"][p]
            lines.append(f"| Spearman of per-layer {p} scores, bf16 vs fp32 | {rho:.4f} | >= {SPEARMAN_TARGET} | "
                         f"{'met' if rho >= SPEARMAN_TARGET else 'missed'} |")
        e = m["pair_kl_relative_error"]
        lines.append(f"| pair KL relative error, max ({e['values']} values) | {e['max']:.4f} | | |")
        lines.append(f"| pair KL relative error, median | {e['median']:.4f} | | |")
        lines.append(f"| scoring CPU time, fp32 (wall) | {sc['float32']['cpu_seconds']:.0f} s "
                     f"({sc['float32']['wall_seconds']:.0f} s) | | |")
        lines.append(f"| scoring CPU time, bf16 (wall) | {sc['bfloat16']['cpu_seconds']:.0f} s "
                     f"({sc['bfloat16']['wall_seconds']:.0f} s) | | |")
        lines.append(f"| bf16 / fp32 scoring CPU time | {ratio:.2f}x | <= {CPU_RATIO_TARGET}x | "
                     f"{'met' if ratio <= CPU_RATIO_TARGET else 'missed'} |")
        lines += ["", "The greedy set of each protocol (the paper's rule, spacing 1, first and last block "
                  "protected) from each dtype's scores" + (", and the default search's set (`search_select`, the "
                  "removal KL of each dtype's own model on the calibration prompts)" if "search_cpu_seconds" in m
                  else "") + ":", "",
                  "| n | protocol | fp32 set | bf16 set | same | dPPL% fp32 set [paired 95% CI] | dPPL% bf16 set | "
                  "bf16 set inside the CI |", "|---|---|---|---|---|---|---|---|"]
        for row in m["selections"]:
            a, b = row["float32"], row["bfloat16"]
            if a == b:
                lines.append(f"| {row['n']} | {row['protocol']} | {_set(a)} | {_set(b)} | yes | | | |")
                continue
            ea, eb = m["evaluated"][_key(a)], m["evaluated"][_key(b)]
            inside = ea["ci"][0] <= eb["dppl"] <= ea["ci"][1]
            lines.append(f"| {row['n']} | {row['protocol']} | {_set(a)} | {_set(b)} | no | {ea['dppl']:+.1f} "
                         f"[{ea['ci'][0]:+.1f}, {ea['ci'][1]:+.1f}] | {eb['dppl']:+.1f} | "
                         f"{'yes' if inside else 'no'} |")
        ok = _sets_ok(m)
        searched = "search_cpu_seconds" in m
        what = "the greedy sets and the default search's sets" if searched else "the greedy sets (the search's not run)"
        if searched:
            sec = m["search_cpu_seconds"]
            lines += ["", f"Search CPU time (budgets 1..{s['max_n']}): fp32 {sec['float32']:.0f} s, "
                      f"bf16 {sec['bfloat16']:.0f} s."]
        lines += ["", f"Target (sets identical at n = 1..{s['max_n']}, or the bf16 set's dPPL inside the paired 95% "
                  f"CI of the fp32 set's): **{'met' if ok else 'missed'}** for {what}."
                  + (f" Base PPL (fp32, matched contract): {m['base_ppl']:.3f}." if "base_ppl" in m else ""), ""]
    lines += ["## Not measured here", ""]
    unsearched = [m["model"] for m in state["models"] if "search_cpu_seconds" not in m]
    if unsearched:
        how = (" (run in a separate process without `--search`, merged with `--merge-from`)"
               if s.get("search") else "")
        lines.append(f"- The default search's sets on {', '.join(unsearched)}{how}: not run in this page's CPU "
                     "budget; only the greedy sets are compared there.")
    lines += ["- GPU numbers: this page is CPU only (no GPU was available for this run).", ""]
    return "\n".join(lines)


def model_key(record: dict) -> str:
    """The cell key of a stored model record (the ``models`` list of ``precision.json``)."""
    return record["model"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[c["model"] for c in experiment_cells(EXPERIMENT)["models"]])
    ap.add_argument("--num-prompts", type=int, default=SETTINGS["num_prompts"])
    ap.add_argument("--seq-len", type=int, default=SETTINGS["seq_len"])
    ap.add_argument("--batch-size", type=int, default=SETTINGS["batch_size"])
    ap.add_argument("--max-n", type=int, default=SETTINGS["max_n"])
    ap.add_argument("--threads", type=int, default=SETTINGS["threads"])
    ap.add_argument("--search", action=argparse.BooleanOptionalAction, default=SETTINGS["search"],
                    help="also compare the default search's sets at n = 1..max-n")
    ap.add_argument("--json", type=Path, default=RESULTS / "precision.json")
    ap.add_argument("--out", type=Path, default=RESULTS / "precision.md")
    add_runner_arguments(ap)
    return ap


def _merge(args) -> None:
    """``--merge-from``: runs of other models (e.g. one process per model) into ``--json``; the
    first file's header (command, machine) is kept; a piece measured with other settings, or a
    model stored with different values in two files, is refused."""
    reference = read_state(args.json)["settings"]["max_n"] if args.json.is_file() else args.max_n
    for path in args.merge_from:
        other = read_state(path, "--merge-from results file") if path.is_file() else {}
        max_n = other.get("settings", {}).get("max_n", reference)  # a file of bare records takes the header's
        if max_n != reference:
            raise SystemExit(f"--merge-from {path}: max_n {max_n} differs from {reference} (the greedy sets' budgets)")
    merge_files(args.json, args.merge_from, union=(), keyed={"models": model_key},
                first=("command", "machine", "versions", "started"))


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.merge_from:
        _merge(args)
    if args.render_only:
        state = read_state(args.json, "--render-only: results file")
        args.out.write_text(render(state), encoding="utf-8")
        return
    from hf_layerswap.utils.jsonio import write_text_atomic
    from hf_layerswap.utils.provenance import library_versions

    settings = {k: getattr(args, k) for k in ("num_prompts", "seq_len", "batch_size", "max_n", "threads", "search")}
    header = {"command": command_line("precision.py", argv).rstrip(), "settings": settings,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "versions": library_versions(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    store = ListCellStore(args.json, fresh=lambda: {**header, "models": []}, key=model_key, cells="models")
    if store.state.get("settings") != settings:  # other settings: a new run (the old numbers do not resume)
        if store.path.is_file():
            print(f"{args.json}: stored with other settings {store.state.get('settings')}; starting anew", flush=True)
        store.state = store.fresh()
    store.state.update(header)  # the latest command and time; stored models are kept
    order = {name: i for i, name in enumerate(args.models)}

    def save(entry):
        store.put(model_key(entry), entry)
        store.update(lambda state: state["models"].sort(key=lambda m: order.get(model_key(m), len(order))))
        write_text_atomic(render(store.state), args.out)

    run_cells(store, [(name, name) for name in args.models], lambda name: run_model(name, args, save),
              tag="precision", describe=lambda m: f"spearman {m['spearman']}")
    store.save()
    write_text_atomic(render(store.state), args.out)


if __name__ == "__main__":
    main()
