"""The output head of a bf16 model: time and pair-KL error of the former fp32 path (an fp32
copy of the head's weight, one fp32 GEMM) against the engine's path
(:func:`hf_layerswap.scoring.head.linear32`), both folded into the engine's float64 online KL
(:class:`hf_layerswap.scoring.kl.OnlineKL`), with the bf16 GEMM that rounds its output to
bf16 beside them (not used: it shows what the contract rules out).

The real heads of the bundled checkpoints in bf16 and the real final hidden states (bf16) of
WikiText-2 validation prompts: the identity model (the reference) and two probes of a middle
pair (interchange, replacement). The pair KLs (mean over the real tokens) of each path are
compared with the float64 KL of the same hidden states (head and log-softmax in float64).
The paths alternate in one process with ``torch.set_num_threads(1)`` (the machine is shared:
CPU time is then the work's), ``--repeats`` times each; the page gives each one's least CPU
time of a head phase (the reference and the probes through the head and the KL) and its
ratio to the former path.

Usage (from the repository root; on the CPU)::

    python benchmarks/head_precision.py --num-prompts 4 --seq-len 32
    python benchmarks/head_precision.py --render-only
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

PATHS = ("former fp32 copy", "linear32", "bf16 output")


def hidden_states(model, calib):
    """Final hidden rows (real positions, bf16) of the identity model and of two probes of a middle pair."""
    import torch

    from hf_layerswap.layerplan import apply_plan, identity_plan, interchange_plan, num_blocks, replacement_plan

    n = num_blocks(model)
    i = n // 2
    plans = {"identity": identity_plan(n), f"interchange {i}<->{i + 1}": interchange_plan(n, i, i + 1),
             f"replacement {i}<-{i + 1}": replacement_plan(n, i, i + 1)}
    mask = calib.attention_mask.bool()
    out = {}
    with torch.no_grad():
        for name, plan in plans.items():
            with apply_plan(model, plan):
                h = model.model(input_ids=calib.input_ids, attention_mask=calib.attention_mask,
                                use_cache=False).last_hidden_state
            out[name] = h[mask]
    return out


def head_phase(logits_of, hiddens: list) -> list[float]:
    """Pair KLs (mean over rows) of each probe against ``hiddens[0]`` through ``logits_of`` and OnlineKL."""
    from hf_layerswap.scoring.kl import OnlineKL

    ref, probes = hiddens[0], hiddens[1:]
    acc = OnlineKL(ref.shape[0], len(probes), ref.device)
    weights = acc.reference(0, ref.shape[0], logits_of(ref))
    for n, h in enumerate(probes):
        acc.add(n, 0, ref.shape[0], weights, logits_of(h))
    return [float(kl.mean()) for kl in acc.result()]


def exact_kls(w, hiddens: list) -> list[float]:
    """The float64 pair KLs: head and log-softmax in float64."""
    import torch

    w64 = w.double()
    ref = torch.log_softmax(hiddens[0].double() @ w64.t(), dim=-1)
    return [float((ref.exp() * (ref - torch.log_softmax(h.double() @ w64.t(), dim=-1))).sum(-1).mean())
            for h in hiddens[1:]]


def measure(model_name: str, num_prompts: int, seq_len: int, repeats: int) -> dict:
    import torch

    from hf_layerswap.models import bundled_checkpoint_dir, load_model
    from hf_layerswap.scoring.head import Head, linear32
    from wikitext import wikitext_calibration

    model, tok = load_model(bundled_checkpoint_dir(model_name), dtype=torch.bfloat16, device_map=None)
    calib = wikitext_calibration(tok, num_prompts, seq_len)
    states = hidden_states(model, calib)
    hiddens = list(states.values())
    w = model.get_output_embeddings().weight.detach()
    assert w.dtype == torch.bfloat16 and all(h.dtype == torch.bfloat16 for h in hiddens)

    def former(rows_list):
        w32 = w.float()  # made once per head phase, as the former Head.weight32 did
        return head_phase(lambda h: torch.nn.functional.linear(h.float(), w32), rows_list)

    paths = {"former fp32 copy": former,
             "linear32": lambda rows_list: head_phase(lambda h: linear32(h, w), rows_list),
             "bf16 output": lambda rows_list: head_phase(lambda h: torch.nn.functional.linear(h, w).float(), rows_list)}
    exact = exact_kls(w, hiddens)
    cpu = {name: [] for name in PATHS}
    kls = {}
    with torch.no_grad():
        for _ in range(repeats):
            for name in PATHS:
                c0 = time.process_time()
                kls[name] = paths[name](hiddens)
                cpu[name].append(time.process_time() - c0)
    errors = {name: max(abs(k - e) / e for k, e in zip(kls[name], exact)) for name in PATHS}
    head = Head(model)
    return {"model": model_name, "hidden": int(w.shape[1]), "vocab": int(w.shape[0]), "rows": int(hiddens[0].shape[0]),
            "probes": list(states)[1:], "exact": exact, "kls": kls, "cpu_s": cpu, "max_rel": errors,
            "copy_bytes": {"former fp32 copy": 4 * w.numel(), "linear32": head.working_bytes(head.vocab),
                           "bf16 output": 0},
            "torch": torch.__version__}


def write_markdown(out: Path, stored: dict) -> None:
    lines = [
        "# The output head of a bf16 model: fp32 copy vs linear32",
        "",
        f"Command: `{stored['command']}`",
        "",
        f"Machine: {stored['machine']}; torch {stored['torch']}, one torch thread. The bundled checkpoints "
        f"loaded in bf16, {stored['num_prompts']} WikiText-2 validation prompts x {stored['seq_len']} tokens: the "
        "real final hidden states (bf16) of the identity model and of two probes of the middle pair, through the "
        "real bf16 head and the engine's float64 online KL (`OnlineKL`).",
        "",
        "*former fp32 copy*: the head's weight copied to fp32 once per head phase and one fp32 GEMM per block "
        "(the path before `linear32`). *linear32*: the engine's path (`hf_layerswap.scoring.head.linear32`); "
        "this CPU has no GEMM with fp32 output from bf16 inputs in torch (`torch.mm(..., out_dtype=torch.float32)` "
        "is CUDA only), so it runs the fp32 GEMM on the weight upcast in pieces of at most 32 MiB; on CUDA it runs "
        "the bf16 GEMM with fp32 accumulation and output. *bf16 output*: the plain bf16 GEMM (fp32 accumulation, "
        "output rounded to bf16), shown for its error only. The paths alternate in one process, "
        f"{stored['repeats']} runs each; CPU s is each one's least `time.process_time()` of a head phase (the "
        "reference and both probes, head and KL). *max rel err*: the largest relative error of a pair KL against "
        "the float64 KL of the same hidden states. *fp32 weight bytes*: what the path holds beside the logits.",
        "",
        "| model | H x V | rows | path | CPU s | ratio to former | max rel err vs float64 | fp32 weight bytes |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in stored["rows"]:
        base = min(r["cpu_s"]["former fp32 copy"])
        for name in PATHS:
            t = min(r["cpu_s"][name])
            lines.append(f"| {r['model']} | {r['hidden']} x {r['vocab']} | {r['rows']} | {name} | {t:.2f} | "
                         f"{t / base:.2f}x | {r['max_rel'][name]:.1e} | {r['copy_bytes'][name] / 2**20:.0f} MiB |")
    lines += ["", "Pair KLs (nats, mean over the real tokens):", "",
              "| model | probe | float64 | " + " | ".join(PATHS) + " |", "|---|---|" + "---:|" * (len(PATHS) + 1)]
    for r in stored["rows"]:
        for k, probe in enumerate(r["probes"]):
            cells = " | ".join(f"{r['kls'][name][k]:.9f}" for name in PATHS)
            lines.append(f"| {r['model']} | {probe} | {r['exact'][k]:.9f} | {cells} |")
    write_text_atomic("\n".join(lines) + "\n", out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "head_precision.md"))
    ap.add_argument("--render-only", action="store_true", help="rewrite the page from the JSON beside it")
    args = ap.parse_args(argv)
    out = Path(args.out)
    state = out.with_suffix(".json")
    if not args.render_only:
        import torch

        torch.set_num_threads(1)
        rows = [measure(m, args.num_prompts, args.seq_len, args.repeats) for m in args.models]
        write_json_atomic({"command": command_line("head_precision.py", argv), "machine": f"{platform.machine()}, cpu",
                           "torch": rows[0]["torch"], "num_prompts": args.num_prompts, "seq_len": args.seq_len,
                           "repeats": args.repeats, "rows": rows}, state)
    write_markdown(out, json.loads(state.read_text(encoding="utf-8")))


if __name__ == "__main__":
    main()
