"""Model cards for layer-pruned checkpoints, with both swap-KL protocols side by side.

:func:`render_card` fills the Jinja template shipped in ``hf_layerswap/templates/``
(``modelcard_template.md``) through :meth:`huggingface_hub.ModelCard.from_template`. The
card carries what a reviewer needs to trust a pruned checkpoint:

- front matter: ``base_model``, ``library_name: transformers``, tags (``layerswap``,
  ``layer-pruning``, the protocol), ``model-index`` perplexity of the pruned and the base
  model under one contract, and the base model's license when it is known;
- what was removed (0-based indices in the original numbering, count, parameters before
  and after), the per-layer scores and the pair table of both protocols (replacement in
  both directions, interchange, I/R = d_inter / d_repl), the set each protocol would remove
  at the same budget, the set actually removed and why;
- after one-shot pruning (:func:`hf_layerswap.sparsity.sparsify`): method, pattern,
  allocation and its options, target and achieved sparsity, and a per-block table in the
  original numbering (from the ``SparsityReport``, or from ``config.layerswap_sparsity``);
- the repair of the cut when ``config.layerswap["recovery"]`` records one, and for Ghosted
  Layers operators that ``hf_layerswap`` must be imported to apply them;
- the steps of the prune in the order they ran (``config.layerswap["recipe"]``, e.g.
  remove -> heal -> sparsify -> heal), one row each, when any step ran after the removal
  (:mod:`.steps`);
- after healing (:func:`hf_layerswap.heal`): a Healing section per run with its held-out
  KL before and after, budget, teacher, data hash, when measured the perplexity of the
  dense model, after the cut, after the repair and after healing (one row each) and
  lm-eval tasks before and after healing, runs without their before and after numbers
  flagged, stale runs marked, and the loss / held-out KL plot (:mod:`.healing`);
- evaluation (perplexity with its CI, dPPL%, the contract), calibration (source, content
  hash, prompts x tokens, BOS handling, dtype), scoring cost, library versions, a
  reproduction snippet and the loading snippet;
- PNG plots (matplotlib, Agg canvas): per-layer scores of both protocols with the removed
  layers marked, I/R per pair, the pair heatmap when ``max_gap > 1``, and per-block
  sparsity.

:func:`write_card_files` writes the card, the plots and the JSON sidecars
(``layerswap_report.json`` loads back with :meth:`SwapReport.from_json`,
``layerswap_sparsity.json`` with ``SparsityReport.from_json``) into a folder.
Method: No Free Swap (arXiv 2605.16234).

Layout: :mod:`.format` (file names, number formats), :mod:`.checks` (input checks run
once, facts read from the inputs), :mod:`.evaluation` (the perplexity pair: its contract and
the weights each result measured), :mod:`.sections` (each section as data),
:mod:`.steps` (each kind of step's cell), :mod:`.render` (:func:`render_card`,
:func:`check_card`, :func:`write_card_files`); the
figures come from :mod:`hf_layerswap.plots`.
"""

from __future__ import annotations

from .checks import nonfinite_basis, report_mismatches, sparsity_mismatches, sparsity_refusal
from .evaluation import evaluation_mismatches, normalize_evaluation
from .format import EVALUATION_FILE, MAX_PAIR_ROWS, REPORT_FILE, SPARSITY_FILE  # noqa: F401
from .render import CARD_TEMPLATE, check_card, render_card, write_card_files

__all__ = [
    "CARD_TEMPLATE",
    "EVALUATION_FILE",
    "REPORT_FILE",
    "SPARSITY_FILE",
    "check_card",
    "evaluation_mismatches",
    "normalize_evaluation",
    "render_card",
    "nonfinite_basis",
    "report_mismatches",
    "sparsity_mismatches",
    "sparsity_refusal",
    "write_card_files",
]
