"""Train a small Llama-style model on WikiText-2 and save checkpoints along the way.

    python benchmarks/train_tiny.py [--out DIR] [--steps 300] [--threads 2]

The run that :mod:`benchmarks.peeling` monitors with :func:`hf_layerswap.peeling.peel_trajectory`.

Data (the only text used is ``../shared/data/wikitext-2/valid.txt``, the WikiText-2
validation split in its tokenized release, relative to the repository root):

- the file is cut into articles at its top-level headings (`` = Title = ``);
- **held-out**: the last ``--heldout-articles`` articles (default 6 of 60). Their
  paragraphs are the peeling evaluation text; nothing of them is trained on, and the
  tokenizer never sees them;
- **training**: all other articles. A BPE tokenizer (``tokenizers`` library, vocabulary
  4,096, whitespace pre-tokenizer, ``<unk>`` kept as one special token) is trained on their
  text; the model trains on random 128-token windows of their concatenated token stream
  (paragraphs separated by ``</s>``). The peeling calibration text (what the references
  are fitted on) is a seeded sample of training paragraphs, as in the peeling paper,
  which fits its references on training data.

Model: ``LlamaConfig`` with 6 blocks, hidden 128, 4 heads (2 KV heads), MLP 384, tied
embeddings, about 1.7M parameters. AdamW (lr 3e-3, betas 0.9/0.95, weight decay 0.1,
20 warm-up steps, cosine to 10%), gradient clipping 1.0, batch 8 x 128 tokens, seed 0.

Checkpoints: ``OUT/step-NNNN`` (``save_pretrained`` model + tokenizer +
``trainer_state.json`` with ``global_step``) at the steps in ``--save-at``. ``OUT/run.json``
records the split, the losses and the timings. Every folder is written under a temporary
name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from wikitext import VALID, wikitext_articles  # noqa: E402  (the "lines" reading of WikiText-2)


def split_data(path: Path = VALID, heldout_articles: int = 6) -> dict:
    """``{"train": [...paragraphs], "heldout": [...paragraphs], "articles": (n_train, n_heldout)}``."""
    articles = wikitext_articles(path)
    if not 0 < heldout_articles < len(articles):
        raise ValueError(f"heldout_articles={heldout_articles}: allowed 1..{len(articles) - 1}")
    train = [p for a in articles[:-heldout_articles] for p in a]
    heldout = [p for a in articles[-heldout_articles:] for p in a]
    return {"train": train, "heldout": heldout, "articles": (len(articles) - heldout_articles, heldout_articles)}


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<unk>", "<pad>", "<s>", "</s>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def model_config(tokenizer, layers: int, hidden: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _save(model, tokenizer, directory: Path, state: dict) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def train(out: Path, *, steps: int = 300, save_at=(0, 25, 50, 100, 200, 300), layers: int = 6, hidden: int = 128,
          batch: int = 8, seq_len: int = 128, lr: float = 3e-3, seed: int = 0, heldout_articles: int = 6,
          log=print) -> dict:
    """Train and save checkpoints; returns the run record (also written to ``OUT/run.json``)."""
    import torch
    from transformers import AutoModelForCausalLM

    save_at = sorted({s for s in save_at if 0 <= s <= steps})
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data = split_data(VALID, heldout_articles)
    tokenizer = train_tokenizer(data["train"])
    stream = []
    for para in data["train"]:
        stream.extend(tokenizer(para, add_special_tokens=False)["input_ids"])
        stream.append(tokenizer.eos_token_id)
    stream = torch.tensor(stream, dtype=torch.long)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(tokenizer, layers, hidden), attn_implementation="sdpa")
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = 20

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    g = torch.Generator().manual_seed(seed)
    losses, saved = [], []
    setup_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    for step in range(steps + 1):
        if step in save_at:
            model.eval()
            directory = out / f"step-{step:04d}"
            _save(model, tokenizer, directory, {"global_step": step, "train_loss": losses[-1] if losses else None})
            saved.append(str(directory))
            log(f"step {step:4d}: saved {directory.name} (loss {losses[-1] if losses else float('nan'):.3f}, "
                f"{time.perf_counter() - t1:.0f} s)")
        if step == steps:
            break
        model.train()
        starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=g)
        ids = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    record = {
        "data": str(VALID.relative_to(REPO.parent)),
        "split": {
            "rule": f"articles cut at top-level headings; the last {heldout_articles} are held out",
            "train_articles": data["articles"][0],
            "heldout_articles": data["articles"][1],
            "train_paragraphs": len(data["train"]),
            "heldout_paragraphs": len(data["heldout"]),
            "train_tokens": int(stream.numel()),
        },
        "tokenizer": {"type": "BPE (tokenizers), whitespace pre-tokenizer, trained on the training articles",
                      "vocab_size": len(tokenizer)},
        "model": {"layers": layers, "hidden": hidden, "intermediate": 3 * hidden, "heads": 4, "kv_heads": 2,
                  "parameters": params, "tied_embeddings": True},
        "training": {"steps": steps, "batch": batch, "seq_len": seq_len, "lr": lr, "warmup": warmup,
                     "schedule": "cosine to 10%", "weight_decay": 0.1, "betas": [0.9, 0.95], "clip": 1.0,
                     "seed": seed, "threads": torch.get_num_threads()},
        "losses": losses,
        "checkpoints": saved,
        "seconds": {"setup": setup_seconds, "training": time.perf_counter() - t1},
    }
    (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def default_out() -> Path:
    from hf_layerswap.models import cache_root

    return cache_root() / "train_tiny"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="checkpoint folder (default: the hf_layerswap cache)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-at", type=int, nargs="+", default=[0, 25, 50, 100, 200, 300])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    out = args.out or default_out()
    record = train(out, steps=args.steps, save_at=args.save_at, layers=args.layers, hidden=args.hidden)
    print(json.dumps({k: record[k] for k in ("split", "model", "seconds")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
