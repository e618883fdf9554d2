"""Predicted vs measured cost of a prune, the search's reference reuse, and a 70B arithmetic.

Command (one CPU thread; writes benchmarks/results/scale.{json,md}):

    python benchmarks/scale.py --num-prompts 4 --seq-len 64

Parts, each in a fresh child process (its peak RSS is the ``ru_maxrss`` of that child):
1. per real model, ``hl.estimate_cost`` then the prune it estimates (default strategy,
   ``num_layers=2``) with forward hooks counting block passes;
2. per real model, the search for n = 1..6 with the dense reference recomputed per
   evaluator call (``reference_memory=0``) and kept (default);
3. ``estimate_cost`` of a Llama-3-70B-shaped config on the meta device with weights streamed
   from CPU memory to one GPU (a prediction at stated rates).
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


def _prune_part(name, num_prompts, seq_len, queue):
    import torch
    import hf_layerswap as hl
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path, calib = _calibration(name, num_prompts, seq_len)
    config = hl.LayerSwapConfig(num_layers=2, num_prompts=num_prompts, seq_len=seq_len, progress=False)
    estimate = hl.estimate_cost(str(path), config, calibration=calib)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    count = [0]
    for block in model.model.layers:
        block.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    t0 = time.perf_counter()
    result = hl.prune(model, config, calibration=calib)
    seconds = time.perf_counter() - t0
    queue.put({"predicted": {"block_passes": estimate.block_passes, "head_passes": estimate.head_passes,
                             "peak_memory_bytes": estimate.peak_memory_bytes["cpu"], "seconds": estimate.seconds,
                             "throughput": estimate.throughput.source},
               "measured": {"block_passes": count[0], "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            "seconds": seconds, "removed": result.removed}})


def _search_part(name, num_prompts, seq_len, queue):
    import torch
    import hf_layerswap as hl
    from transformers import AutoModelForCausalLM
    from hf_layerswap.selection.objectives import SetObjective

    torch.set_num_threads(1)
    path, calib = _calibration(name, num_prompts, seq_len)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    report = hl.score_layers(model, calib, progress=False)
    out = {}
    for label, memory in (("recomputed", 0), ("kept", None)):
        f = SetObjective(model, calib, reference_memory=memory)
        found = hl.search_select(report, list(range(1, 7)), model=model, calibration=calib, evaluator=f)
        out[label] = {"cost": found[6]["total_cost"], "selected": {n: found[n]["selected"] for n in found},
                      "values": {n: float(found[n]["value"]).hex() for n in found}}
    queue.put(out)


def _child(target, *args):
    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def _seventy_b():
    import hf_layerswap as hl
    from hf_layerswap.cost import Throughput
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, torch_dtype="bfloat16")
    rates = Throughput(0.4 * 989e12, 0.5 * 67e12, 25e9,
                       source="assumed H100-class: 40% of 989 TFLOP/s bf16 dense for blocks, 50% of 67 TFLOP/s fp32 "
                              "for the head, 25 GB/s host-to-device (PCIe 5 x16, pinned)")
    est = hl.estimate_cost(cfg, hl.LayerSwapConfig(num_layers=8), device="cuda", throughput=rates,
                           stream_weights=True, max_memory=8 << 30)
    return {"block_passes": est.block_passes, "head_passes": est.head_passes, "flops": est.flops,
            "bytes_moved": est.bytes_moved, "peak_memory_bytes": est.peak_memory_bytes, "seconds": est.seconds,
            "phases": est.phases, "throughput": rates.source}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--parts", nargs="+", default=["prune", "search", "70b"])
    args = p.parse_args(argv)
    out = {"command": command_line("scale.py", argv), "threads": 1, "num_prompts": args.num_prompts,
           "seq_len": args.seq_len, "prune": {}, "search": {}}
    if "70b" in args.parts:
        out["70b"] = _seventy_b()
    for name in args.models:
        if "prune" in args.parts:
            out["prune"][name] = _child(_prune_part, name, args.num_prompts, args.seq_len)
            print(name, out["prune"][name], flush=True)
        if "search" in args.parts:
            out["search"][name] = _child(_search_part, name, args.num_prompts, args.seq_len)
            print(name, out["search"][name]["kept"]["cost"], out["search"][name]["recomputed"]["cost"], flush=True)
        (RESULTS / "scale.json").write_text(json.dumps(out, indent=1, default=str))
    (RESULTS / "scale.json").write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(out.get("70b"), default=str))


if __name__ == "__main__":
    main()
