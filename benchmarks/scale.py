"""Predicted vs measured cost of a prune, the search's reference reuse, and a 70B arithmetic.

Command (one CPU thread; writes benchmarks/results/scale.{json,md}):

    python benchmarks/scale.py --num-prompts 4 --seq-len 64

Parts, each in a fresh child process (its peak RSS is the ``ru_maxrss`` of that child):
1. per real model, ``hl.estimate_cost`` then the prune it estimates (default strategy,
   ``num_to_remove=2``) with forward hooks counting block passes;
2. per real model, the search for n = 1..6 with the dense reference recomputed per
   evaluator call (``reference_memory=0``) and kept (default);
3. ``estimate_cost`` of a Llama-3-70B-shaped config on the meta device with weights streamed
   from CPU memory to one GPU (a prediction at stated rates);
4. per real model with a quarter of its weights in memory and the rest on disk: predicted
   against counted block loads, and the search with its reference recomputed and kept;
5. ``compute`` (``estimate_cost`` only, no model run): the predicted block and head work of
   the default prune against SLEB's at n = 2, 4, 6, at the default calibration;
6. ``measured`` (only when named: ``--parts measured --models gemma3-270m --num-prompts 16
   --seq-len 128``): the same comparison measured in CPU seconds (``time.process_time``) in
   one process, the model in bf16, beside ``estimate_cost``'s prediction at that calibration.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cmdline import command_line  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("smollm2-135m", "gemma3-270m")


def _calibration(name, num_prompts, seq_len):
    import hf_layerswap as hl
    from transformers import AutoTokenizer

    path = hl.models.bundled_checkpoint_dir(name)
    return path, hl.build_calibration(None, AutoTokenizer.from_pretrained(path), num_prompts=num_prompts,
                                      seq_len=seq_len, seed=0)


def _estimate_part(name, num_prompts, seq_len, queue):
    import torch
    import hf_layerswap as hl

    torch.set_num_threads(1)
    path, calib = _calibration(name, num_prompts, seq_len)
    config = hl.LayerSwapConfig(num_to_remove=2, num_prompts=num_prompts, seq_len=seq_len, progress=False)
    estimate = hl.estimate_cost(str(path), config, calibration=calib)
    queue.put({"block_passes": estimate.block_passes, "head_passes": estimate.head_passes, "exact": estimate.exact,
               "peak_memory_bytes": estimate.peak_memory_bytes["cpu"], "seconds": estimate.seconds,
               "phases": estimate.phases, "throughput": estimate.throughput.source})


def _default_part(name, queue):
    import torch
    import hf_layerswap as hl

    torch.set_num_threads(1)
    config = hl.LayerSwapConfig(num_to_remove=2, progress=False)
    path, calib = _calibration(name, config.num_prompts, config.seq_len)
    estimate = hl.estimate_cost(str(path), config, calibration=calib)
    queue.put({"block_passes": estimate.block_passes, "phases": estimate.phases,
               "peak_memory_bytes": estimate.peak_memory_bytes["cpu"], "seconds": estimate.seconds})


#: Budgets of the ``compute`` part.
COMPUTE_BUDGETS = (2, 4, 6)


def _compute_part(name, queue):
    """``estimate_cost`` (no weight read) of the default prune and of ``strategy="sleb"`` at each
    of :data:`COMPUTE_BUDGETS`, the default calibration, one throughput probe (one thread) for all."""
    import torch
    import hf_layerswap as hl

    torch.set_num_threads(1)
    path, calib = _calibration(name, 64, 128)
    out = {"real_positions": int(calib.attention_mask.sum()), "rows": {}}
    throughput = None
    for n in COMPUTE_BUDGETS:
        for method, extra in (("default", {}), ("sleb", {"strategy": "sleb"})):
            config = hl.LayerSwapConfig(num_to_remove=n, progress=False, **extra)
            estimate = hl.estimate_cost(str(path), config, calibration=calib, throughput=throughput)
            throughput = estimate.throughput
            fields = ("block_passes", "block_tokens", "block_flops", "head_rows", "head_flops", "seconds")
            out["rows"][f"{method} {n}"] = {k: {f: p[f] for f in fields} for k, p in estimate.phases.items()}
    out["throughput"] = {"block_flops_per_second": throughput.block_flops_per_second,
                         "head_flops_per_second": throughput.head_flops_per_second, "source": throughput.source}
    queue.put(out)


def _measured_part(name, num_prompts, seq_len, queue):
    """The default prune against SLEB measured in CPU seconds (``time.process_time``) in this
    process, the model in bf16: SLEB to the largest of :data:`COMPUTE_BUDGETS` first (its
    steps stamped), then the default prune's scoring once and its search for budgets 1..6 in
    one call (each budget stamped by ``on_budget``); beside them ``estimate_cost``'s
    prediction of both at this calibration and dtype."""
    import copy
    import os

    import torch
    import hf_layerswap as hl
    from transformers import AutoModelForCausalLM
    from hf_layerswap.layerplan import decoder_blocks, num_blocks
    from hf_layerswap.scoring.settings import resolve_memory
    from hf_layerswap.selection import sleb as sleb_module

    torch.set_num_threads(1)
    path, calib = _calibration(name, num_prompts, seq_len)
    top = max(COMPUTE_BUDGETS)
    configs = {(method, n): hl.LayerSwapConfig(num_to_remove=n, num_prompts=num_prompts, seq_len=seq_len,
                                               progress=False, **extra)
               for n in COMPUTE_BUDGETS for method, extra in (("default", {}), ("sleb", {"strategy": "sleb"}))}
    predicted, throughput = {}, None
    for (method, n), config in configs.items():
        estimate = hl.estimate_cost(str(path), config, calibration=calib, dtype=torch.bfloat16, throughput=throughput)
        throughput = estimate.throughput
        predicted[f"{method} {n}"] = {k: {f: p[f] for f in ("block_passes", "head_passes", "seconds")}
                                      for k, p in estimate.phases.items()}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    cfg = configs[("default", top)]
    budget = resolve_memory(None, model)  # prune's default working-memory budget, one for every step
    with torch.no_grad():  # one dense forward before any clock starts: neither method pays the first call's set-up
        model(input_ids=calib.input_ids[:cfg.batch_size], attention_mask=calib.attention_mask[:cfg.batch_size])
    count = [0]
    for block in decoder_blocks(model)[2]:
        block.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    clock = {}

    def start():
        clock.update(cpu=time.process_time(), wall=time.perf_counter(), blocks=count[0])
        return os.getloadavg()[0]

    def stamp():
        return {"cpu_seconds": time.process_time() - clock["cpu"], "wall_seconds": time.perf_counter() - clock["wall"],
                "block_passes": count[0] - clock["blocks"]}

    out = {"num_prompts": num_prompts, "seq_len": seq_len, "batch_size": cfg.batch_size, "dtype": "bfloat16",
           "real_positions": int(calib.attention_mask.sum()), "num_blocks": num_blocks(model), "predicted": predicted,
           "throughput": {"block_flops_per_second": throughput.block_flops_per_second,
                          "head_flops_per_second": throughput.head_flops_per_second, "source": throughput.source},
           "order": ["sleb", "scoring", "search"], "load": {}}
    queue.put((False, copy.deepcopy(out)))  # each phase (each search budget) is sent as it ends: a stopped run keeps what finished
    # SLEB first (what prune(strategy="sleb") runs: sleb() with the config's protect, batch and memory budget),
    # each step's evaluator call stamped
    steps, evaluate = [], sleb_module.removal_nll_values

    def stamped(*args, **kwargs):
        values = evaluate(*args, **kwargs)
        steps.append(stamp())
        return values

    out["load"]["sleb"] = [start()]
    sleb_module.removal_nll_values = stamped
    try:
        found = sleb_module.sleb(model, calib, list(range(1, top + 1)), protect=cfg.protect, batch_size=cfg.batch_size,
                                 max_memory=budget)
    finally:
        sleb_module.removal_nll_values = evaluate
    out["load"]["sleb"].append(os.getloadavg()[0])
    out["sleb"] = {str(k): {**steps[k - 1], "removed": r.removed, "counted_block_passes": r.block_passes,
                            "evaluator_calls": r.evaluator_calls} for k, r in found.items()}
    queue.put((False, copy.deepcopy(out)))
    # the default prune: its scoring (ScoreStep's call), then its search (SelectStep's) for budgets 1..top at once
    out["load"]["scoring"] = [start()]
    report = hl.score_layers(model, calib, protocols=cfg.scored_protocols(), max_gap=min(cfg.max_gap, out["num_blocks"] - 1),
                             batch_size=cfg.batch_size, progress=False, seed=cfg.seed, max_memory=budget)
    out["scoring"] = {**stamp(), "protocols": list(report.protocols), "pairs": len(report.pairs)}
    out["load"]["scoring"].append(os.getloadavg()[0])
    queue.put((False, copy.deepcopy(out)))
    out["load"]["search"], out["search"] = [start()], {}

    def budget_done(n, record):
        out["search"][str(n)] = {**stamp(), "removed": record["selected"],
                                 "counted_block_passes": record["cost"]["block_passes"],
                                 "evaluator_calls": record["cost"]["evaluator_calls"]}
        out["load"]["search"][1:] = [os.getloadavg()[0]]
        queue.put((n == top, copy.deepcopy(out)))

    options = {k: v for k, v in cfg.selection_options().items() if k not in ("objective", "progress")}
    hl.search_select(report, list(range(1, top + 1)), model=model, calibration=calib,
                     objective=cfg.selection_options()["objective"], protect=cfg.protect, spacing=cfg.spacing,
                     batch_size=cfg.batch_size, max_memory=budget, on_budget=budget_done, **options)


def _prune_part(name, num_prompts, seq_len, report_path, queue):
    import torch
    import hf_layerswap as hl
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path, calib = _calibration(name, num_prompts, seq_len)
    config = hl.LayerSwapConfig(num_to_remove=2, num_prompts=num_prompts, seq_len=seq_len, progress=False)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    count = [0]
    for block in model.model.layers:
        block.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    t0 = time.perf_counter()
    result = hl.prune(model, config, calibration=calib)
    seconds = time.perf_counter() - t0
    result.report.selections.clear()
    result.report.to_json(report_path)
    queue.put({"block_passes": count[0], "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "seconds": seconds, "removed": result.removed})


def _search_part(name, num_prompts, seq_len, report_path, queue):
    import torch
    import hf_layerswap as hl
    from transformers import AutoModelForCausalLM
    from hf_layerswap.selection.objectives import SetObjective

    torch.set_num_threads(1)
    path, calib = _calibration(name, num_prompts, seq_len)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    report = hl.SwapReport.from_json(report_path)  # the prune's scores, on these prompts
    out = {}
    for label, memory in (("recomputed", 0), ("kept", None)):
        f = SetObjective(model, calib, reference_memory=memory)
        t0 = time.perf_counter()
        found = hl.search_select(report, list(range(1, 7)), model=model, calibration=calib, evaluator=f)
        out[label] = {"cost": found[6]["total_cost"], "seconds": time.perf_counter() - t0,
                      "selected": {n: found[n]["selected"] for n in found},
                      "values": {n: float(found[n]["value"]).hex() for n in found}}
    queue.put(out)


def _streamed_part(name, num_prompts, seq_len, queue):
    """A quarter of the weights in memory, the rest on disk: the block loads ``estimate_cost``
    predicts against the ones counted (scoring, the search's budget 1), then the search for
    n = 1, 2 with the dense reference recomputed per call and kept, side by side."""
    import tempfile

    import torch
    import hf_layerswap as hl
    from hf_layerswap.cost import Throughput
    from hf_layerswap.models import load_model
    from hf_layerswap.selection.objectives import SetObjective

    torch.set_num_threads(1)
    path, calib = _calibration(name, num_prompts, seq_len)
    weights = (path / "model.safetensors").stat().st_size
    config = hl.LayerSwapConfig(num_to_remove=1, num_prompts=num_prompts, seq_len=seq_len, progress=False)
    out = {"cap": STREAMED_CAP}
    with tempfile.TemporaryDirectory(prefix="offload-") as folder:
        model, _ = load_model(path, max_memory={"cpu": int(STREAMED_CAP * weights)}, offload_folder=folder)
        estimate = hl.estimate_cost(model, config, calibration=calib, throughput=Throughput(1e9, 1e9, 1e9))
        out["predicted"] = {k: estimate.phases[k]["block_loads"] for k in ("scoring", "selection")}
        t0 = time.perf_counter()
        report = hl.score_layers(model, calib, progress=False, batch_size=config.batch_size)
        out["scoring"] = {"block_loads": report.metadata["movement"]["block_onloads"],
                          "offloaded_blocks": report.metadata["movement"]["offloaded_blocks"],
                          "seconds": time.perf_counter() - t0}
        for label, memory in (("recomputed", 0), ("kept", None)):
            f = SetObjective(model, calib, batch_size=config.batch_size, reference_memory=memory)
            t0 = time.perf_counter()
            found = hl.search_select(report, [1, 2], model=model, calibration=calib, evaluator=f)
            out[label] = {"cost_n1": found[1]["cost"], "cost": found[2]["total_cost"],
                          "seconds": time.perf_counter() - t0,
                          "selected": {n: found[n]["selected"] for n in found},
                          "values": {n: float(found[n]["value"]).hex() for n in found}}
    queue.put(out)


def _passes_part(name, num_prompts, seq_len, queue):
    """The search for n = 1..6 and SLEB for n = 6 with the same engine tricks, in block and head passes."""
    import torch
    import hf_layerswap as hl
    from transformers import AutoModelForCausalLM
    from hf_layerswap.layerplan import num_blocks, removal_plan
    from hf_layerswap.selection.objectives import SetObjective, plans_cost
    from hf_layerswap.selection.sleb import sleb

    torch.set_num_threads(1)
    path, calib = _calibration(name, num_prompts, seq_len)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    total = num_blocks(model)
    report = hl.score_layers(model, calib, max_gap=1, progress=False)  # the prune's scoring: both protocols, adjacent
    f = SetObjective(model, calib)
    t0 = time.perf_counter()
    found = hl.search_select(report, list(range(1, 7)), model=model, calibration=calib, evaluator=f)
    search_seconds = time.perf_counter() - t0
    scored = {k: removal_plan(total, [int(x) for x in k.split(",")]) for k in f.cache}
    _, untreed = plans_cost(scored, total, f.reference_passes)  # each candidate from its first removed block, no tree
    t0 = time.perf_counter()
    r = sleb(model, calib, 6)
    sleb_seconds = time.perf_counter() - t0
    block_params = sum(p.numel() for p in model.model.layers[0].parameters())
    queue.put({
        "search": {"cost": found[6]["total_cost"], "block_passes_without_tree": untreed, "seconds": search_seconds,
                   "selected": {n: found[n]["selected"] for n in found},
                   "values": {n: float(found[n]["value"]).hex() for n in found}},
        "sleb": {"forward_passes": r.forward_passes, "block_passes": r.block_passes,
                 "head_passes": r.details["head_passes"], "evaluator_calls": r.evaluator_calls,
                 "removed": r.removed, "seconds": sleb_seconds,
                 "values": [float(s["nll"]).hex() for s in r.details["steps"]], "steps": r.details["steps"]},
        "num_blocks": total, "head_per_block": model.get_output_embeddings().weight.numel() / block_params,
    })


def sleb_counts(steps, num_blocks: int, protect=(0, -1)) -> dict:
    """SLEB's forward, block and head passes, recomputed from its stored steps (each step's
    candidates are every unprotected block not yet removed): ``before`` with each candidate
    run alone from its first removed block and the dense reference once per step, ``after``
    with the candidates of a step sharing their prefix tree and the reference once in all
    (what :func:`~hf_layerswap.selection.sleb.sleb` now runs). Deterministic: the same
    schedule the code runs."""
    from hf_layerswap.layerplan import removal_plan
    from hf_layerswap.scoring.rule import resolve_protect
    from hf_layerswap.scoring.probes import make_probes, schedule_blocks
    from hf_layerswap.selection.objectives import plans_cost

    protected = resolve_protect(protect, num_blocks)
    allowed = [b for b in range(num_blocks) if b not in protected]
    removed, before, tree, sets = [], 0, 0, 0
    for step in steps:
        plans = {b: removal_plan(num_blocks, sorted(removed + [b])) for b in allowed if b not in removed}
        before += plans_cost(plans, num_blocks)[1]
        tree += schedule_blocks(list(make_probes(plans, num_blocks)[1].values()), "shared")
        sets += len(plans)
        removed.append(int(step["removed"]))
    return {"sets": sets, "before": {"forward_passes": sets + len(steps), "block_passes": before},
            "after": {"forward_passes": sets + 1, "block_passes": tree + num_blocks, "head_passes": sets + 1}}


def _child(target, *args):
    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def _child_stream(target, *args):
    """Run ``target(*args, queue)`` in a fresh process; yield each ``(last, result)`` it sends
    until ``last`` (a child that dies before raises ``RuntimeError``)."""
    import queue as queues

    channel = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=target, args=(*args, channel))
    proc.start()
    while True:
        try:
            last, result = channel.get(timeout=30)
        except queues.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{target.__name__} ended (exit code {proc.exitcode}) before its last result")
            continue
        yield result
        if last:
            break
    proc.join()


#: Share of the weights held in CPU memory in the streamed part (the rest offloaded to disk).
STREAMED_CAP = 0.25

#: Sustained read rate assumed for weights streamed from an NVMe disk (PCIe 4 x4, sequential).
DISK_BYTES_PER_SECOND = 7e9


def _seventy_b():
    import dataclasses

    import hf_layerswap as hl
    import torch
    from accelerate import init_empty_weights
    from hf_layerswap.calibration import CalibrationSet
    from hf_layerswap.cost import Throughput
    from hf_layerswap.scoring.engine import plan_engine
    from hf_layerswap.scoring.settings import EngineSettings, resolve_memory
    from hf_layerswap.scoring.layerscores import swap_plans
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, torch_dtype="bfloat16")
    rates = Throughput(0.4 * 989e12, 0.5 * 67e12, 25e9,
                       source="assumed H100-class: 40% of 989 TFLOP/s bf16 dense for blocks, 50% of 67 TFLOP/s fp32 "
                              "for the head, 25 GB/s host-to-device (PCIe 5 x16, pinned)")
    config = hl.LayerSwapConfig(num_to_remove=8)
    est = hl.estimate_cost(cfg, config, device="cuda", throughput=rates, stream_weights=True, max_memory=8 << 30)
    disk = hl.estimate_cost(cfg, config, device="cuda", stream_weights=True, max_memory=8 << 30,
                            throughput=dataclasses.replace(rates, host_bytes_per_second=DISK_BYTES_PER_SECOND))
    # the scoring engine's own plan of the same run (the model on the meta device, full prompts): its groups
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    ids = torch.zeros(config.num_prompts, config.seq_len, dtype=torch.long)
    plan = plan_engine(model, CalibrationSet(ids, torch.ones_like(ids), "full prompts"),
                       swap_plans(80, config.max_gap, ("replacement", "interchange")),
                       EngineSettings(batch_size=config.batch_size, max_memory=8 << 30)).plan(streamed=True)
    # one batch's kept reference: the streams entering blocks 1..79 and the final rows, in the search's share
    entry = ((plan.num_blocks - 1) * plan.batches[0].positions + plan.batches[0].real_positions) * plan.hidden * 2
    kept = resolve_memory(8 << 30, "cuda").split()[0].bytes
    return {"plan": {"batches": len(plan.batches), "probes": plan.probes,
                     "probe_groups": list(plan.batches[0].probe_groups), "block_loads": plan.block_loads,
                     "state_capacity": plan.state_capacity(plan.batches[0].positions),
                     "reference_entry_bytes": entry, "reference_kept_batches": min(len(plan.batches), kept // entry)},"block_passes": est.block_passes, "head_passes": est.head_passes, "flops": est.flops,
            "bytes_moved": est.bytes_moved, "peak_memory_bytes": est.peak_memory_bytes, "seconds": est.seconds,
            "phases": est.phases, "throughput": rates.source,
            "disk": {"bytes_per_second": DISK_BYTES_PER_SECOND, "seconds": disk.seconds,
                     "phases": {k: p["seconds"] for k, p in disk.phases.items()}}}


#: The search for n = 1..6 and SLEB for n = 6 of the quality runs (results/quality-*.md; their
#: calibration: 16 prompts x 128 tokens), with the search's allowance of before SLEB's schedule:
#: candidate sets, forward passes with the reference recomputed per evaluator call, SLEB's
#: forward passes.
QUALITY = {"smollm2-135m": {"sets": 155, "before": 172, "sleb": 159},
           "gemma3-270m": {"sets": 103, "before": 116, "sleb": 87}}
#: Their decoder blocks (the quality pages' rows of block passes are recomputed with them).
QUALITY_BLOCKS = {"smollm2-135m": 30, "gemma3-270m": 18}


def _gib(n):
    return f"{n / 2**30:.2f} GiB"


def _prune_rows(out):
    rows = ["| model | block passes: predicted | measured | ratio | peak memory: predicted | measured (RSS) | "
            "ratio | seconds: predicted | measured | ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in out["prune"].items():
        p, m = r["predicted"], r["measured"]
        rows.append(f"| {name} | {p['block_passes']:,} | {m['block_passes']:,} | {p['block_passes'] / m['block_passes']:.2f} "
                    f"| {_gib(p['peak_memory_bytes'])} | {_gib(m['peak_rss_bytes'])} | "
                    f"{p['peak_memory_bytes'] / m['peak_rss_bytes']:.2f} | {p['seconds']:.0f} | {m['seconds']:.0f} | "
                    f"{p['seconds'] / m['seconds']:.2f} |")
    return rows


def _search_rows(out):
    rows = ["| model | calibration | candidate sets | forward passes: reference per call | reference kept | "
            "reference sweeps | seconds: per call | kept | SLEB n = 6 (forward passes) | kept / SLEB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in out["search"].items():
        before, after = r["recomputed"], r["kept"]
        rows.append(f"| {name} | {out['num_prompts']} x {out['seq_len']} (measured) | {after['cost']['evaluator_calls']} | "
                    f"{before['cost']['forward_passes']} | {after['cost']['forward_passes']} | "
                    f"{before['cost']['reference_passes']} -> {after['cost']['reference_passes']} | "
                    f"{before['seconds']:.0f} | {after['seconds']:.0f} | - | - |")
    for name, q in QUALITY.items():
        sleb_passes = _quality_sleb(name)["after"]["forward_passes"]
        rows.append(f"| {name} | {_quality_cal(name)} (quality run; kept = sets + 1) | {q['sets']} | {q['before']} | {q['sets'] + 1} | "
                    f"{q['before'] - q['sets']} -> 1 | - | - | {sleb_passes} | {(q['sets'] + 1) / sleb_passes:.2f} |")
    return rows


def _quality_cal(name) -> str:
    """``"P x T"``: the calibration of the stored quality run of ``name``."""
    cal = json.loads((RESULTS / f"quality-{name}.json").read_text())["comparison"]["calibration"]
    return f"{cal['num_prompts']} x {cal['seq_len']}"


def _quality_sleb(name) -> dict:
    """SLEB n = 6 of the quality run, its passes recomputed from its stored steps (:func:`sleb_counts`)."""
    crit = json.loads((RESULTS / f"quality-{name}.json").read_text())["criteria"]
    return sleb_counts(crit["sleb"]["6"]["details"]["steps"], QUALITY_BLOCKS[name])


def _equivalents(blocks, heads, ratio) -> float:
    return blocks + ratio * heads


def _passes_rows(out) -> list[str]:
    """The measured rows (search n = 1..6, SLEB n = 6) and the quality runs' rows."""
    rows = ["| model | calibration | method | candidate sets | forward passes | block passes: before | after | "
            "head passes | block-pass equivalents (blocks + r x heads) |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    verdicts = []
    for name, r in out.get("passes", {}).items():
        ratio, total = r["head_per_block"], r["num_blocks"]
        c, sl = r["search"]["cost"], r["sleb"]
        before = sleb_counts(sl["steps"], total)
        search_eq = _equivalents(c["block_passes"], c["head_passes"], ratio)
        sleb_eq = _equivalents(sl["block_passes"], sl["head_passes"], ratio)
        cal = f"{out['num_prompts']} x {out['seq_len']} (measured)"
        rows.append(f"| {name} (r = {ratio:.1f}) | {cal} | search, n = 1..6 | {c['evaluator_calls']} | {c['forward_passes']} | "
                    f"{r['search']['block_passes_without_tree']:,} | {c['block_passes']:,} | {c['head_passes']} | "
                    f"{search_eq:,.0f} |")
        rows.append(f"| {name} | {cal} | SLEB, n = 6 | {sl['evaluator_calls']} | {before['before']['forward_passes']} -> "
                    f"{sl['forward_passes']} | {before['before']['block_passes']:,} | {sl['block_passes']:,} | "
                    f"{sl['head_passes']} | {sleb_eq:,.0f} |")
        recomputed = before["after"] == {k: sl[k] for k in ("forward_passes", "block_passes", "head_passes")}
        old = out.get("search", {}).get(name, {}).get("kept", {})
        same = (old.get("selected") == r["search"]["selected"], old.get("values") == r["search"]["values"])
        verdicts.append((name, c, sl, search_eq, sleb_eq, recomputed, same))
    for name, q in QUALITY.items():
        total = QUALITY_BLOCKS[name]
        crit = json.loads((RESULTS / f"quality-{name}.json").read_text())["criteria"]
        s_cost, counts = crit["search"]["6"]["details"]["search_cost"], _quality_sleb(name)
        untreed = s_cost["block_passes"] - (q["before"] - q["sets"] - 1) * total  # its reference sweeps -> 1
        rows.append(f"| {name} | {_quality_cal(name)} (quality run) | search, n = 1..6 | {q['sets']} | {q['sets'] + 1} | "
                    f"{untreed:,} | <= {untreed:,} | >= {q['sets'] + 1} | - |")
        rows.append(f"| {name} | {_quality_cal(name)} (quality run) | SLEB, n = 6 | {counts['sets']} | "
                    f"{counts['before']['forward_passes']} -> {counts['after']['forward_passes']} | "
                    f"{counts['before']['block_passes']:,} | {counts['after']['block_passes']:,} | "
                    f"{counts['after']['head_passes']} | - |")
    missing = [name for name in MODELS if name not in out.get("passes", {})]
    notes = [f"- {name}: not measured at {out['num_prompts']} x {out['seq_len']} for this page (the search and SLEB "
             "with the scoring before them would take about an hour of this shared machine per model); its rows are the "
             "quality run's, and the exactness check below covers it." for name in missing]
    return rows + [""] + notes + [
        f"- {name}: search {c['block_passes']:,} block passes vs SLEB {sl['block_passes']:,} "
        f"({c['block_passes'] / sl['block_passes']:.2f}x); head passes {c['head_passes']} vs {sl['head_passes']}; "
        f"block-pass equivalents {se:,.0f} vs {le:,.0f} ({se / le:.2f}x). SLEB's measured counts equal the ones "
        f"recomputed from its steps: {ok}. The search's sets for n = 1..6 equal those of the reference-reuse "
        f"run above (the code before this change, on the prune's report): {same[0]}; values (`float.hex`): {same[1]}."
        for name, c, sl, se, le, ok, same in verdicts]


def _schedule(name) -> dict | None:
    """The stored rerun of the search with SLEB's schedule (``benchmarks/search_schedule.py``)."""
    path = RESULTS / f"search-schedule-{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _schedule_rows() -> list[str]:
    """Per model and n: the search with SLEB's schedule against the stored run (before it)."""
    rows = ["| model | n | set: SLEB's schedule | removal KL | set: before | removal KL | same set | PPL: after "
            "| before | candidate sets: after | before | forward passes: after | SLEB for n |",
            "|---|---:|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for name in QUALITY:
        run = _schedule(name)
        if run is None:
            notes.append(f"- {name}: not run yet.")
            continue
        removable = QUALITY_BLOCKS[name] - 2
        for key, r in run["budgets"].items():
            n, old = int(key), r["stored"]
            sleb_passes = sum(removable - k for k in range(n)) + 1  # SLEB's steps 1..n + its one reference
            ppl = (f"{r['ppl']:.2f} | {old['ppl']:.2f}" if "ppl" in r else "= | =")
            rows.append(f"| {name} | {n} | {{{','.join(map(str, r['removed']))}}} | {r['value']:.4f} | "
                        f"{{{','.join(map(str, old['removed']))}}} | {old['value']:.4f} | "
                        f"{'yes' if r['same_set'] else '**no**'} | {ppl} | {r['evaluator_calls']} | "
                        f"{old['evaluator_calls']} | {r['forward_passes']} | {sleb_passes} |")
        done, rows_run = sorted(int(k) for k in run["budgets"]), run["budgets"].values()
        drift = max(abs(r["value"] - r["stored"]["value"]) / abs(r["stored"]["value"]) for r in rows_run)
        same = sum(r["same_set"] for r in rows_run)
        notes.append(f"- {name}: `{run['command']}`, n = {done[0]}..{done[-1]} done"
                     + (" of 1..6 when this page was written" if done[-1] < 6 else "")
                     + f", {run['seconds']:.0f} s; allowances per budget {run['allowances']}. The same set as before "
                     f"at {same} of {len(done)} budgets; removal KL within {drift:.1e} relative of the stored run's "
                     f"(equal in `float.hex`: {sum(r['value_hex'] == r['stored']['value_hex'] for r in rows_run)} of "
                     f"{len(done)}).")
    return rows + [""] + notes


def _target_line() -> str:
    """The verdict on the issue's target at the quality runs' calibration, with SLEB's schedule."""
    parts = []
    for name, q in QUALITY.items():
        sleb_after = _quality_sleb(name)["after"]["forward_passes"]
        run = _schedule(name) or {"budgets": {}}
        six = run["budgets"].get("6")
        mine = (f"{six['forward_passes']} vs SLEB's {sleb_after}, "
                f"{'met' if six['forward_passes'] <= sleb_after else 'missed'}" if six else
                f"not measured to n = 6 (at most {sum(range(QUALITY_BLOCKS[name] - 7, QUALITY_BLOCKS[name] - 1)) + 1} "
                f"by construction vs SLEB's {sleb_after})")
        parts.append(f"{name}: {mine} (the allowance before: {q['sets'] + 1}, "
                     f"{'met' if q['sets'] + 1 <= sleb_after else 'missed'})")
    return ("Target (search for n = 1..6 at most SLEB's forward passes for n = 6, on both models), at the quality "
            "runs' calibration (" + _quality_cal(next(iter(QUALITY))) + "): " + "; ".join(parts) + ". The search "
            "spends one forward pass per distinct candidate set (no set is scored twice) plus the one reference "
            "sweep; with SLEB's schedule (budget n scores at most U - (n - 1) sets, the protocols' own sets inside) "
            "budgets 1..6 score at most SLEB's sets for n = 6, so its forward passes are at most SLEB's by "
            "construction. The exact savings of this page lower block passes, the unit in which prefix reuse "
            "counts; the lines under the table compare both methods in it, and in block-pass equivalents, where "
            "the head passes (one per candidate) decide on Gemma-3-270M.")


def _default_rows(out) -> list[str]:
    if not out.get("default"):
        return []
    rows = ["At the default calibration (64 prompts x 128 tokens), predicted only, same command:", "",
            "| model | block passes (scoring / search bound) | peak memory | seconds: scoring | whole prune (bound) |",
            "|---|---:|---:|---:|---:|"]
    for name, d in out["default"].items():
        sc, se = d["phases"]["scoring"], d["phases"].get("selection", {"block_passes": 0, "flops": 0})
        share = sc["flops"] / (sc["flops"] + se["flops"])
        rows.append(f"| {name} | {sc['block_passes']:,} / {se['block_passes']:,} | {_gib(d['peak_memory_bytes'])} | "
                    f"{d['seconds'] * share / 60:.0f} min | {d['seconds'] / 60:.0f} min |")
    return rows + ["", "(seconds: split between scoring and search by their FLOPs.)", *_allowance_note(out), ""]


def _allowance_note(out) -> list[str]:
    """Where the stored estimates bound more candidate sets than the search's allowance now
    scores (SLEB's schedule), say so: they stay upper bounds, looser ones."""
    older = []
    for name, d in out["prune"].items():
        sets = d["predicted"]["phases"].get("selection", {}).get("sets")
        now = sum(QUALITY_BLOCKS[name] - 2 - k for k in range(2))  # SLEB's steps 1 and 2
        if sets is not None and sets > now:
            older.append(f"{name} {sets} candidate sets at n = 2, now at most {now}")
    if not older:
        return []
    return ["", "The estimates of this section (and the prune rows above, with their measured prunes) were run with "
            "the search's allowance before SLEB's schedule (next sections): " + "; ".join(older) + ". Their search "
            "bounds stay upper bounds of the search as it is now, looser ones; not rerun for this page."]


def _prune_verdict(out) -> str:
    parts = []
    for name, r in out["prune"].items():
        p, m = r["predicted"], r["measured"]
        mem, sec = p["peak_memory_bytes"] / m["peak_rss_bytes"], p["seconds"] / m["seconds"]
        parts.append(f"{name}: peak memory {mem:.2f}x ({'met' if abs(mem - 1) <= 0.25 else 'missed'}), "
                     f"seconds {sec:.2f}x ({'met' if 0.5 <= sec <= 2 else 'missed'})")
    return "Targets: " + "; ".join(parts) + "."


def _compute_lines(out: dict) -> list[str]:
    """The ``compute`` part: predicted block and head work of the default prune and of SLEB."""
    if not out.get("compute"):
        return []
    lines = []
    for name, d in out["compute"].items():
        t = d["throughput"]
        lines += [f"{name}, default calibration (64 x 128, {d['real_positions']:,} real positions); TFLOP: 1e12 "
                  "floating-point operations (a multiply-add counts 2); seconds at the throughput probe's one-thread rates "
                  f"({t['block_flops_per_second'] / 1e9:.1f} GFLOP/s in a block, "
                  f"{t['head_flops_per_second'] / 1e9:.1f} GFLOP/s in the head); *SLEB alone* is its selection "
                  "(`select_layers(strategy=\"sleb\")`), *SLEB, prune* is `prune(strategy=\"sleb\")`, which scores no swap-KL table for a strategy that reads none (`score_protocols=[...]` adds that scoring), so it equals SLEB alone.",
                  "",
                  "| n | method | block passes | block TFLOP | head TFLOP | head share | seconds | "
                  "vs SLEB alone: all FLOPs | block FLOPs only (a free head) |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for n in COMPUTE_BUDGETS:
            rows = {m: d["rows"][f"{m} {n}"] for m in ("default", "sleb")}
            alone = rows["sleb"]["selection"]
            cells = [("default prune (both protocols + search)", list(rows["default"].values())),
                     ("SLEB, prune", list(rows["sleb"].values())), ("SLEB alone", [alone])]
            for label, phases in cells:
                blocks = sum(p["block_passes"] for p in phases)
                bf, hf = sum(p["block_flops"] for p in phases), sum(p["head_flops"] for p in phases)
                sec = sum(p["seconds"] for p in phases)
                lines.append(f"| {n} | {label} | {blocks:,} | {bf / 1e12:.1f} | {hf / 1e12:.1f} | {hf / (bf + hf):.0%} | "
                             f"{sec / 60:.1f} min | {(bf + hf) / (alone['block_flops'] + alone['head_flops']):.2f}x | "
                             f"{bf / alone['block_flops']:.2f}x |")
        lines += ["", *_compute_reading(d)]
    return lines


def _compute_reading(d: dict) -> list[str]:
    """What the ``compute`` rows say about the target (the default prune's CPU-seconds at most
    SLEB's at the same n): its ratio, the head's part, and the bound with a free head."""
    def total(phases, key):
        return sum(p[key] for p in phases)

    seconds, blocks_only, shares, sleb_shares = [], [], [], []
    for n in COMPUTE_BUDGETS:
        default, alone = list(d["rows"][f"default {n}"].values()), [d["rows"][f"sleb {n}"]["selection"]]
        seconds.append(total(default, "seconds") / total(alone, "seconds"))
        blocks_only.append(total(default, "block_flops") / total(alone, "block_flops"))
        shares.append(total(default, "head_flops") / (total(default, "head_flops") + total(default, "block_flops")))
        sleb_shares.append(total(alone, "head_flops") / (total(alone, "head_flops") + total(alone, "block_flops")))
    scoring = d["rows"][f"default {COMPUTE_BUDGETS[0]}"]["scoring"]
    first = d["rows"][f"sleb {COMPUTE_BUDGETS[0]}"]["selection"]
    ratio = (scoring["head_flops"] / scoring["head_rows"]) / (scoring["block_flops"] / scoring["block_tokens"])
    listed = ", ".join(f"{x:.2f}x" for x in seconds)
    free = ", ".join(f"{x:.2f}x" for x in blocks_only)
    return [
        f"Reading, against the target that the default prune take at most SLEB's CPU-seconds at the same n: missed "
        f"at n = {', '.join(map(str, COMPUTE_BUDGETS))} ({listed} of SLEB alone's predicted seconds; the ratio falls "
        "with n, since the scoring is paid once and SLEB's steps grow with n). The output head is the larger part "
        f"of the default prune's compute ({min(shares):.0%} to {max(shares):.0%} of its FLOPs): one head pass over "
        f"a position costs {ratio:.1f} block passes (a 262,144-entry vocabulary); SLEB's own compute is "
        f"{min(sleb_shares):.0%} to {max(sleb_shares):.0%} head. Even with a free head the target stays out of reach: the default prune's block FLOPs "
        f"alone are {free} SLEB alone's, and the scoring of both protocols by itself runs "
        f"{scoring['block_passes']:,} block passes ({scoring['block_flops'] / 1e12:.1f} block TFLOP) against "
        f"SLEB's whole selection at n = {COMPUTE_BUDGETS[0]}: {first['block_passes']:,} "
        f"({first['block_flops'] / 1e12:.1f} block TFLOP). Meeting it needs fewer block passes in the scoring and "
        "the search (fewer probes or sets), not only a cheaper head.",
        "",
    ]


def _measured_section(out: dict) -> list[str]:
    """The section "The default prune against SLEB: measured" (nothing before the part ran)."""
    lines = _measured_lines(out)
    return ["## The default prune against SLEB: measured", "", *lines] if lines else []


def _measured_lines(out: dict) -> list[str]:
    """The ``measured`` part: per n, the default prune's CPU seconds (scoring + search to n)
    against SLEB's, the predicted ratio, block passes counted and predicted, the sets removed."""
    if not out.get("measured"):
        return []
    lines = []
    for name, d in out["measured"].items():
        t = d["throughput"]
        lines += [
            f"Command: `{d['command']}` (the `measured` part: one process, one torch thread). {name} loaded in bf16 "
            f"(`from_pretrained(..., dtype=torch.bfloat16)`), calibration {d['num_prompts']} prompts x {d['seq_len']} "
            f"tokens ({d['real_positions']:,} real positions), batch {d['batch_size']}: smaller than the default "
            "64 x 128 so the run fits this shared machine; the ratio, not the absolute time, is what is compared. "
            "*CPU s* = `time.process_time()` of the process over the phase. Run order: SLEB to n = 6 in one call "
            "(`sleb`, what `prune(strategy=\"sleb\")` runs, each step's evaluator call stamped), then the default "
            "prune's scoring once (`score_layers`: both protocols, adjacent pairs, as its score step calls it), then "
            "its search for budgets 1..6 in one call (`search_select`, as its select step calls it, each budget "
            "stamped by `on_budget`; budget n depends only on budgets 1..n, so the stamp at n is what "
            "`prune(LayerSwapConfig(num_to_remove=n))` spends). Block passes (one decoder block over one batch) "
            "counted by forward hooks on the blocks; predicted by `estimate_cost(path, config, calibration=..., "
            f"dtype=torch.bfloat16)` of the same configs in the same process (throughput probe: "
            f"{t['block_flops_per_second'] / 1e9:.1f} GFLOP/s in a block, {t['head_flops_per_second'] / 1e9:.1f} "
            "GFLOP/s in the head); *predicted ratio* = its seconds of the default prune over SLEB's. Load average "
            "(1 min) at the start and end of each phase: "
            + ", ".join(f"{phase} " + " -> ".join(f"{x:.2f}" for x in load) for phase, load in d["load"].items()) + ".",
            "",
            "| n | default prune CPU s (scoring + search) | SLEB CPU s | ratio | predicted ratio | block passes: "
            "default, counted | predicted | SLEB, counted | predicted | sets scored: search | SLEB | removed: default "
            "prune | SLEB |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        done = [n for n in COMPUTE_BUDGETS if "scoring" in d and str(n) in d.get("search", {}) and str(n) in d.get("sleb", {})]
        scoring, ratios, shares, same, predictions = d.get("scoring"), [], [], [], []
        for n in done:
            search, sleb = d["search"][str(n)], d["sleb"][str(n)]
            default = scoring["cpu_seconds"] + search["cpu_seconds"]
            pd, ps = d["predicted"][f"default {n}"], d["predicted"][f"sleb {n}"]
            predicted = sum(p["seconds"] for p in pd.values()) / sum(p["seconds"] for p in ps.values())
            ratios.append(default / sleb["cpu_seconds"])
            predictions.append(predicted)
            shares.append(scoring["cpu_seconds"] / default)
            same.append(search["removed"] == sleb["removed"])
            lines.append(
                f"| {n} | {scoring['cpu_seconds']:.0f} + {search['cpu_seconds']:.0f} = {default:.0f} | "
                f"{sleb['cpu_seconds']:.0f} | {ratios[-1]:.2f}x | {predicted:.2f}x | "
                f"{scoring['block_passes'] + search['block_passes']:,} | "
                f"{sum(p['block_passes'] for p in pd.values()):,} | {sleb['block_passes']:,} | "
                f"{sum(p['block_passes'] for p in ps.values()):,} | {search['evaluator_calls']} | "
                f"{sleb['evaluator_calls']} | {_set(search['removed'])} | "
                f"{_set(sleb['removed'])} |")
        if not done:  # no row: no table
            lines = lines[:-3]
        if len(done) < len(COMPUTE_BUDGETS):  # a run stopped before its end: what finished
            lines += ["", f"Stopped before its end: n = {', '.join(str(n) for n in COMPUTE_BUDGETS if n not in done)} not "
                      f"measured (finished: SLEB to n = {len(d.get('sleb', {}))}, scoring: {'scoring' in d}, search to "
                      f"n = {len(d.get('search', {}))}).", ""]
        else:
            lines += ["", *_measured_reading(d, ratios, shares, same, predictions)]
    return lines


def _set(blocks) -> str:
    return "{" + ", ".join(map(str, blocks)) + "}"


def _measured_reading(d: dict, ratios: list[float], shares: list[float], same: list[bool],
                      predicted: list[float]) -> list[str]:
    """Whether the target (ratio <= 1 at every n) is met, the scoring's share, the search alone
    against SLEB, the predicted ratios against the measured ones, the sets scored and removed."""
    over = [p / r for p, r in zip(predicted, ratios)]
    excess = ", ".join(f"{d['scoring']['cpu_seconds'] + d['search'][str(n)]['cpu_seconds'] - d['sleb'][str(n)]['cpu_seconds']:.0f}"
                       for n in COMPUTE_BUDGETS)
    budgets = ", ".join(map(str, COMPUTE_BUDGETS))
    met = [n for n, r in zip(COMPUTE_BUDGETS, ratios) if r <= 1]
    verdict = ("met at every n" if len(met) == len(ratios) else
               f"missed at n = {', '.join(str(n) for n, r in zip(COMPUTE_BUDGETS, ratios) if r > 1)}"
               + (f", met at n = {', '.join(map(str, met))}" if met else ""))
    scored = ", ".join(f"{d['search'][str(n)]['evaluator_calls']} vs {d['sleb'][str(n)]['evaluator_calls']} at n = {n}"
                       for n in COMPUTE_BUDGETS)
    equal = [n for n, s in zip(COMPUTE_BUDGETS, same) if s]
    removed = f"the same set at n = {', '.join(map(str, equal))}" if equal else "a different set at every n"
    if equal and len(equal) < len(same):
        removed += f", a different one at n = {', '.join(str(n) for n, s in zip(COMPUTE_BUDGETS, same) if not s)}"
    batches = -(-d["num_prompts"] // d["batch_size"])  # the hooks count per batch, the methods per sweep of the prompts
    alone = ", ".join(f"{d['search'][str(n)]['cpu_seconds'] / d['sleb'][str(n)]['cpu_seconds']:.2f}x" for n in COMPUTE_BUDGETS)
    counted = all(d[m][str(n)]["block_passes"] == batches * d[m][str(n)]["counted_block_passes"]
                  for m in ("search", "sleb") for n in COMPUTE_BUDGETS)
    return [
        f"Reading: the target (the default prune's CPU seconds at most SLEB's at the same n, ratio <= 1) is "
        f"{verdict} (measured {', '.join(f'{r:.2f}x' for r in ratios)} at n = {budgets}). The scoring of both "
        f"protocols is paid once: {d['scoring']['cpu_seconds']:.0f} CPU s, {min(shares):.0%} to {max(shares):.0%} of "
        "the default prune's. The rest is the search, whose allowance is SLEB's schedule "
        "(`hf_layerswap.selection.search.search_allowances`: budgets 1..n score at most the sets SLEB's steps 1..n "
        f"score); candidate sets scored, search vs SLEB: {scored}; the search's CPU seconds alone are {alone} SLEB's, "
        f"and what the default prune spends above SLEB, {excess} CPU s, is about its scoring's "
        f"{d['scoring']['cpu_seconds']:.0f}. The predicted ratios are {min(over):.2f}x to {max(over):.2f}x the measured "
        "ones. "
        f"Removed: {removed} (the search minimises the "
        "removal KL, SLEB the calibration NLL). The block passes the hooks counted (per batch) equal those the search "
        f"and SLEB report themselves (per sweep of the prompts) times the {batches} batches: {counted}.",
        "",
    ]


def _streamed_lines(out: dict) -> list[str]:
    """The measured streamed rows: predicted vs counted block loads, the search with its
    reference recomputed per call and kept."""
    rows = out.get("streamed", {})
    if not rows:
        return []
    lines = [
        "Commands: " + "; ".join(f"`{r.get('command', out.get('commands', {}).get('streamed', ''))}`"
                                 for r in rows.values())
        + f" (the `streamed` part, one CPU thread, a fresh process per model). Each model loaded with `max_memory={{'cpu': {STREAMED_CAP} x its weights}}` and the "
        "rest offloaded to disk (`offload_folder`); `estimate_cost(model, LayerSwapConfig(num_to_remove=1, ...), "
        "calibration=...)` on that model, then `score_layers` and the search for n = 1, 2 on the same prompts "
        "(default settings, batch 8), once with the dense reference recomputed per evaluator call "
        "(`reference_memory=0`) and once kept (the default). *Block loads* are offloaded blocks brought over "
        "(`movement[\"block_onloads\"]`, the search's `total_cost[\"block_loads\"]`).",
        "",
        "| model | offloaded blocks | scoring block loads: predicted | counted | search n = 1: predicted | counted "
        "| search n = 1, 2: block loads, reference per call | kept | ratio | reference passes: per call | kept "
        "| seconds: per call | kept | same sets and values |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        rec, kept = r["recomputed"], r["kept"]
        same = rec["selected"] == kept["selected"] and rec["values"] == kept["values"]
        lines.append(
            f"| {name} | {r['scoring']['offloaded_blocks']} | {r['predicted']['scoring']:,} | "
            f"{r['scoring']['block_loads']:,} | {r['predicted']['selection']:,} | {kept['cost_n1']['block_loads']:,} | "
            f"{rec['cost']['block_loads']:,} | {kept['cost']['block_loads']:,} | "
            f"{kept['cost']['block_loads'] / max(rec['cost']['block_loads'], 1):.2f} | "
            f"{rec['cost']['reference_passes']} | {kept['cost']['reference_passes']} | {rec['seconds']:.0f} | "
            f"{kept['seconds']:.0f} | {'yes' if same else 'no'} |")
    lines += ["", "The predicted loads are the engine's own plan (`Engine.plan()`); the search's budget 1 (its "
              "single-removal call) is exact, later budgets an upper bound. With the reference kept, a later "
              "call starts each candidate from the kept stream entering its first removed block, so no reference "
              "pass runs and the blocks before it do not move.", ""]
    return lines


def _seventy_b_lines(b: dict) -> list[str]:
    """The 70B section's bullets from its stored prediction."""
    if not b:
        return ["(not run)"]
    plan, phases, disk = b.get("plan", {}), b.get("phases", {}), b.get("disk", {})
    scoring, search = phases.get("scoring", {}), phases.get("selection", {})
    groups = plan.get("probe_groups", [])
    batches = plan.get("batches", 0)
    per_block = scoring.get("block_loads", 0) // 80
    gb = 1e9
    return [
        f"- scoring: {plan.get('probes', 0)} swap probes per batch of 8 prompts x 128 tokens; a pass may hold "
        f"{plan.get('state_capacity', 0)} states of (B, T, H) = 16 MiB (a quarter of the budget), so each batch "
        f"runs {len(groups)} probe groups ({' + '.join(map(str, groups))} probes, each the longest run that fits) and "
        f"every block moves {len(groups)} times per batch: **{scoring.get('block_loads', 0):,} block loads, "
        f"{per_block} per block** over {batches} batches. Before this change the code cut 4 groups (two states "
        "held per probe: 63 probes a group), 32 loads per block, while its estimate assumed 8.",
        f"- search (an upper bound, its allowances): {search.get('calls', 0)} evaluator calls, {search.get('sets', 0)} "
        f"candidate sets, {search.get('block_loads', 0):,} block loads: its first call (the single-removal sweep) "
        "exactly as planned, then every call that scores sets streams the blocks from the first removable one per "
        f"batch and probe group. The kept reference (the search's half of the budget) holds "
        f"{plan.get('reference_kept_batches', 0)} of the {batches} batches ({_gib(plan.get('reference_entry_bytes', 0))} "
        "each: the streams entering 79 blocks); their probes start from their own slot, the other batches run the "
        "identity trunk again each call. Each call moves the model about once per batch: the "
        "search is bound by weight streaming.",
        f"- block passes {b.get('block_passes', 0):,} (scoring {scoring.get('block_passes', 0):,}; search upper bound "
        f"{search.get('block_passes', 0):,}), head passes {b.get('head_passes', 0):,}, "
        f"{b.get('flops', 0) / 1e15:.0f} PFLOP",
        f"- peak memory: GPU {_gib(b.get('peak_memory_bytes', {}).get('cuda', 0))} (embeddings, head, a window of 3 blocks "
        f"and the one read ahead, activations, the kept reference) of 80 GB: **fits**; host "
        f"{_gib(b.get('peak_memory_bytes', {}).get('cpu', 0))} (the bf16 weights)",
        f"- weights moved {b.get('bytes_moved', 0) / 1e12:.1f} TB (scoring {scoring.get('bytes_moved', 0) / 1e12:.1f}, "
        f"search {search.get('bytes_moved', 0) / 1e12:.1f}); predicted time **{b.get('seconds', 0) / 60:.0f} min** at "
        f"{b.get('throughput', '')}, of which {b.get('bytes_moved', 0) / 25e9 / 60:.0f} min are transfers, added to the "
        "compute time (on CUDA each block is read ahead from pinned memory on a side stream while the one before "
        "computes, so the run can take less where the two overlap). A prediction by the same arithmetic as the rows "
        "above, not a measurement.",
        f"- **What a 70B run needs:** host RAM for the bf16 weights, {b.get('peak_memory_bytes', {}).get('cpu', 0) / gb:.0f} "
        f"GB ({_gib(b.get('peak_memory_bytes', {}).get('cpu', 0))}) besides the system's own, held pinned once "
        "streaming starts; or the weights offloaded to disk (`load_model(..., offload_folder=...)`), read at disk "
        f"speed: at {disk.get('bytes_per_second', 0) / gb:.0f} GB/s (one NVMe drive, PCIe 4 x4) the same run takes "
        f"**{disk.get('seconds', 0) / 3600:.1f} h** (scoring {disk.get('phases', {}).get('scoring', 0) / 60:.0f} min, "
        f"search {disk.get('phases', {}).get('selection', 0) / 3600:.1f} h), the transfers dominating.",
    ]


def render(out) -> str:
    b = out.get("70b", {})
    lines = [
        "# Scale: the cost of a prune before it starts, and the search's reference computed once",
        "",
        f"Command: `{out['command']}` (one CPU thread: `torch.set_num_threads(1)` in every measuring process; "
        "a shared 2-core machine, so seconds carry noise from other work; ratios are what carries over).",
        "",
        "## Predicted vs measured: the default prune",
        "",
        f"`hl.estimate_cost(path, LayerSwapConfig(num_to_remove=2, num_prompts={out['num_prompts']}, "
        f"seq_len={out['seq_len']}), calibration=...)` in one process (meta-device model, throughput probe of one "
        "block and the head), then `hl.prune` of the same config in a fresh process (default strategy: scoring "
        "of both protocols, adjacent pairs, then the search), block passes counted by forward hooks, peak = the "
        "process's `ru_maxrss`. The search's passes are an upper bound by design (its allowances), so the "
        "predicted block passes exceed the measured ones. Targets: peak memory within 25%, seconds within 2x. "
        f"Calibration {out['num_prompts']} prompts x {out['seq_len']} tokens instead of the default 64 x 128, so "
        "the whole page fits about 20 minutes of this machine; `hf-layerswap prune MODEL OUT --num-to-remove 2 "
        "--dry-run` prints the estimate at the default.",
        "",
        *_prune_rows(out),
        "",
        _prune_verdict(out),
        "",
        *_default_rows(out),
        "## The search for n = 1..6: the dense reference computed once",
        "",
        "Every evaluator call of the search used to sweep the dense model again (`plan_kl`'s reference pass; "
        "`capture_residual_stream` for the nll and ghosted objectives). `SetObjective` now keeps each batch's "
        "reference (`hf_layerswap.scoring.reference.ReferenceCache`): the streams entering blocks 1..L-1 plus "
        "the exact reference (final hidden rows for the engine's streamed KL, fp32 log-probabilities otherwise, "
        "per-prompt NLL for nll), per batch while they fit the working-memory budget (1 GiB on a CPU), else "
        "recomputed once per call. Values are the same tensors: the selected sets and their values are "
        "bit-identical (tests/test_reference_cache.py asserts them with `float.hex`).",
        "",
        *_search_rows(out),
        "",
        "Measured rows: both runs in one process on the prune's swap-KL report; equal sets and values in both "
        "runs: " + ", ".join(f"{n}: {r['kept']['selected'] == r['recomputed']['selected'] and r['kept']['values'] == r['recomputed']['values']}"
                            for n, r in out["search"].items()) + ". "
        "Quality-run rows: the sets those runs scored are unchanged by the reuse, so forward passes after = "
        "candidate sets + 1 reference sweep. SLEB keeps the dense reference across its steps too now (next "
        "section), so its column is 81 + 1 and 153 + 1 forward passes (it was 81 + 6 and 153 + 6). "
        "Seconds: the reuse saves the reference sweeps (8-10% of the passes here), of the order of the "
        "wall-clock noise of this shared machine, so the seconds columns can show it or not.",
        "",
        "## The search for n = 1..6 against SLEB for n = 6, on equal footing",
        "",
        f"Command: `{out.get('commands', {}).get('passes', out['command'])}` (the `passes` part; one CPU thread). "
        "Units: a *forward pass* is one sweep over the calibration prompts, however late it starts (one per "
        "candidate set, plus the dense reference sweeps); a *block pass* is one decoder block over the calibration "
        "prompts (a full forward of an L-block model is L); a *head pass* is the output head over their real "
        "positions. r = multiply-adds per token of the head (vocabulary x hidden) over those of one block (its "
        "parameters): a head pass costs about r block passes (r is in the model column; Gemma-3-270M's "
        "262,144-entry vocabulary makes its head the larger part of every candidate); *block-pass equivalents* "
        "= block passes + r x head passes, attention's sequence-squared term left out.",
        "",
        "Both methods now run on the same engine tricks, all exact (each value is computed by the same block "
        "calls on the same inputs, so the sets and values are bit-identical): each candidate starts at its first "
        "removed block from the dense model's stream; the candidates of one evaluator call (search) or one step "
        "(SLEB) share their common prefixes as a tree (`hf_layerswap.scoring.probes.schedule`, the stream at "
        "each branch point captured once); the dense reference is computed once for the whole run "
        "(`ReferenceCache`). Before: SLEB (`plan_nll`) ran each candidate alone from its first removed block and "
        "swept the dense model at every step; the search's evaluator already ran the tree inside the scoring "
        "engine but reported block passes as if it did not (*before* columns; SLEB's *before* counts are the "
        "ones its code reported, recomputed from its steps). Head passes: the streamed KL runs the reference's "
        "head again for each group of candidates (each evaluator call of the search is at least one group), "
        "SLEB's NLL needs no reference head after the first sweep. Duplicates: the evaluator scores a set once "
        "(its cache), so candidate sets = distinct sets.",
        "",
        *_passes_rows(out),
        "",
        "Exactness on both real models, checked once against the code before this change (not part of the "
        "command): `plan_kl` (the search's evaluator) and `plan_nll` (SLEB's) of seven removal sets ({5}, {5,6}, "
        "{5,7}, {5,6,9}, {5,8,9}, {3,8}, {9,10}) on 2 prompts x 32 tokens, batch 1, give the same per-prompt "
        "values (`float.hex`) before and after, on SmolLM2-135M and Gemma-3-270M; `plan_nll`'s block passes "
        "drop from 188 to 183 and from 92 to 87 by the tree (`plan_kl`'s, 366 and 174 per batch, are unchanged: "
        "it ran the tree already). The search is a deterministic function of these values, so its sets are "
        "the same.",
        "",
        f"Quality-run rows ({_quality_cal(MODELS[0])}, the stored `results/quality-<model>.json`): SLEB's counts "
        "are recomputed "
        "from its stored steps (the candidates of step k are every unprotected block not yet removed; the "
        "tree is `schedule` of those plans: deterministic, the same schedule the code runs). The search's 103 "
        "and 155 candidate sets are not stored, only their count and cost, so its tree sharing there cannot "
        "be recomputed: its block passes are given without it (the stored count less the reference sweeps the "
        "cache now saves), an upper bound, and its head passes as the lower bound sets + 1.",
        "",
        _target_line(),
        "",
        "### The search's default allowance: SLEB's schedule",
        "",
        "Budget n of the search now scores at most what step n of SLEB scores, U - (n - 1) new sets for U = L - 2 "
        "removable blocks (budget 1: the single-removal sweep), each protocol's own greedy set inside that "
        "allowance (before: every budget n >= 2 got U new sets, the protocols' own sets on top). Budgets 1..N "
        "together score at most sum_{k<N} (U - k) sets, SLEB's count for N; the one exception to a budget's own "
        "allowance, a budget small enough to score exhaustively (at most `exhaustive_below`, default 24, sets), "
        "is taken only when its sets fit in what budgets 1..n may spend together, so the sum holds there too "
        "(`hf_layerswap.selection.search.search_allowances`). Rerun on each quality run's calibration "
        "(content hash checked) and stored swap-KL reports with one torch thread "
        "(`benchmarks/search_schedule.py`, results in `results/search-schedule-<model>.json`); removal KL in "
        "nats on the calibration prompts; PPL under the quality pages' contract (WikiText-2 test, first 5,000 "
        "words, window 512, stride 256), given where the set changed (= : the same set, its PPL unchanged); "
        "candidate sets and forward passes cumulative over budgets 1..n; *SLEB for n* = its steps 1..n plus "
        "its one reference sweep.",
        "",
        *_schedule_rows(),
        "",
        "## A 70B model on one 80 GB GPU (a prediction)",
        "",
        f"Command: `{out.get('commands', {}).get('70b', out['command'])}` (the `70b` part: no model is loaded, "
        "no weight read).",
        "",
        "`estimate_cost` on a Llama-3-70B-shaped `LlamaConfig` (80 blocks, hidden 8192, intermediate 28672, "
        "64 heads / 8 KV heads, vocabulary 128,256, bf16) built on the meta device (nothing downloaded), "
        "`LayerSwapConfig(num_to_remove=8)` (default calibration 64 x 128, default strategy), `device=\"cuda\"`, "
        "weights streamed from CPU memory, an 8 GiB working budget (scoring's cap on an accelerator). The block "
        "loads are the scoring engine's own plan (`hf_layerswap.scoring.engine.Engine.plan`, the schedule the run "
        "executes and counts in its report's `movement`; equal to the counted loads on a disk-offloaded model, "
        "tests/test_streaming.py).",
        "",
        *_seventy_b_lines(b),
        "",
        "## The default prune against SLEB: predicted compute",
        "",
        f"Command: `{out.get('commands', {}).get('compute', out['command'])}` (the `compute` part: `estimate_cost` "
        "only, the model on the meta device, no weight read; a throughput probe of one block and the head).",
        "",
        "The default prune (both protocols scored, adjacent pairs, then the search over sets) and SLEB at the same "
        "n, as `estimate_cost` plans them: block passes (one decoder block over one batch, the scoring engine's "
        "own plan; the search's an upper bound by its allowances, SLEB's exact for its first step and bounded "
        "after), the FLOPs of the blocks and of the output head (2 x positions x hidden x vocabulary per head "
        "pass: 262,144 entries) and the seconds they take at the probe's rates.",
        "",
        *_compute_lines(out),
        *_measured_section(out),
        "## Streaming offloaded blocks",
        "",
        *_streamed_lines(out),
        "Slot-major streaming of offloaded models and its measurements (blocks onloaded per batch, bytes moved, "
        "peak memory with a quarter of the weights in memory) are on [streaming.md](streaming.md).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--parts", nargs="+", default=["prune", "search", "passes", "default", "70b", "streamed", "compute"],
                   help="parts to run; the others keep their results stored in scale.json (also `measured`, not run "
                        "by default: the default prune against SLEB in CPU seconds, about 30-50 min for gemma3-270m "
                        "at --num-prompts 16 --seq-len 128)")
    p.add_argument("--render-only", action="store_true", help="write scale.md from scale.json")
    p.add_argument("--json", type=Path, default=RESULTS / "scale.json", help="stored results read by --render-only")
    p.add_argument("--out", type=Path, default=RESULTS / "scale.md", help="page written by --render-only")
    args = p.parse_args(argv)
    if args.render_only:
        args.out.write_text(render(json.loads(args.json.read_text())))
        return
    out = {"threads": 1, "num_prompts": args.num_prompts, "seq_len": args.seq_len,
           "commands": {part: command_line("scale.py", argv) for part in args.parts},
           **{part: {} for part in args.parts}}
    if "70b" in args.parts:
        out["70b"] = _seventy_b()
    for name in args.models:
        report_path = str(RESULTS / f".scale-report-{name}.json")
        if "default" in args.parts:
            out.setdefault("default", {})[name] = _child(_default_part, name)
        if "measured" in args.parts:
            for partial in _child_stream(_measured_part, name, args.num_prompts, args.seq_len):
                out["measured"][name] = {**partial, "command": out["commands"]["measured"]}
                (RESULTS / "scale.md").write_text(render(_store(out, args.parts)))  # what finished, on the page
                print(name, {k: partial[k] for k in ("scoring", "search", "sleb") if k in partial}, flush=True)
        if "compute" in args.parts:
            out["compute"][name] = _child(_compute_part, name)
            print(name, out["compute"][name]["throughput"], flush=True)
        if "prune" in args.parts:
            out["prune"][name] = {"predicted": _child(_estimate_part, name, args.num_prompts, args.seq_len),
                                  "measured": _child(_prune_part, name, args.num_prompts, args.seq_len, report_path)}
            print(name, out["prune"][name], flush=True)
        if "streamed" in args.parts:
            out["streamed"][name] = _child(_streamed_part, name, args.num_prompts, args.seq_len)
            out["streamed"][name]["command"] = out["commands"]["streamed"]
            print(name, out["streamed"][name], flush=True)
        if "passes" in args.parts:
            out["passes"][name] = _child(_passes_part, name, args.num_prompts, args.seq_len)
            print(name, out["passes"][name]["search"]["cost"], out["passes"][name]["sleb"]["block_passes"], flush=True)
        if "search" in args.parts:
            out["search"][name] = _child(_search_part, name, args.num_prompts, args.seq_len, report_path)
            print(name, out["search"][name]["kept"]["cost"], out["search"][name]["recomputed"]["cost"], flush=True)
        Path(report_path).unlink(missing_ok=True)
        _store(out, args.parts)
    (RESULTS / "scale.md").write_text(render(_store(out, args.parts)))


#: Parts that record their own calibration (or read none): running only these keeps the stored
#: page-wide ``num_prompts`` / ``seq_len`` of the other parts.
OWN_CALIBRATION = ("measured", "compute", "default", "70b")


def _store(out: dict, parts) -> dict:
    """Merge what this run measured into scale.json (read again now: parts and models not
    run keep their stored results, also those a concurrent run of other models wrote)."""
    path = RESULTS / "scale.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    if set(parts) - set(OWN_CALIBRATION) or not stored:  # the page-wide calibration is that of the parts that read it
        stored.update({k: out[k] for k in ("threads", "num_prompts", "seq_len")})
    stored.setdefault("command", out["commands"][parts[0]])
    stored.setdefault("commands", {}).update(out["commands"])
    for part in parts:
        if part == "70b":
            stored[part] = out[part]
        else:
            stored.setdefault(part, {}).update(out[part])
    path.write_text(json.dumps(stored, indent=1, default=str))
    return stored


if __name__ == "__main__":
    main()
