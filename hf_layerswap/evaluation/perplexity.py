"""Sliding-window perplexity under a contract (:func:`evaluate_perplexity`,
:func:`perplexity_from_ids`; a text tokenized once and scored on several models:
:func:`contract_tokens`, :func:`perplexity_of_tokens`) and comparisons of two results (:func:`delta_ppl_percent`,
:func:`delta_ppl_ci`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..calibration import check_positions, check_token_ids
from ..utils.devices import input_device
from ..layerplan import model_fingerprint
from ..utils.provenance import library_versions, public_identity
from .contract import (
    BOOTSTRAP_RNG,
    CONTRACTS,
    MIN_CI_WINDOWS,
    PerplexityResult,
    bootstrap_ci,
    read_source,
    sha256_text,
    tokenize_text,
    check_causal_lm,
    prepare_text,
    resolve_tokenizer,
    sliding_windows,
)
from .rolling import evaluate_rolling


def window_batches(spans: Sequence[tuple[int, int, int]], batch_size: int) -> list[tuple[int, int, list[int]]]:
    """The forward passes of :func:`perplexity_from_ids` over ``spans``
    (:func:`~hf_layerswap.evaluation.contract.sliding_windows`): windows of equal shape
    (length, kept logits) grouped in order of first appearance, ``batch_size`` at a time.

    Returns:
        one ``(length, keep, members)`` per forward: the window length (tokens), the
        logits kept (``end - score_from + 1``: the last position of the context and one
        per scored token) and the indices into ``spans`` of its windows.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for k, (begin, end, score_from) in enumerate(spans):
        groups.setdefault((end - begin, end - score_from + 1), []).append(k)
    return [(length, keep, members[start : start + batch_size])
            for (length, keep), members in groups.items() for start in range(0, len(members), batch_size)]


def contract_tokens(text=None, tokenizer=None, *, contract: str = "matched", window: int | None = None,
                    stride: int | None = None, max_words: int | None = None,
                    add_bos: bool | None = None) -> tuple[torch.Tensor, int, int, dict]:
    """The tokens :func:`evaluate_perplexity` scores under a named contract, and its windows.

    Args:
        text, contract, window, stride, max_words, add_bos: as for :func:`evaluate_perplexity`
            (``contract`` ``"matched"`` or ``"full"``).
        tokenizer: the tokenizer (required here).

    Returns:
        ``(ids, window, stride, record)``: the ``(T,)`` token ids, the window and stride
        (tokens) in force, and the contract record (source, hashes, words, BOS handling).

    Raises:
        ValueError: an unknown ``contract`` or a bad ``max_words``; the errors of
            :func:`~hf_layerswap.evaluation.contract.read_source`.
    """
    if contract not in CONTRACTS:
        raise ValueError(f"contract={contract!r}: allowed {sorted(CONTRACTS) + ['rolling']}")
    spec = CONTRACTS[contract]
    window = spec["window"] if window is None else int(window)
    # the contract's stride fits a window given below it (full: non-overlapping windows of that size)
    stride = min(spec["stride"], window) if stride is None else int(stride)
    words_limit = spec["max_words"] if max_words is None else int(max_words)
    if words_limit is not None and words_limit < 1:
        raise ValueError(f"max_words={max_words}: must be a positive number of words")
    raw, source = read_source(text)
    prepared, words = prepare_text(raw, words_limit)
    ids, bos = tokenize_text(tokenizer, prepared, add_bos)
    record = {
        "name": contract,
        **source,
        "raw_text_sha256": sha256_text(raw),
        "text_sha256": sha256_text(prepared),
        "preparation": "non-empty lines joined with '\\n\\n'"
        + (f"; first {words_limit} whitespace words rejoined with spaces" if words_limit else ""),
        "max_words": words_limit,
        "words": words,
        "bos": bos,
        "tokenizer": type(tokenizer).__name__,
    }
    return ids, window, stride, record


