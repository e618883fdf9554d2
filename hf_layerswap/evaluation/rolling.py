"""The ``"rolling"`` perplexity contract: lm-eval's rolling loglikelihood, windowing and BOS.

``evaluate_perplexity(model, text, contract="rolling", window=L)`` scores text the way
lm-evaluation-harness scores ``loglikelihood_rolling`` requests (its ``wikitext`` task and
every ``output_type: loglikelihood_rolling`` task) with ``HFLM(max_length=L)``:

1. each document is tokenized as the tokenizer does by default (``add_bos=None``; lm-eval's
   ``add_bos_token``), or with a BOS forced on (``True``) or off (``False``); the text is
   scored verbatim (no line or word preparation);
2. a *prefix token* (BOS, or EOS when the tokenizer has no BOS) is put in front as context
   for the first token, so **every** token of the document is scored, the first included;
3. the tokens are cut into disjoint prediction windows of ``L`` tokens; a window's input is
   the ``L`` tokens ending just before its last target, so each window after the first
   conditions on one token of the previous window only, and the last, shorter window is
   right-aligned (its targets see the ``L`` tokens before them);
4. PPL = exp(sum NLL / sum scored tokens) over all documents (a list of strings = one
   document each, lm-eval's per-request unit); the CI resamples windows, as the other
   contracts do.

How it differs from ``"full"`` (window 2048, stride 2048, :mod:`hf_layerswap.evaluation.perplexity`):
``"full"`` also cuts disjoint windows but feeds each window only its own tokens, so the
first token of every window is *not scored* (N - windows tokens) and no prefix token is
added; ``"rolling"`` scores all N tokens of each document, the first of each window
conditioned on one token of context (and the document's first on the prefix token). Both
give every scored token at most one window of context; the matched contract
(window 512, stride 256) gives each at least 256 tokens of it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..calibration import check_positions, check_token_ids, tokenizer_adds_bos
from ..utils.devices import input_device
from ..layerplan import model_fingerprint
from ..utils.provenance import library_versions, public_identity
from .contract import (
    BOOTSTRAP_RNG,
    PerplexityResult,
    bootstrap_ci,
    read_source,
    sha256_text,
    resolve_tokenizer,
)

__all__ = ["DEFAULT_ROLLING_WINDOW", "evaluate_rolling", "rolling_windows"]

#: lm-eval's fallback ``max_length`` when a model states none.
DEFAULT_ROLLING_WINDOW = 2048


def rolling_windows(num_tokens: int, window: int) -> list[tuple[int, int, int]]:
    """lm-eval's rolling windows over ``[prefix] + tokens`` (indices into that sequence).

    Returns ``(begin, end, num_targets)``: the model reads positions ``begin..end-1`` (at
    most ``window`` tokens) and the last ``num_targets`` of its predictions score positions
    ``end - num_targets + 1 .. end`` (target ``t`` is token ``t - 1`` of the document).

    Raises:
        ValueError: ``window < 1`` or an empty document.
    """
    if window < 1:
        raise ValueError(f"window={window}: must be at least 1 token")
    if num_tokens < 1:
        raise ValueError("the document has no tokens to score")
    spans = []
    first = min(window, num_tokens)
    spans.append((0, first, first))
    done = first
    while done < num_tokens:
        targets = min(num_tokens - done, window)
        end = done + targets  # last target is position `end` of [prefix] + tokens
        spans.append((end - window, end, targets))
        done = end
    return spans


def _documents(text) -> tuple[list[str], dict]:
    if isinstance(text, (list, tuple)) and text and all(isinstance(t, str) for t in text):
        return list(text), {"source": "documents", "documents": len(text)}
    raw, source = read_source(text)
    return [raw], {**source, "documents": 1}


@torch.no_grad()
def evaluate_rolling(
    model,
    text=None,
    *,
    tokenizer=None,
    window: int | None = None,
    add_bos: bool | None = None,
    bootstrap: int = 1000,
    seed: int = 42,
    batch_size: int = 2,
):
    """Perplexity under the ``"rolling"`` contract (see the module docstring).

    Args:
        model: a causal LM returning ``.logits`` ``(B, T, V)``; fp32 log-softmax, fp64 sums.
        text: as for :func:`~hf_layerswap.evaluate_perplexity`; a list of strings is a list
            of documents, each scored on its own (lm-eval's unit), not joined.
        tokenizer: defaults to the model's (``name_or_path``).
        window: lm-eval's ``max_length`` (tokens the model reads per window); default the
            model's ``max_position_embeddings``, else 2048.
        add_bos: ``None`` = tokenizer default (lm-eval's ``add_bos_token=None``).
        bootstrap, seed, batch_size: as for the other contracts.

    Returns:
        :class:`~hf_layerswap.evaluation.PerplexityResult` with ``contract["name"] ==
        "rolling"``; ``nll`` is the sum of lm-eval's per-document rolling loglikelihoods
        (negated), in nats.

    Raises:
        ValueError: a window larger than the model's positions, an empty document, no
            tokenizer, or a tokenizer with neither BOS nor EOS.
    """
    tokenizer = resolve_tokenizer(model, tokenizer)
    max_pos = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    window = int(window) if window is not None else (int(max_pos) if max_pos else DEFAULT_ROLLING_WINDOW)
    check_positions(model, window, f"window={window}", "lower window")
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if prefix is None:
        raise ValueError("the rolling contract needs a BOS or EOS token id as the prefix token")
    docs, source = _documents(text)
    kwargs = {} if add_bos is None else {"add_special_tokens": bool(add_bos)}
    sequences: list = []
    for doc in docs:
        ids = list(tokenizer(doc, **kwargs)["input_ids"])
        if add_bos and tokenizer.bos_token_id is not None and ids[:1] != [tokenizer.bos_token_id]:
            ids = [tokenizer.bos_token_id] + ids
        if not ids:
            raise ValueError(f"document {len(sequences)} has no tokens to score")
        sequences.append(torch.tensor([prefix] + ids, dtype=torch.long))

    device = input_device(model)
    jobs = []  # (sequence index, begin, end, targets)
    for s, seq in enumerate(sequences):
        check_token_ids(seq, model, "input_ids")
        jobs += [(s, b, e, k) for b, e, k in rolling_windows(len(seq) - 1, window)]
    nll = np.zeros(len(jobs), dtype=np.float64)
    counts = np.array([k for *_, k in jobs], dtype=np.int64)
    groups: dict[tuple[int, int], list[int]] = {}
    for j, (_, b, e, k) in enumerate(jobs):
        groups.setdefault((e - b, k), []).append(j)
    was_training = model.training
    model.eval()
    try:
        for (length, keep), members in groups.items():
            for start in range(0, len(members), batch_size):
                chunk = members[start : start + batch_size]
                batch = torch.stack([sequences[jobs[j][0]][jobs[j][1] : jobs[j][2]] for j in chunk]).to(device)
                targets = torch.stack([sequences[jobs[j][0]][jobs[j][2] - keep + 1 : jobs[j][2] + 1] for j in chunk])
                logits = model(input_ids=batch, use_cache=False, logits_to_keep=keep).logits[:, -keep:, :]
                for row, j in enumerate(chunk):
                    token_nll = F.cross_entropy(logits[row].float(), targets[row].to(logits.device), reduction="none")
                    nll[j] = token_nll.double().sum().item()
    finally:
        model.train(was_training)

    total_nll, total_tokens = float(nll.sum()), int(counts.sum())
    ci_low, ci_high = bootstrap_ci(nll, counts, bootstrap, seed)
    default_bos = tokenizer_adds_bos(tokenizer)
    record = {
        "name": "rolling",
        **source,
        "text_sha256": sha256_text("\x00".join(docs)),
        "preparation": "verbatim (each document scored on its own)",
        "max_words": None,
        "bos": {
            "add_bos": default_bos if add_bos is None else bool(add_bos),
            "bos_choice": "tokenizer default" if add_bos is None else "explicit",
            "tokenizer_adds_bos_by_default": default_bos,
            "prefix_token_id": int(prefix),
            "prefix_token": "bos" if prefix == tokenizer.bos_token_id else "eos",
        },
        "tokenizer": type(tokenizer).__name__,
        "model": {**public_identity(model), "fingerprint": model_fingerprint(model)},  # which weights were measured
        "window": window,
        "stride": window,
        "num_input_tokens": int(sum(len(s) - 1 for s in sequences)),
        "scored_tokens": total_tokens,
        "windows": len(jobs),
        "scoring": "lm-eval loglikelihood_rolling: every token scored, prefix token first, disjoint windows",
        "ppl_formula": "exp(total NLL / total scored tokens), nats",
        "bootstrap": {"resamples": int(bootstrap), "seed": int(seed), "rng": BOOTSTRAP_RNG, "unit": "window",
                      "percentiles": [2.5, 97.5]},
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "log_softmax_dtype": "float32",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "device": str(device),
        "versions": library_versions(),
    }
    return PerplexityResult(
        ppl=math.exp(total_nll / total_tokens), nll=total_nll, tokens=total_tokens, windows=len(jobs),
        ci_low=ci_low, ci_high=ci_high, contract=record,
        window_nll=[float(x) for x in nll], window_tokens=[int(c) for c in counts],
    )
