"""Evaluation with a stated contract: sliding-window perplexity and a greedy generation check.

Perplexity (:func:`evaluate_perplexity`) follows the "matched" contract of "No Free Swap"
(arXiv 2605.16234, §4.2) by default:

1. text preparation: the non-empty lines are joined with ``"\\n\\n"``, the first 5,000
   whitespace-separated words are kept and rejoined with single spaces;
2. the text is tokenized once (one sequence of N ids; BOS handling below);
3. windows of 512 tokens start every 256 tokens (``end = min(begin + 512, N)``); in each
   window only the tokens not scored by an earlier window (positions ``prev_end..end-1``)
   are scored, each predicted from all the context the window holds;
4. PPL = exp(total NLL / total scored tokens), NLL in nats;
5. 95% interval: 1,000 bootstrap resamples of the windows (``numpy.random.RandomState(42)``),
   each giving exp(sum NLL / sum tokens) of the resampled windows; 2.5/97.5 percentiles on
   absolute PPL.

With ``stride < window`` every position 1..N-1 is scored exactly once (position 0 has no
context). ``"full"`` evaluates the whole text (lines kept, no word limit) in windows of 2048
with stride 2048: non-overlapping windows, so each window's first token has no context and
is not scored (N - windows tokens are scored).

Notes on the paper's released script (``paper_token_count=True`` reproduces it): it scores
``target_len - 1`` tokens per window, i.e. it also leaves out the first new token of every
window after the first (N - windows tokens; Qwen3-8B: 22 windows / 5,734 tokens). The
transformers perplexity guide weights each window's mean loss by ``trg_len - 1`` although
``trg_len`` labels are scored after the first window; this module sums per-token NLLs, so it
has neither quirk by default.

BOS: ``add_bos=None`` keeps what the tokenizer does by default (SmolLM2 adds none, Gemma and
Llama add one); ``True``/``False`` force it. The choice and the BOS id are recorded. An added
BOS is only context: it is never a scored target. EOS is never appended.

Every result carries its ``contract``: source and split, sha256 of the evaluated text, words,
tokens, window, stride, BOS handling, dtype, the model's identity and library versions.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..provenance import library_versions, model_fingerprint, public_identity

__all__ = [
    "CONTRACTS",
    "DEFAULT_PROMPTS",
    "GenerationCheck",
    "PerplexityResult",
    "delta_ppl_ci",
    "delta_ppl_percent",
    "check_causal_lm",
    "distinct_n",
    "evaluate_perplexity",
    "generation_check",
    "perplexity_from_ids",
    "perplexity_metric_path",
    "prepare_text",
    "sliding_windows",
]

#: Named contracts: window, stride (tokens) and word limit.
CONTRACTS: dict[str, dict] = {
    "matched": {"window": 512, "stride": 256, "max_words": 5000},
    "full": {"window": 2048, "stride": 2048, "max_words": None},
}

BOOTSTRAP_RNG = "numpy.random.RandomState"

#: Known evaluation files: file name -> (dataset, split).
KNOWN_SOURCES = {
    "wiki.test.raw": ("wikitext-2-raw-v1", "test"),
    "wiki.valid.raw": ("wikitext-2-raw-v1", "validation"),
    "wiki.train.raw": ("wikitext-2-raw-v1", "train"),
}


# ----------------------------------------------------------------------------- results


@dataclass
class PerplexityResult:
    """Perplexity of one model on one text under one contract.

    Attributes:
        ppl: exp(nll / tokens).
        nll: total negative log-likelihood of the scored tokens, nats.
        tokens: number of scored tokens.
        windows: number of windows.
        ci_low, ci_high: bootstrap percentile interval on absolute PPL (``None`` when
            ``bootstrap=0``).
        contract: everything needed to reproduce or compare the number (see module doc).
        window_nll: per-window NLL sums (nats), for paired comparisons (:func:`delta_ppl_ci`).
        window_tokens: per-window scored-token counts.
    """

    ppl: float
    nll: float
    tokens: int
    windows: int
    ci_low: float | None
    ci_high: float | None
    contract: dict
    window_nll: list[float] = field(default_factory=list)
    window_tokens: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PerplexityResult:
        return cls(**data)


# ----------------------------------------------------------------------------- text


def prepare_text(text: str, max_words: int | None) -> tuple[str, int]:
    """Apply the contract's text preparation; returns ``(text, words)``.

    Non-empty lines (after stripping ``\\r``) are joined with ``"\\n\\n"``. With
    ``max_words``, the first ``max_words`` whitespace-separated words are rejoined with
    single spaces (so the line structure disappears, as in the paper's matched contract).
    ``words`` counts the words of the returned text.
    """
    lines = [ln.rstrip("\r") for ln in text.split("\n") if ln.strip()]
    joined = "\n\n".join(lines)
    if max_words is None:
        return joined, len(joined.split())
    words = joined.split()[:max_words]
    return " ".join(words), len(words)


def _read_source(text) -> tuple[str, dict]:
    """Resolve ``text`` (None, path, str, or list of str) -> (raw text, source record)."""
    if text is None:
        from ..calibration import EMBEDDED_SOURCE, embedded_text

        return embedded_text("evaluation"), {"source": f"embedded:{EMBEDDED_SOURCE}", "split": "evaluation"}
    from ..calibration import looks_like_path, read_text_file

    if isinstance(text, os.PathLike) or (
        isinstance(text, str) and "\n" not in text and len(text) < 4096 and (looks_like_path(text) or Path(text).is_file())
    ):
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(
                f"text={str(path)!r}: no such file (a one-line string with a path separator or a text-file suffix "
                "is read as a path); pass literal text as a list of strings, e.g. [text]"
            )
        dataset, split = KNOWN_SOURCES.get(path.name, (None, None))
        record = {"source": f"file:{path.name}", "split": split}
        if dataset:
            record["dataset"] = dataset
        return read_text_file(path, "text"), record
    if isinstance(text, str):
        return text, {"source": "string", "split": None}
    if isinstance(text, Sequence) and all(isinstance(t, str) for t in text):
        return "\n\n".join(text), {"source": f"list of {len(text)} strings", "split": None}
    raise TypeError(f"text must be None, a path, a string or a list of strings; got {type(text).__name__}")


def check_causal_lm(model, what: str = "perplexity") -> None:
    """Refuse, before any forward pass, a model that cannot score next tokens: one with no
    language-model head (``get_output_embeddings()`` is ``None``, e.g. ``BertModel``) or an
    encoder-decoder model.

    Raises:
        ValueError: naming the model class and what is needed.
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model: {what} needs a decoder-only causal LM "
                         "(AutoModelForCausalLM)")
    head = getattr(model, "get_output_embeddings", None)
    if config is None or head is None or head() is None:
        raise ValueError(f"{name} has no language-model head (get_output_embeddings() is None): {what} needs a causal "
                         "LM that returns next-token logits, e.g. one loaded with AutoModelForCausalLM")


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _tokenizer_adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(plain) and with_special[0] == bos


