"""The cost of a prune before it runs: :func:`estimate_cost` (``hf-layerswap prune
--dry-run``).

- :mod:`.estimate`: the model on the meta device, the scoring engine's own schedule, a
  throughput probe (:class:`Throughput`, :func:`measure_throughput`) and the strategy's
  passes (:class:`SelectionPlan`) into a :class:`CostEstimate`;
- :mod:`.steps`: the repair, healing and sparsity steps after the selection, planned from
  their own code.
"""

from __future__ import annotations

from .estimate import CostEstimate, SelectionPlan, Throughput, estimate_cost, measure_throughput

__all__ = ["CostEstimate", "SelectionPlan", "Throughput", "estimate_cost", "measure_throughput"]
