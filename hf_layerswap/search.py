"""Moved to :mod:`hf_layerswap.selection.search` (the search) and
:mod:`hf_layerswap.selection.objectives` (the set objectives); this module keeps the old
import path working."""

from __future__ import annotations

from .selection.objectives import OBJECTIVES, SetObjective
from .selection.search import search_criterion, search_select

__all__ = ["OBJECTIVES", "SetObjective", "search_criterion", "search_select"]