def _tokenize(tokenizer, text: str, add_bos: bool | None) -> tuple[torch.Tensor, dict]:
    default_bos = _tokenizer_adds_bos(tokenizer)
    use_bos = default_bos if add_bos is None else bool(add_bos)
    if use_bos and tokenizer.bos_token_id is None:
        raise ValueError("add_bos=True but the tokenizer has no bos_token_id")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if use_bos:
        ids = [tokenizer.bos_token_id] + list(ids)
    record = {
        "add_bos": use_bos,
        "bos_token_id": tokenizer.bos_token_id if use_bos else None,
        "bos_choice": "tokenizer default" if add_bos is None else "explicit",
        "tokenizer_adds_bos_by_default": default_bos,
        "eos_appended": False,
    }
    return torch.tensor(ids, dtype=torch.long), record


# ----------------------------------------------------------------------------- windows


def sliding_windows(
    num_tokens: int, window: int, stride: int, *, paper_token_count: bool = False
) -> list[tuple[int, int, int]]:
    """Window bookkeeping: a list of ``(begin, end, score_from)``.

    Window k covers positions ``[begin, end)``; the targets scored in it are positions
    ``[score_from, end)``, each predicted from positions ``begin..t-1``. ``score_from =
    max(prev_end, begin + 1)``; with ``paper_token_count`` it is ``prev_end + 1`` after the
    first window (the released script's count). Windows start every ``stride`` tokens until
    one reaches ``num_tokens``.

    Raises:
        ValueError: ``num_tokens < 2``, ``window < 2``, or ``stride`` outside ``1..window``.
    """
    if window < 2:
        raise ValueError(f"window={window}: must be at least 2 tokens")
    if not 1 <= stride <= window:
        raise ValueError(f"stride={stride}: must be between 1 and window={window}")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); at least 2 are needed to score one")
    spans = []
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        score_from = max(prev_end, begin + 1)
        if paper_token_count and prev_end > 0:
            score_from = prev_end + 1
        spans.append((begin, end, score_from))
        prev_end = end
        if end == num_tokens:
            break
    return spans


