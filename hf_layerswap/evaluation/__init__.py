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

Layout: :mod:`.contract` (contracts, text preparation, windows, bootstrap, the result
type), :mod:`.perplexity` (the verbs and comparisons), :mod:`.rolling` (lm-eval's rolling
contract), :mod:`.generation` (the greedy generation check), :mod:`.tasks` (lm-eval tasks:
:func:`~hf_layerswap.evaluation.tasks.evaluate_tasks`, their card section).
"""

from __future__ import annotations

from pathlib import Path

from .contract import (
    BOOTSTRAP_RNG,
    CONTRACTS,
    KNOWN_SOURCES,
    PerplexityResult,
    check_causal_lm,
    prepare_text,
    resolve_tokenizer,
    sliding_windows,
)
from .generation import DEFAULT_PROMPTS, GenerationCheck, distinct_n, generation_check
from .perplexity import delta_ppl_ci, delta_ppl_percent, evaluate_perplexity, perplexity_from_ids
from .rolling import evaluate_rolling

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
    "evaluate_rolling",
    "generation_check",
    "perplexity_from_ids",
    "perplexity_metric_path",
    "prepare_text",
    "resolve_tokenizer",
    "sliding_windows",
]


def perplexity_metric_path() -> str:
    """Path of the bundled ``evaluate`` metric script: ``evaluate.load(perplexity_metric_path())``
    works offline; ``.compute(model=..., tokenizer=..., text=...)`` (or ``predictions=[...]``)
    returns the same numbers as :func:`evaluate_perplexity`."""
    return str(Path(__file__).resolve().parents[1] / "metrics" / "perplexity" / "perplexity.py")
