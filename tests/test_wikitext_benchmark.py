"""benchmarks/wikitext.py: the two named readings of WikiText-2 validation give the prompt
counts of the split, and an unknown variant is refused with the allowed names."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from wikitext import VARIANTS, wikitext_prompts  # noqa: E402


def test_wikitext_variants_name_what_a_prompt_is(wikitext_valid):
    sections = wikitext_prompts(1000, seed=0, path=wikitext_valid)
    lines = wikitext_prompts(5000, seed=0, variant="lines", path=wikitext_valid)
    assert (len(sections), len(lines)) == (538, 1713)  # every prompt of the validation split
    assert sorted(VARIANTS) == ["lines", "sections"]
    # a section joins the paragraphs (lines) under one heading: every line lies inside one section
    assert all(any(line in section for section in sections) for line in lines[:20])
    assert wikitext_prompts(3, seed=1) != wikitext_prompts(3, seed=0)
    with pytest.raises(ValueError, match=r"variant='paragraphs': allowed \['lines', 'sections'\]"):
        wikitext_prompts(3, variant="paragraphs")