def _bootstrap_ci(window_nll: np.ndarray, window_tokens: np.ndarray, resamples: int, seed: int):
    # a window that scores no token (a one-token tail with stride == window, or with
    # paper_token_count) carries no information; resampling it could give exp(0 / 0) = 1
    keep = window_tokens > 0
    window_nll, window_tokens = window_nll[keep], window_tokens[keep]
    if resamples <= 0 or len(window_nll) == 0:
        return None, None
    rng = np.random.RandomState(seed)
    n = len(window_nll)
    idx = rng.randint(0, n, size=(resamples, n))
    ppl = np.exp(window_nll[idx].sum(axis=1) / np.maximum(window_tokens[idx].sum(axis=1), 1))
    low, high = np.percentile(ppl, [2.5, 97.5])
    return float(low), float(high)


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
    from ..calibration import check_token_ids

    check_token_ids(ids, model, "input_ids")
    max_pos = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_pos is not None and window > max_pos:
        raise ValueError(f"window={window} exceeds the model's max_position_embeddings={max_pos}")
    spans = sliding_windows(len(ids), window, stride, paper_token_count=paper_token_count)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()

    nll = np.zeros(len(spans), dtype=np.float64)
    counts = np.array([end - score_from for _, end, score_from in spans], dtype=np.int64)
    # group windows of equal shape (length, number of kept logits) into batches
    groups: dict[tuple[int, int], list[int]] = {}
    for k, (begin, end, score_from) in enumerate(spans):
        groups.setdefault((end - begin, end - score_from + 1), []).append(k)

    bar = tqdm(total=sum(end - begin for begin, end, _ in spans), desc="perplexity windows", unit=" token",
               disable=not progress, dynamic_ncols=True, leave=None)
    try:
        for (length, keep), members in groups.items():
            for start in range(0, len(members), batch_size):
                chunk = members[start : start + batch_size]
                batch = torch.stack([ids[spans[k][0] : spans[k][1]] for k in chunk]).to(device)
                out = model(input_ids=batch, use_cache=False, logits_to_keep=keep)
                # logits at positions length-keep .. length-1 predict tokens length-keep+1 .. length
                logits = out.logits[:, -keep:-1, :]
                targets = batch[:, length - keep + 1 :]
                for row, k in enumerate(chunk):
                    token_nll = F.cross_entropy(logits[row].float(), targets[row], reduction="none")
                    nll[k] = token_nll.double().sum().item()
                bar.update(length * len(chunk))
    finally:
        bar.close()
        model.train(was_training)

    total_nll = float(nll.sum())
    total_tokens = int(counts.sum())
    ci_low, ci_high = _bootstrap_ci(nll, counts, bootstrap, seed)
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


