"""The evaluation contract: named window/stride settings, where the text comes from and how
it is prepared and tokenized, the sliding windows, the window bootstrap, and the
:class:`PerplexityResult` every evaluation returns (with its ``contract`` record)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from ..calibration import EMBEDDED_SOURCE, embedded_text, looks_like_path, read_text_file, tokenizer_adds_bos
from ..utils.jsonio import JsonResult, decode_tree

__all__ = [
    "bootstrap_ci", "BOOTSTRAP_RNG", "check_causal_lm", "CONTRACTS", "KNOWN_SOURCES", "MIN_CI_WINDOWS",
    "PerplexityResult", "prepare_text", "read_source", "resolve_tokenizer", "sha256_text", "sliding_windows",
    "tokenize_text",
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
class PerplexityResult(JsonResult):
    """Perplexity of one model on one text under one contract.

    Attributes:
        ppl: exp(nll / tokens).
        nll: total negative log-likelihood of the scored tokens, nats.
        tokens: number of scored tokens.
        windows: number of windows.
        ci_low, ci_high: bootstrap percentile interval on absolute PPL; ``None`` when
            ``bootstrap=0`` or when fewer than 2 windows score a token (resampling one
            window gives the same PPL every time: no interval to report).
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

    def ci_text(self, digits: int = 3) -> str:
        """The 95% CI as printed: ``"[low, high]"``, or ``"none (...)"`` saying why there
        is none (bootstrap off, or fewer than 2 windows that score a token)."""
        if self.ci_low is not None and self.ci_high is not None:
            return f"[{self.ci_low:.{digits}f}, {self.ci_high:.{digits}f}]"
        if not (self.contract.get("bootstrap") or {}).get("resamples"):
            return "none (bootstrap=0)"
        scored = sum(1 for c in self.window_tokens if c > 0) if self.window_tokens else self.windows
        return f"none ({scored} scored window{'' if scored == 1 else 's'}: a bootstrap over windows needs 2)"

    @classmethod
    def from_dict(cls, data: dict) -> PerplexityResult:
        return cls(**decode_tree(dict(data)))


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


def read_source(text) -> tuple[str, dict]:
    """Resolve ``text`` (None, path, str, or list of str) -> (raw text, source record)."""
    if text is None:
        return embedded_text("evaluation"), {"source": f"embedded:{EMBEDDED_SOURCE}", "split": "evaluation"}

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


def sha256_text(text: str) -> str:
    """SHA-256 (hex) of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenize_text(tokenizer, text: str, add_bos: bool | None) -> tuple[torch.Tensor, dict]:
    """``(ids, record)``: ``text`` as a ``(T,)`` long tensor, a BOS first when ``add_bos`` (``None``: the tokenizer's default), and the BOS record; raises ``ValueError`` for a BOS without ``bos_token_id``."""
    default_bos = tokenizer_adds_bos(tokenizer)
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


#: Fewest windows (that score a token) a bootstrap interval is computed from.
MIN_CI_WINDOWS = 2


def bootstrap_ci(window_nll: np.ndarray, window_tokens: np.ndarray, resamples: int, seed: int):
    # a window that scores no token (a one-token tail with stride == window, or with
    # paper_token_count) carries no information; resampling it could give exp(0 / 0) = 1
    """95% percentile bootstrap CI ``(low, high)`` of the perplexity over resampled windows (``(None, None)`` for too few windows or ``resamples <= 0``)."""
    keep = window_tokens > 0
    window_nll, window_tokens = window_nll[keep], window_tokens[keep]
    if resamples <= 0 or len(window_nll) < MIN_CI_WINDOWS:  # one window resampled is one value, not an interval
        return None, None
    rng = np.random.RandomState(seed)
    n = len(window_nll)
    idx = rng.randint(0, n, size=(resamples, n))
    ppl = np.exp(window_nll[idx].sum(axis=1) / np.maximum(window_tokens[idx].sum(axis=1), 1))
    low, high = np.percentile(ppl, [2.5, 97.5])
    return float(low), float(high)


def resolve_tokenizer(model, tokenizer):
    """``tokenizer`` when given, else the one saved with the model (``model.name_or_path``).

    Raises:
        ValueError: none given and none can be loaded (the message says to pass one).
    """
    if tokenizer is not None:
        return tokenizer
    path = getattr(model, "name_or_path", None)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - re-raised with the fix
        raise ValueError(
            f"no tokenizer given and none could be loaded from model.name_or_path={path!r}; "
            "pass tokenizer=..."
        ) from err


_resolve_tokenizer = resolve_tokenizer