@torch.no_grad()
def perplexity_from_ids(
    model,
    input_ids: torch.Tensor | Sequence[int],
    *,
    window: int = 512,
    stride: int = 256,
    bootstrap: int = 1000,
    seed: int = 42,
    batch_size: int = 2,
    paper_token_count: bool = False,
    contract: dict | None = None,
    progress: bool = False,
) -> PerplexityResult:
    """Sliding-window perplexity of one token sequence (the core of :func:`evaluate_perplexity`).

    Args:
        model: a causal LM returning ``.logits`` of shape ``(B, K, V)`` and accepting
            ``logits_to_keep``. Run in its own dtype; log-softmax is taken in fp32 and
            NLL summed in fp64.
        input_ids: ``(N,)`` or ``(1, N)`` token ids (BOS already included if wanted).
        window, stride: window length and step, tokens (``1 <= stride <= window``).
        bootstrap: number of window resamples for the CI (0 = no CI).
        seed: ``numpy.random.RandomState`` seed of the bootstrap.
        batch_size: windows per forward pass. Peak memory grows with
            ``batch_size * window * vocab * 4`` bytes (logits).
        paper_token_count: reproduce the released script's per-window count (see module doc).
        contract: extra fields merged into the result's ``contract``.
        progress: show a progress bar counted in tokens run through the model (the sum of
            the window lengths), advanced after every batch of windows.

    Raises:
        ValueError: bad ``window``/``stride``/``batch_size``, fewer than 2 tokens, a
            window longer than the model's ``max_position_embeddings``, or a model that is
            not a causal LM (:func:`check_causal_lm`).
    """
    check_causal_lm(model)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must have shape (N,) or (1, N); got {tuple(ids.shape)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an int >= 1")

    check_token_ids(ids, model, "input_ids")
    check_positions(model, window, f"window={window}", "lower window")
    spans = sliding_windows(len(ids), window, stride, paper_token_count=paper_token_count)
    device = input_device(model)
    was_training = model.training
    model.eval()

    nll = np.zeros(len(spans), dtype=np.float64)
    counts = np.array([end - score_from for _, end, score_from in spans], dtype=np.int64)

    bar = tqdm(total=sum(end - begin for begin, end, _ in spans), desc="perplexity windows", unit=" token",
               disable=not progress, dynamic_ncols=True, leave=None)
    try:
        for length, keep, chunk in window_batches(spans, batch_size):
            batch = torch.stack([ids[spans[k][0] : spans[k][1]] for k in chunk]).to(device)
            out = model(input_ids=batch, use_cache=False, logits_to_keep=keep)
            # logits at positions length-keep .. length-1 predict tokens length-keep+1 .. length
            logits = out.logits[:, -keep:-1, :]
            targets = batch[:, length - keep + 1 :]
            for row, k in enumerate(chunk):
                token_nll = F.cross_entropy(logits[row].float(), targets[row].to(logits.device), reduction="none")
                nll[k] = token_nll.double().sum().item()
            bar.update(length * len(chunk))
    finally:
        bar.close()
        model.train(was_training)

    total_nll = float(nll.sum())
    total_tokens = int(counts.sum())
    ci_low, ci_high = bootstrap_ci(nll, counts, bootstrap, seed)
    record = {
        "window": window,
        "stride": stride,
        "num_input_tokens": int(len(ids)),
        "scored_tokens": total_tokens,
        "windows": len(spans),
        "scoring": "paper_token_count" if paper_token_count else "each position 1..N-1 scored once (stride < window)",
        "ppl_formula": "exp(total NLL / total scored tokens), nats",
        "bootstrap": {
            "resamples": int(bootstrap),
            "seed": int(seed),
            "rng": BOOTSTRAP_RNG,
            "unit": "window",
            "percentiles": [2.5, 97.5],
        },
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "log_softmax_dtype": "float32",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "device": str(device),
        "versions": library_versions(),
        "model": {"fingerprint": model_fingerprint(model)},  # which weights were measured (the card checks it)
    }
    record.update(contract or {})
    return PerplexityResult(
        ppl=math.exp(total_nll / total_tokens),
        nll=total_nll,
        tokens=total_tokens,
        windows=len(spans),
        ci_low=ci_low,
        ci_high=ci_high,
        contract=record,
        window_nll=[float(x) for x in nll],
        window_tokens=[int(c) for c in counts],
    )


def evaluate_perplexity(
    model,
    text=None,
    *,
    tokenizer=None,
    contract: str = "matched",
    window: int | None = None,
    stride: int | None = None,
    max_words: int | None = None,
    bootstrap: int = 1000,
    seed: int = 42,
    batch_size: int = 2,
    add_bos: bool | None = None,
    paper_token_count: bool = False,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of ``model`` on ``text`` under a named contract (see module doc).

    Args:
        model: a causal LM (any dtype/device; evaluated in eval mode, no grad).
        text: ``None`` (the embedded evaluation split, :func:`~hf_layerswap.calibration.embedded_text`),
            a path to a UTF-8 text file (e.g. WikiText-2 ``wiki.test.raw``), a string, or a
            list of strings (joined with ``"\\n\\n"``). A one-line string that holds a path
            separator or ends in a file suffix (:func:`~hf_layerswap.calibration.looks_like_path`)
            is a path: if no such file exists it is an error, never scored as text; give
            such literal text as a list of strings.
        tokenizer: defaults to ``AutoTokenizer.from_pretrained(model.name_or_path)``.
        contract: ``"matched"`` (5,000 words, window 512, stride 256), ``"full"`` (all
            of the text, window 2048, stride 2048) or ``"rolling"`` (lm-eval's rolling
            loglikelihood: every token scored after a prefix token, disjoint windows of
            ``window`` tokens, see :mod:`hf_layerswap.evaluation.rolling`).
        window, stride, max_words: override the contract's values (recorded); a window
            below the contract's stride without a stride of its own is read with stride =
            window (``contract="full", window=128``: disjoint windows of 128 tokens).
        bootstrap: window resamples for the 95% CI (0 = none). seed: its RandomState seed.
        batch_size: windows per forward pass.
        add_bos: ``None`` = the tokenizer's default; ``True``/``False`` force it.
        paper_token_count: the released script's token count (see module doc).
        progress: a progress bar (tqdm) in tokens run through the model, moving after every
            batch of windows; inside another bar it vanishes when done. Not used by the
            ``"rolling"`` contract.

    Returns:
        :class:`PerplexityResult`; ``contract`` records source, split, sha256 of the raw and
        of the evaluated text, words, BOS handling, window, stride, dtype, model identity
        and library versions.

    Raises:
        ValueError: unknown ``contract``, bad window/stride/max_words, fewer than 2 tokens,
            no tokenizer available, a file that is not UTF-8 text, or a model that is not a
            causal LM.
        FileNotFoundError: ``text`` names a file that does not exist.
        TypeError: ``text`` of an unsupported type.
    """
    check_causal_lm(model)
    if contract == "rolling":  # lm-eval's loglikelihood_rolling, see hf_layerswap.evaluation.rolling
        if stride is not None or max_words is not None or paper_token_count:
            raise ValueError("contract='rolling' takes window= (lm-eval's max_length) only, not stride/max_words")

        return evaluate_rolling(model, text, tokenizer=tokenizer, window=window, add_bos=add_bos,
                                bootstrap=bootstrap, seed=seed, batch_size=batch_size)
    if contract not in CONTRACTS:
        raise ValueError(f"contract={contract!r}: allowed {sorted(CONTRACTS) + ['rolling']}")
    tokenizer = resolve_tokenizer(model, tokenizer)
    tokens = contract_tokens(text, tokenizer, contract=contract, window=window, stride=stride, max_words=max_words,
                             add_bos=add_bos)
    return perplexity_of_tokens(model, tokens, bootstrap=bootstrap, seed=seed, batch_size=batch_size,
                                paper_token_count=paper_token_count, progress=progress)


def perplexity_of_tokens(
    model,
    tokens: tuple[torch.Tensor, int, int, dict],
    *,
    bootstrap: int = 1000,
    seed: int = 42,
    batch_size: int = 2,
    paper_token_count: bool = False,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of ``model`` on a text tokenized once by :func:`contract_tokens`: bit for bit
    what :func:`evaluate_perplexity` gives on that text, without tokenizing it again (one
    text scored on several models, e.g. the stages of a healing).

    Args:
        model: a causal LM (any dtype/device; evaluated in eval mode, no grad).
        tokens: ``(ids, window, stride, record)`` of :func:`contract_tokens`; ``record`` is
            not modified.
        bootstrap, seed, batch_size, paper_token_count, progress: as for
            :func:`evaluate_perplexity`.

    Returns:
        :class:`PerplexityResult`; ``contract`` is the text's record, the model's identity
        and what :func:`perplexity_from_ids` records.

    Raises:
        ValueError: as :func:`perplexity_from_ids`.
    """
    ids, window, stride, record = tokens
    # the local folder the weights were read from stays out: contracts get published
    record = {**record, "model": {**public_identity(model), "fingerprint": model_fingerprint(model)}}
    return perplexity_from_ids(model, ids, window=window, stride=stride, bootstrap=bootstrap, seed=seed,
                               batch_size=batch_size, paper_token_count=paper_token_count, contract=record,
                               progress=progress)


# ----------------------------------------------------------------------------- comparisons

_COMPARABLE_KEYS = ("text_sha256", "window", "stride", "num_input_tokens", "scored_tokens", "scoring")


def _check_comparable(base: PerplexityResult, pruned: PerplexityResult) -> None:
    for key in _COMPARABLE_KEYS:
        a, b = base.contract.get(key), pruned.contract.get(key)
        if a != b:
            raise ValueError(f"results measured under different contracts: {key} {a!r} vs {b!r}")


def delta_ppl_percent(base: PerplexityResult | float, pruned: PerplexityResult | float) -> float:
    """Pruning cost dPPL% = (PPL_pruned / PPL_base - 1) x 100.

    Raises:
        ValueError: two results measured on different texts/windows/token counts, or a
            non-positive base PPL.
    """
    if isinstance(base, PerplexityResult) and isinstance(pruned, PerplexityResult):
        _check_comparable(base, pruned)
    b = base.ppl if isinstance(base, PerplexityResult) else float(base)
    p = pruned.ppl if isinstance(pruned, PerplexityResult) else float(pruned)
    if not b > 0:
        raise ValueError(f"base PPL {b!r} must be positive")
    return (p / b - 1.0) * 100.0


def delta_ppl_ci(
    base: PerplexityResult, pruned: PerplexityResult, *, resamples: int = 2000, seed: int = 42
) -> tuple[float, float]:
    """Paired bootstrap 95% interval of dPPL% (the paper's Table 28 statistic).

    The same resampled windows enter both PPLs of each resample
    (``numpy.random.RandomState(seed)``); returns the 2.5/97.5 percentiles, in %, or
    ``(None, None)`` when fewer than 2 windows score a token (no interval).

    Raises:
        ValueError: the results were measured under different contracts or lack per-window data.
    """
    _check_comparable(base, pruned)
    if not base.window_nll or len(base.window_nll) != len(pruned.window_nll):
        raise ValueError("both results need per-window NLLs over the same windows")
    tokens = np.asarray(base.window_tokens, dtype=np.float64)
    keep = tokens > 0  # windows that score no token carry no information (see bootstrap_ci)
    tokens = tokens[keep]
    a = np.asarray(base.window_nll)[keep]
    b = np.asarray(pruned.window_nll)[keep]
    if len(a) < MIN_CI_WINDOWS:
        return None, None
    rng = np.random.RandomState(seed)
    idx = rng.randint(0, len(a), size=(resamples, len(a)))
    t = tokens[idx].sum(axis=1)
    delta = (np.exp((b[idx].sum(axis=1) - a[idx].sum(axis=1)) / t) - 1.0) * 100.0
    low, high = np.percentile(delta, [2.5, 97.5])
    return float(low), float(high)
