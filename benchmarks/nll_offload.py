"""SLEB's calibration NLL on a model whose output head is offloaded to disk: the NLL as it
read the head before (the whole head from the offload once per row slice of the predicted
positions) against today's (once per head phase: vocabulary slices outermost, the final
rows of a batch's passes held, :func:`hf_layerswap.selection.nll.plan_nll`), side by side
in one run.

Each arm is its own subprocess (``--worker``) with one torch thread, the same checkpoint
loaded in bf16 by the same device map (embedding, final norm and the first half of the
blocks in CPU memory; the output head and the second half of the blocks on disk,
accelerate's ``offload_folder``), the same WikiText-2 prompts and the same working-memory
budget (``--max-memory``), running ``sleb(model, calibration, n)``. A checkpoint whose head
is tied to its embedding (SmolLM2-135M) is saved untied first (the head a copy of the
embedding: the same values), so that the head alone is on disk. The *before* arm runs
the package of the commit ``--baseline`` (``git archive`` of ``hf_layerswap/`` into a
temporary folder, first on the worker's import path); the *after* arm this tree's. Each
records its wall and CPU seconds, the head's reads from the offload (rows of the head's
weight read, over its vocabulary: whole-head loads; and the calls of accelerate's own hook,
which would load it whole), the blocks removed and the NLL of each step.

Usage (from the repository root)::

    python benchmarks/nll_offload.py --baseline 24b266f --threads 1
    python benchmarks/nll_offload.py --render-only      # rewrite the page from the JSON
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))

from _cmdline import command_line  # noqa: E402

ARMS = ("before", "after")


def device_map(num_blocks: int) -> dict:
    """The embedding, rotary table, final norm and blocks ``0 .. L/2 - 1`` in CPU memory; the
    output head and the other blocks on disk."""
    half = num_blocks // 2
    return {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "disk",
            **{f"model.layers.{i}": "cpu" if i < half else "disk" for i in range(num_blocks)}}


def worker(args) -> dict:
    """One arm: load, run SLEB, count the head's reads (the package first on ``sys.path``)."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_layerswap.calibration import build_calibration
    from hf_layerswap.models import bundled_checkpoint_dir
    from hf_layerswap.selection.sleb import sleb
    from hf_layerswap.utils.devices import OffloadedTensor

    ckpt = Path(args.checkpoint) if args.checkpoint else bundled_checkpoint_dir(args.model)
    config = AutoConfig.from_pretrained(ckpt)
    with tempfile.TemporaryDirectory(prefix="offload-") as folder:
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
        if config.tie_word_embeddings:  # a head tied to the embedding is not offloaded apart from it: untie a copy
            dense = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
            dense.lm_head.weight = torch.nn.Parameter(dense.lm_head.weight.detach().clone())
            dense.config.tie_word_embeddings = False
            ckpt = Path(folder) / "untied"
            dense.save_pretrained(ckpt)
            del dense
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, offload_folder=f"{folder}/offload",
                                                     device_map=device_map(config.num_hidden_layers)).eval()
        if args.checkpoint:  # a test's tiny checkpoint and its word-level tokenizer (words w0, w1, ...)
            texts = [" ".join(f"w{(7 * k + p) % 97}" for k in range(2 * args.seq_len)) for p in range(args.num_prompts)]
            calib = build_calibration(texts, tokenizer, num_prompts=args.num_prompts, seq_len=args.seq_len)
        else:
            from wikitext import wikitext_calibration

            calib = wikitext_calibration(tokenizer, args.num_prompts, args.seq_len)
        head = model.get_output_embeddings()
        vocab = int(head.weight.shape[0])
        key = OffloadedTensor.of(head, "weight").key
        reads = {"rows": 0, "hook": 0}
        rows = OffloadedTensor.rows

        def counted(reader, ranges):
            if reader.key == key:
                reads["rows"] += sum(b - a for a, b in ranges)
            return rows(reader, ranges)

        OffloadedTensor.rows = counted  # type: ignore[method-assign]
        pre = head._hf_hook.pre_forward

        def pre_forward(module, *a, **k):
            reads["hook"] += 1
            return pre(module, *a, **k)

        head._hf_hook.pre_forward = pre_forward
        c0, t0 = time.process_time(), time.perf_counter()
        result = sleb(model, calib, args.n, batch_size=args.num_prompts, max_memory=args.max_memory)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return {"removed": list(result.removed), "steps": [{"removed": s["removed"], "nll": s["nll"]}
                                                       for s in result.details["steps"]],
            "wall_s": wall, "cpu_s": cpu, "head_rows_read": reads["rows"], "head_loads": reads["rows"] / vocab,
            "hook_loads": reads["hook"], "head_passes": result.details["head_passes"], "vocab": vocab,
            "hidden": int(head.weight.shape[1]), "num_blocks": int(config.num_hidden_layers),
            "threads": args.threads, "torch": torch.__version__}