def _resolve_tokenizer(model, tokenizer):
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    path = getattr(model, "name_or_path", None)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - re-raised with the fix
        raise ValueError(
            f"no tokenizer given and none could be loaded from model.name_or_path={path!r}; "
            "pass tokenizer=..."
        ) from err


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
            ``window`` tokens, see :mod:`hf_layerswap.rolling`).
        window, stride, max_words: override the contract's values (recorded).
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
    if contract == "rolling":  # lm-eval's loglikelihood_rolling, see hf_layerswap.rolling
        if stride is not None or max_words is not None or paper_token_count:
            raise ValueError("contract='rolling' takes window= (lm-eval's max_length) only, not stride/max_words")
        from .rolling import evaluate_rolling

        return evaluate_rolling(model, text, tokenizer=tokenizer, window=window, add_bos=add_bos,
                                bootstrap=bootstrap, seed=seed, batch_size=batch_size)
    if contract not in CONTRACTS:
        raise ValueError(f"contract={contract!r}: allowed {sorted(CONTRACTS) + ['rolling']}")
    spec = CONTRACTS[contract]
    window = spec["window"] if window is None else int(window)
    stride = spec["stride"] if stride is None else int(stride)
    words_limit = spec["max_words"] if max_words is None else int(max_words)
    if words_limit is not None and words_limit < 1:
        raise ValueError(f"max_words={max_words}: must be a positive number of words")
    tokenizer = _resolve_tokenizer(model, tokenizer)

    raw, source = _read_source(text)
    prepared, words = prepare_text(raw, words_limit)
    ids, bos = _tokenize(tokenizer, prepared, add_bos)

    record = {
        "name": contract,
        **source,
        "raw_text_sha256": _sha256_text(raw),
        "text_sha256": _sha256_text(prepared),
        "preparation": "non-empty lines joined with '\\n\\n'"
        + (f"; first {words_limit} whitespace words rejoined with spaces" if words_limit else ""),
        "max_words": words_limit,
        "words": words,
        "bos": bos,
        "tokenizer": type(tokenizer).__name__,
        # the local folder the weights were read from stays out: contracts get published
        "model": {**public_identity(model), "fingerprint": model_fingerprint(model)},
    }
    return perplexity_from_ids(
        model,
        ids,
        window=window,
        stride=stride,
        bootstrap=bootstrap,
        seed=seed,
        batch_size=batch_size,
        paper_token_count=paper_token_count,
        contract=record,
        progress=progress,
    )


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
    (``numpy.random.RandomState(seed)``); returns the 2.5/97.5 percentiles, in %.

    Raises:
        ValueError: the results were measured under different contracts or lack per-window data.
    """
    _check_comparable(base, pruned)
    if not base.window_nll or len(base.window_nll) != len(pruned.window_nll):
        raise ValueError("both results need per-window NLLs over the same windows")
    tokens = np.asarray(base.window_tokens, dtype=np.float64)
    keep = tokens > 0  # windows that score no token carry no information (see _bootstrap_ci)
    tokens = tokens[keep]
    a = np.asarray(base.window_nll)[keep]
    b = np.asarray(pruned.window_nll)[keep]
    rng = np.random.RandomState(seed)
    idx = rng.randint(0, len(a), size=(resamples, len(a)))
    t = tokens[idx].sum(axis=1)
    delta = (np.exp((b[idx].sum(axis=1) - a[idx].sum(axis=1)) / t) - 1.0) * 100.0
    low, high = np.percentile(delta, [2.5, 97.5])
    return float(low), float(high)


# ----------------------------------------------------------------------------- generation

#: Neutral prompts for :func:`generation_check` when none are given.
DEFAULT_PROMPTS = (
    "The history of the city begins",
    "Photosynthesis is the process by which",
    "In the first chapter of the book, the author",
)


@dataclass
class GenerationCheck:
    """Greedy continuations and how repetitive they are.

    Attributes:
        prompts: the prompts.
        continuations: decoded greedy continuations (without the prompt).
        new_tokens: generated token ids per prompt.
        distinct_2: per prompt, distinct bigrams / bigrams among its generated tokens
            (``None`` with fewer than 2 tokens).
        mean_distinct_2: mean of the defined ``distinct_2`` values (1 = no repeated bigram).
        repetition_rate: ``1 - mean_distinct_2``.
        cache_consistent: greedy generation with the KV cache produced the same tokens as
            without it, for every prompt.
        cache_mismatches: indices of prompts where they differ (or the cached run failed).
        cache_errors: prompt index -> the error raised by the cached run, if any.
        max_new_tokens: generation length limit.

    The continuations are those generated without the cache (the reference path).
    """

    prompts: list[str]
    continuations: list[str]
    new_tokens: list[list[int]]
    distinct_2: list[float | None]
    mean_distinct_2: float | None
    repetition_rate: float | None
    cache_consistent: bool
    cache_mismatches: list[int]
    cache_errors: dict[int, str]
    max_new_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GenerationCheck:
        data = dict(data)
        data["cache_errors"] = {int(k): v for k, v in data.get("cache_errors", {}).items()}  # JSON keys are str
        return cls(**data)


def distinct_n(tokens: Sequence[int], n: int = 2) -> float | None:
    """Distinct-n (Li et al., 2016) of one sequence: unique n-grams / n-grams; ``None`` if there are none."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return None
    return len(set(grams)) / len(grams)


