"""Evaluation with a stated contract; see :mod:`.perplexity` and :mod:`.rolling`."""

from .perplexity import *  # noqa: F403
from .perplexity import __all__  # noqa: F401
from .perplexity import (  # noqa: F401
    BOOTSTRAP_RNG,
    KNOWN_SOURCES,
    _bootstrap_ci,
    _read_source,
    _resolve_tokenizer,
    _sha256_text,
    _tokenize,
    _tokenizer_adds_bos,
)
