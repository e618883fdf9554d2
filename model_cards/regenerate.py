"""Regenerate the example model cards in this folder from real runs.

For each model: load the bundled real checkpoint (dequantized GGUF from the package
index), measure the base perplexity on WikiText-2 (raw test split, the "matched"
contract), score both swap-KL protocols on WikiText-2 validation text, remove blocks by the
default path (``LayerSwapConfig``'s defaults, as ``hf-layerswap prune`` runs it: the
protocol-guided search, removal KL on the calibration prompts), with fewer calibration
prompts than the default 64 (``RUNS``) to keep the run short, measure the pruned
perplexity under the same contract, and write the card, its plots and the JSON sidecars
into ``model_cards/<name>/`` (no weights).

Run from the repository root (the shared data lives at ``../shared/data``)::

    python model_cards/regenerate.py                 # both models
    python model_cards/regenerate.py smollm2-135m    # one of them
    python model_cards/regenerate.py --num-prompts 8 --eval-words 500 --output-dir /tmp/cards  # a quick look
    python model_cards/regenerate.py smollm2-135m --report model_cards/smollm2-135m/layerswap_report.json

``--report`` reuses a stored swap-KL report of the same weights and calibration prompts (an
earlier regeneration's ``layerswap_report.json``) instead of scoring again: the default
selection still runs on its scores (its earlier selection records are dropped), and both
perplexities are measured again.

The template the cards are rendered from is ``hf_layerswap/templates/modelcard_template.md``
(``modelcard_template.md`` here points at it).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = Path("..") / "shared" / "data"  # relative to the repository root, as the card shows it
CALIBRATION = DATA / "wikitext-2" / "valid.txt"
EVALUATION = DATA / "wikitext-2-raw" / "wiki.test.raw"

#: name -> (blocks to remove, license of the upstream release, calibration prompts: fewer than
#: LayerSwapConfig's default 64, to keep a regeneration short on a CPU)
RUNS = {
    "smollm2-135m": (2, "apache-2.0", 8),
    "gemma3-270m": (2, "gemma", 16),
}


def regenerate(
    name: str,
    *,
    num_prompts: int | None = None,
    seq_len: int = 128,
    calibration: str = str(CALIBRATION),
    eval_words: int | None = None,
    output_dir: Path = HERE,
    report: Path | None = None,
) -> Path:
    from hf_layerswap import LayerSwapConfig, SwapReport, prune
    from hf_layerswap.card import write_card_files
    from hf_layerswap.evaluation import evaluate_perplexity
    from hf_layerswap.models import load_model

    budget, license_, default_prompts = RUNS[name]
    for path in ([Path(calibration)] if calibration != "embedded" else []) + [EVALUATION] + ([report] if report else []):
        if not path.is_file():
            sys.exit(f"{path} is missing: run from the repository root with the shared data next to it")
    t0 = time.perf_counter()
    model, tokenizer = load_model(name)
    # name the weights by their upstream id and exact revision, not by this machine's cache path
    identity = {k: v for k, v in model.layerswap_identity.items() if k != "path"}
    model.layerswap_identity = identity
    model.config._name_or_path = identity["name"]
    print(f"[{name}] loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    base = evaluate_perplexity(model, str(EVALUATION), tokenizer=tokenizer, max_words=eval_words)
    print(f"[{name}] base PPL {base.ppl:.3f}", flush=True)
    # the default path: every selection field (strategy, objective, protocol, spacing, protect) at its default
    config = LayerSwapConfig(
        num_to_remove=budget, calibration=None if calibration == "embedded" else calibration,
        tokenizer=tokenizer, num_prompts=num_prompts or default_prompts, seq_len=seq_len, progress=False,
    )
    scored = None
    if report is not None:  # the scores of an earlier run on these weights and prompts; a new selection on them
        scored = SwapReport.from_json(report)
        scored.selections.clear()
    prune(model, config, report=scored)
    print(f"[{name}] removed {model.config.layerswap['removed_layers']} in {time.perf_counter() - t0:.0f} s", flush=True)
    pruned = evaluate_perplexity(model, str(EVALUATION), tokenizer=tokenizer, max_words=eval_words)
    print(f"[{name}] pruned PPL {pruned.ppl:.3f}", flush=True)

    output_dir.mkdir(parents=True, exist_ok=True)
    out = output_dir / name
    tmp = output_dir / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_card_files(
        tmp, model, report=model.layerswap_report, evaluation={"base": base, "pruned": pruned}, license=license_,
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"[{name}] card written to {out} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--num-prompts", type=int, default=None, help="calibration prompts (default per model)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per calibration prompt")
    parser.add_argument("--calibration", default=str(CALIBRATION), help="calibration text file, or 'embedded'")
    parser.add_argument("--eval-words", type=int, default=None, help="evaluation words (default: the contract's 5,000)")
    parser.add_argument("--output-dir", type=Path, default=HERE, help="where the card folders go (default: here)")
    parser.add_argument("--report", type=Path, default=None,
                        help="reuse this stored swap-KL report of the same weights and calibration (one model only)")
    args = parser.parse_args(argv)
    if args.report is not None and len(args.models) != 1:
        parser.error(f"--report {args.report} is one model's report: name that one model")
    for name in args.models:
        regenerate(name, num_prompts=args.num_prompts, seq_len=args.seq_len, calibration=args.calibration,
                   eval_words=args.eval_words, output_dir=args.output_dir, report=args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
