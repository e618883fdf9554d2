"""Surgery: removing decoder blocks from a model in place, and what a cut carries with it.

- :mod:`.removal`: :func:`remove_layers` (the blocks, the per-layer config lists and
  index-valued fields, the ``config.layerswap`` record) and
  :func:`check_surgery_invariants`;
- :mod:`.operators`: the stream operators a repaired cut carries (hooks saved next to the
  weights and re-attached at load), which a later cut moves with their blocks;
- :mod:`.history`: the ``config.layerswap`` record of every removal step, checked against
  the model when it is loaded or pruned again.
"""

from __future__ import annotations

from .operators import (
    LOADER_NOTE,
    RECOVERY_FILE,
    GhostedOperator,
    attach_saved_recovery,
    attached_operators,
    detach_recovery,
    save_recovery,
)
from .removal import (
    INDEX_FIELDS,
    UNMAPPABLE_FIELDS,
    check_surgery_invariants,
    kept_after,
    original_indices,
    remove_layers,
    stale_healing,
)

__all__ = [
    "GhostedOperator",
    "INDEX_FIELDS",
    "LOADER_NOTE",
    "RECOVERY_FILE",
    "UNMAPPABLE_FIELDS",
    "attach_saved_recovery",
    "attached_operators",
    "check_surgery_invariants",
    "detach_recovery",
    "kept_after",
    "original_indices",
    "remove_layers",
    "save_recovery",
    "stale_healing",
]
