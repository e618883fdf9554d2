"""Choosing which blocks to remove: one entry point, a registry of strategies, one module each.

:func:`select_layers` dispatches to a strategy by name (:data:`STRATEGIES`: every one registered
now; the built-in ones are these):

========================  =====================================================  =============
strategy                  what it removes                                        module
========================  =====================================================  =============
``greedy``                the paper's rule on one protocol's layer scores        ``greedy``
``auto``                  the better (joint removal KL) of both protocols' sets  ``greedy``
``search`` (the default   protocol-guided search over whole candidate sets,      ``search``
of the config and CLI)    optionally with the Ghosted Layers repair in the loop
``beam``                  the paper's interchange-seeded beam search             ``beam``
``block_influence``       ShortGPT's Block Influence                             ``geometry``
``angular_distance``      Gromov et al.'s angular distance (contiguous runs)     ``geometry``
``single_removal_kl``     one-shot single-block removal KL ranking               ``single_removal``
``sleb``                  SLEB's iterative calibration-NLL removal               ``sleb``
========================  =====================================================  =============

The rule itself (:func:`greedy_select`, :func:`check_budget`, :func:`resolve_protect`)
lives in :mod:`hf_layerswap.scoring.rule`; the check every strategy passes through (no removal
on non-finite values, :class:`NonFiniteScoresError`) in :mod:`.finite`; the set objectives and their engine in
:mod:`.objectives` (the calibration NLL of plans in :mod:`.nll`); the result type every criterion returns in :mod:`.criterion`. A new
strategy is one module with one ``@register_strategy("name")``: every module of the package is
imported with it (:func:`~hf_layerswap.utils.registry.import_package_modules`), so dropping
the module here registers the strategy.
"""

from __future__ import annotations

from .beam import BEAM_EVALUATORS, interchange_beam
from .criterion import CriterionResult, as_strategy
from .dispatch import SELECTION_PROTOCOLS, candidates_set, check_report_matches, select_layers
from .geometry import angular_distance, block_influence
from .greedy import swap_guided
from .nll import plan_nll
from .objectives import OBJECTIVES, SetObjective
from .registry import MODEL_STRATEGIES, STRATEGIES, STRATEGY_OPTIONS, get_strategy, register_strategy
from .search import search_criterion, search_select
from .single_removal import single_removal_kl
from ..utils.registry import import_package_modules

__all__ = [
    "BEAM_EVALUATORS",
    "MODEL_STRATEGIES",
    "OBJECTIVES",
    "SELECTION_PROTOCOLS",
    "STRATEGIES",
    "STRATEGY_OPTIONS",
    "CriterionResult",
    "SetObjective",
    "angular_distance",
    "as_strategy",
    "block_influence",
    "candidates_set",
    "check_report_matches",
    "get_strategy",
    "interchange_beam",
    "plan_nll",
    "register_strategy",
    "search_criterion",
    "search_select",
    "select_layers",
    "single_removal_kl",
    "swap_guided",
]

import_package_modules(__name__, __path__)  # every strategy module registers its entries
