"""WikiText-2 calibration text for the benchmarks: one builder, two named variants.

The tokenized WikiText-2 release (``../shared/data/wikitext-2/valid.txt``) holds one
paragraph per line, with lines of a single space between headings and sections. Two
readings of it give different prompts, so each is a named variant, and the label of every
set it builds says which one:

- ``sections`` (the default; the library's reading, :func:`hf_layerswap.calibration.build_calibration`
  on the file): text split at blank lines, so one prompt is a *section*, the consecutive
  paragraphs under one heading joined by spaces; headings dropped, at least 50 characters;
  538 prompts in the validation split; a seeded shuffle (``random.Random(seed)`` over the
  prompt order). The quality, recovery, heal, precision, speed, sparsity and streaming
  benchmarks use it.
- ``lines``: one prompt per line (a single WikiText paragraph), inside articles only (text
  before the first top-level heading is dropped), headings dropped, at least 50 characters;
  1713 prompts; the same seeded shuffle. The peeling benchmark and ``train_tiny.py`` use it.

(The quality, speed and sparsity scripts used to build the ``sections`` prompts their own
way, stripping or rewriting the blank lines first; those give exactly the library's prompts,
so they are the same variant.)
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from hf_layerswap.calibration import CalibrationSet, build_calibration, split_paragraphs

__all__ = [
    "TOP_HEADING",
    "VALID",
    "VARIANTS",
    "sample_paragraphs",
    "wikitext_articles",
    "wikitext_calibration",
    "wikitext_prompts",
]

VALID = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "valid.txt"
#: A top-level WikiText heading line (`` = Title = ``): an article starts there.
TOP_HEADING = re.compile(r"^ = [^=].* = $")
#: The variants and what each prompt is.
VARIANTS = {
    "sections": "a section per prompt: the paragraphs under one heading, joined",
    "lines": "a paragraph (one line) per prompt",
}


def wikitext_articles(path: Path) -> list[list[str]]:
    """Articles of a WikiText-2 file: lists of paragraphs (one paragraph per line; headings dropped)."""
    articles: list[list[str]] = []
    for line in Path(path).read_text(encoding="utf-8").split("\n"):
        if TOP_HEADING.match(line):
            articles.append([])
            continue
        text = line.strip()
        if not text or (text.startswith("=") and text.endswith("=")):
            continue
        if articles:
            articles[-1].append(text)
    return [a for a in articles if a]


def sample_paragraphs(paragraphs: list[str], n: int, seed: int, min_chars: int = 50) -> list[str]:
    """A seeded sample of ``n`` paragraphs of at least ``min_chars`` characters."""
    pool = [p for p in paragraphs if len(p) >= min_chars]
    random.Random(seed).shuffle(pool)
    return pool[:n]


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: allowed {sorted(VARIANTS)}")


def wikitext_prompts(num_prompts: int, seed: int = 0, variant: str = "sections", path: Path = VALID) -> list[str]:
    """The first ``num_prompts`` prompts of ``path`` (WikiText-2 validation by default) after
    the seeded shuffle, read as ``variant`` (see the module docstring).

    Raises:
        ValueError: an unknown variant.
    """
    _check_variant(variant)
    if variant == "lines":
        return sample_paragraphs([p for article in wikitext_articles(path) for p in article], num_prompts, seed)
    # the texts build_calibration draws from the file (its split, its seeded shuffle of the order)
    paragraphs = split_paragraphs(Path(path).read_text(encoding="utf-8"))
    order = list(range(len(paragraphs)))
    random.Random(seed).shuffle(order)
    return [paragraphs[i] for i in order[:num_prompts]]


def wikitext_calibration(tokenizer, num_prompts: int, seq_len: int, seed: int = 0,
                         variant: str = "sections") -> CalibrationSet:
    """WikiText-2 validation calibration prompts, right-padded, truncated to ``seq_len`` tokens.

    ``sections`` is :func:`~hf_layerswap.calibration.build_calibration` on the file; ``lines``
    tokenizes :func:`wikitext_prompts`' paragraphs the same way. The set's description starts
    with ``WikiText-2 validation, variant <name>`` and keeps the library's details (prompt
    count, seed, truncation, BOS).

    Raises:
        ValueError: an unknown variant (and what ``build_calibration`` raises).
    """
    _check_variant(variant)
    source = VALID if variant == "sections" else wikitext_prompts(num_prompts, seed, variant)
    calib = build_calibration(str(source) if variant == "sections" else source, tokenizer,
                              num_prompts=num_prompts, seq_len=seq_len, seed=seed)
    tail = calib.description.split(";", 1)[1] if ";" in calib.description else ""
    calib.description = (f"WikiText-2 validation, variant {variant} ({VARIANTS[variant]}; >= 50 chars, headings "
                         f"dropped, seed {seed}, first {calib.num_prompts});{tail}")
    return calib