def baseline_tree(rev: str, folder: Path) -> Path:
    """``hf_layerswap/`` of the commit ``rev`` extracted into ``folder`` (``git archive``)."""
    archive = folder / "baseline.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), rev, "hf_layerswap"], cwd=REPO, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "tree", filter="data")
    return folder / "tree"


def run_arm(arm: str, tree: Path, args) -> dict:
    """One arm in its own process, ``tree``'s package first on its import path."""
    cmd = [sys.executable, __file__, "--worker", "--tree", str(tree), "--model", args.model, "--n", str(args.n),
           "--num-prompts", str(args.num_prompts), "--seq-len", str(args.seq_len), "--threads", str(args.threads),
           "--max-memory", args.max_memory]
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    proc = subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.PIPE, text=True)
    return {"arm": arm, **json.loads(proc.stdout.strip().splitlines()[-1])}


def render(data: dict) -> str:
    rows = {r["arm"]: r for r in data["rows"]}
    lines = [
        "# SLEB's calibration NLL with the output head offloaded to disk",
        "",
        f"Command: `{data['command']}`",
        "",
        f"Machine: {data['machine']}. {data['setup']}",
        "",
        "| arm | wall s | CPU s | head loads | accelerate hook loads | head passes | removed | NLL per step (nats/token) |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for arm in ARMS:
        if arm not in rows:
            continue
        r = rows[arm]
        nll = ", ".join(f"{s['nll']:.6f}" for s in r["steps"])
        lines.append(f"| {arm} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['head_loads']:g} | {r['hook_loads']} | "
                     f"{r['head_passes']} | {r['removed']} | {nll} |")
    if all(a in rows for a in ARMS):
        b, a = rows["before"], rows["after"]
        lines += ["", f"After / before: wall {a['wall_s'] / b['wall_s']:.2f}x, CPU {a['cpu_s'] / b['cpu_s']:.2f}x, "
                      f"head loads {a['head_loads'] / max(b['head_loads'], 1e-30):.4f}x; same blocks removed: "
                      f"{'yes' if a['removed'] == b['removed'] else 'no'}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)  # a test's tiny checkpoint
    p.add_argument("--n", type=int, default=2, help="blocks SLEB removes")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-memory", default="64MiB", help="SLEB's working-memory budget")
    p.add_argument("--baseline", default="24b266f", help="the commit whose package the before arm runs")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--out", type=Path, default=RESULTS / "nll_offload.md")
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        sys.path.insert(0, args.tree)
        print(json.dumps(worker(args)))
        return 0
    state = args.out.with_suffix(".json")
    data = json.loads(state.read_text()) if state.exists() else {"rows": []}
    if not args.render_only:
        import torch

        data["command"] = command_line("nll_offload.py", argv)
        data["machine"] = f"{platform.machine()}, cpu; torch {torch.__version__}, {args.threads} torch thread(s)"
        data["setup"] = (
            f"`sleb(model, calibration, {args.n}, batch_size={args.num_prompts}, max_memory={args.max_memory!r})` on "
            f"{args.model} loaded in bf16 with its output head and the second half of its blocks on disk "
            f"(accelerate `device_map` and `offload_folder`), {args.num_prompts} WikiText-2 prompts x "
            f"{args.seq_len} tokens, each arm in its own process. *before*: the package of commit "
            f"`{args.baseline}` (the head read whole from the offload for every row slice); *after*: this tree's "
            "(once per head phase, in vocabulary slices). *Head loads*: rows of the head's weight read from the "
            "offload over its vocabulary; *accelerate hook loads*: calls of the offload hook's `pre_forward`, "
            "which would read it whole. *Head passes*: SLEB's output-head passes over the prompts.")
        with tempfile.TemporaryDirectory(prefix="nll-offload-") as folder:
            for arm in args.arms:
                tree = baseline_tree(args.baseline, Path(folder)) if arm == "before" else REPO
                row = run_arm(arm, tree, args)
                data["rows"] = [r for r in data["rows"] if r["arm"] != arm] + [row]
                state.write_text(json.dumps(data, indent=1) + "\n")  # each arm kept as soon as it ends
                print(f"{arm}: {row['wall_s']:.1f} s wall, {row['head_loads']:g} head loads", file=sys.stderr)
    args.out.write_text(render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