@torch.no_grad()
def generation_check(
    model, tokenizer, prompts: Sequence[str] | None = None, *, max_new_tokens: int = 32
) -> GenerationCheck:
    """Greedy continuations of ``prompts`` (one at a time, no padding), their distinct-2,
    and whether generation with the KV cache equals generation without it (an error in
    the cached run is recorded in ``cache_errors``, not raised).

    A pruned model whose ``layer_idx`` or per-layer config was left inconsistent typically
    fails the cache comparison; one that degenerates shows a high ``repetition_rate``
    even when its perplexity looks acceptable.

    Raises:
        ValueError: no prompts, or ``max_new_tokens < 1``.
    """
    if isinstance(prompts, str):
        raise TypeError(f"prompts={prompts[:40]!r}: give a list of strings, e.g. [{prompts[:40]!r}]")
    prompts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    for k, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not tokenizer(prompt)["input_ids"]:
            raise ValueError(f"prompt {k} ({prompt!r}) gives no token: every prompt needs at least one")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be at least 1")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=pad)
    was_training = model.training
    model.eval()
    continuations, new_tokens, mismatches = [], [], []
    cache_errors: dict[int, str] = {}
    try:
        for k, prompt in enumerate(prompts):
            enc = tokenizer(prompt, return_tensors="pt").to(device)
            n_prompt = enc["input_ids"].shape[1]
            uncached = model.generate(**enc, use_cache=False, **settings)[0, n_prompt:].tolist()
            try:
                cached = model.generate(**enc, use_cache=True, **settings)[0, n_prompt:].tolist()
            except (RuntimeError, IndexError) as err:  # e.g. two blocks sharing one cache slot
                cached = None
                cache_errors[k] = f"{type(err).__name__}: {err}"
            if cached != uncached:
                mismatches.append(k)
            new_tokens.append(uncached)
            continuations.append(tokenizer.decode(uncached, skip_special_tokens=True))
    finally:
        model.train(was_training)
    d2 = [distinct_n(t, 2) for t in new_tokens]
    defined = [d for d in d2 if d is not None]
    mean = float(np.mean(defined)) if defined else None
    return GenerationCheck(
        prompts=prompts,
        continuations=continuations,
        new_tokens=new_tokens,
        distinct_2=d2,
        mean_distinct_2=mean,
        repetition_rate=None if mean is None else 1.0 - mean,
        cache_consistent=not mismatches,
        cache_mismatches=mismatches,
        cache_errors=cache_errors,
        max_new_tokens=max_new_tokens,
    )


def perplexity_metric_path() -> str:
    """Path of the bundled ``evaluate`` metric script: ``evaluate.load(perplexity_metric_path())``
    works offline; ``.compute(model=..., tokenizer=..., text=...)`` (or ``predictions=[...]``)
    returns the same numbers as :func:`evaluate_perplexity`."""
    return str(Path(__file__).resolve().parents[1] / "metrics" / "perplexity" / "perplexity.py")
