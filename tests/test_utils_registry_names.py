"""hf_layerswap.utils.registry_names: the live views of the registries' names."""

from __future__ import annotations

import pickle

import pytest

from hf_layerswap import recovery, sparsity
from hf_layerswap.recovery import RECOVERY_METHODS, RecoveryMethod, register_recovery_method
from hf_layerswap.utils.registry_names import RegistryNames
from hf_layerswap.selection.objectives import OBJECTIVES
from hf_layerswap.sparsity import PRUNERS, register_pruner


def test_a_view_reads_its_registry_at_every_use():
    registry = {"a": 1, "b": 2}
    view = RegistryNames(lambda: registry)
    assert view == ("a", "b") and ("a", "b") == view and view == ["a", "b"] and view != ("b", "a")
    registry["c"] = 3
    assert list(view) == ["a", "b", "c"] and len(view) == 3 and "c" in view and view[-1] == "c"
    assert view[1:] == ("b", "c") and view + ("d",) == ("a", "b", "c", "d") and ("z",) + view == ("z", "a", "b", "c")
    assert repr(view) == "('a', 'b', 'c')" and view.snapshot() == ("a", "b", "c")
    assert pickle.loads(pickle.dumps(view)) == ("a", "b", "c")
    with pytest.raises(TypeError):
        hash(view)
    assert view != "abc" and view != {"a", "b", "c"}


def test_the_package_lists_are_live_views_of_their_registries():
    """recovery.METHODS, sparsity.METHODS and OBJECTIVES were tuples taken at import: a
    method registered later was missing from them."""
    assert recovery.METHODS == ("none", "ghosted", "fused", "linearpatch")
    assert sparsity.METHODS == ("wanda", "sparsegpt", "magnitude")
    assert OBJECTIVES == ("removal_kl", "nll", "ghosted")

    class LateObjective(RecoveryMethod):
        search_objective = True

    register_recovery_method("test_late_repair")(LateObjective)
    register_pruner("test_late_pruner", label="a test rule")(lambda weight, statistics, target, pattern, options: weight)
    try:
        assert recovery.METHODS[-1] == "test_late_repair" and OBJECTIVES[-1] == "test_late_repair"
        assert sparsity.METHODS[-1] == "test_late_pruner"
    finally:
        RECOVERY_METHODS.pop("test_late_repair", None)
        PRUNERS.pop("test_late_pruner", None)
    assert "test_late_repair" not in recovery.METHODS and "test_late_pruner" not in sparsity.METHODS
