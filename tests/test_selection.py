"""Selection: the paper's greedy rule (spacing, protected blocks, non-finite scores never
selected, unmeetable budgets refused) on a hand-built report, and the "auto" protocol
choice recording both candidate sets and their removal KL."""

from __future__ import annotations

import pytest
from conftest import nonfinite_report, tiny_batch, tiny_model

import hf_layerswap as hl
from hf_layerswap.scoring import removal_kl


def test_selection_rule_spacing_protect_and_nonfinite():
    report = nonfinite_report()
    # interchange scores: 3.0, 0.05, 0.01, 0.01, 0.02, 0.02 -> order 2,3,4,5,1,0
    assert hl.select_layers(report, 1) == [2]
    assert hl.select_layers(report, 2) == [2, 4]  # 3 is adjacent to 2, 5 is protected
    assert hl.select_layers(report, 2, spacing=0) == [2, 3]
    assert hl.select_layers(report, 2, spacing=0, protect=()) == [2, 3]
    assert hl.select_layers(report, 3, spacing=0, protect=(0,)) == [2, 3, 4]
    # replacement: layer 5's only partner value is NaN -> never selected
    assert hl.select_layers(report, 2, protocol="replacement", spacing=0, protect=()) == [3, 4]
    with pytest.raises(ValueError, match="cannot select 3 layers"):
        hl.select_layers(report, 3)
    with pytest.raises(ValueError, match="protocol='bogus'"):
        hl.select_layers(report, 1, protocol="bogus")


def test_auto_selection_records_both_candidates():
    model = tiny_model("llama")
    batch = tiny_batch()
    report = hl.score_layers(model, batch, progress=False)
    chosen = hl.select_layers(report, 2, protocol="auto", model=model, calibration=batch)
    record = report.selections[-1]
    assert chosen == record["selected"] == record["candidates"][record["chosen_protocol"]]
    kls = record["removal_kl"]
    if record["candidates"]["replacement"] != record["candidates"]["interchange"]:
        assert kls[record["chosen_protocol"]] == min(kls.values())
        direct = removal_kl(model, batch, [record["candidates"]["replacement"], record["candidates"]["interchange"]])
        assert direct == [kls["replacement"], kls["interchange"]]


# ----------------------------------------------------------------------------- strategy entries
def test_a_strategy_entry_carries_what_differs():
    from hf_layerswap.selection.registry import STRATEGIES, register_strategy, strategy_entry

    greedy, auto, search = strategy_entry("greedy"), strategy_entry("auto"), strategy_entry("search")
    assert (greedy.spacing, auto.spacing, search.spacing) == (1, 1, 0)
    assert greedy.strategy_for("auto") == "auto" and greedy.strategy_for("replacement") == "greedy"
    assert greedy.scores("replacement") == ("replacement",) and auto.scores("interchange") == ("replacement", "interchange")
    assert search.reads("interchange") == () and greedy.reads("interchange") == ("interchange",)
    assert search.guided_by({"selected": [1]}, "interchange") is None
    assert auto.guided_by({"chosen_protocol": "replacement"}, "auto") == "replacement"
    assert search.values({"value": 0.25}) == [("the search's value", 0.25)]
    assert sorted(greedy.criteria) == ["interchange", "replacement"] and sorted(search.criteria) == [
        "search", "search_ghosted"]
    with pytest.raises(TypeError, match=r"register_strategy\('x'\): unknown entry field\(s\) \['spacinG'\]"):
        register_strategy("x", spacinG=1)
    assert "x" not in STRATEGIES
    unknown = strategy_entry("removed_since")  # a record of a strategy this process does not know still reads
    assert unknown.fn is None and unknown.guided_by({}, "interchange") == "interchange" and unknown.values({}) == []


def test_a_recovery_entry_says_if_it_attaches_and_serves_as_an_objective():
    from hf_layerswap.recovery import RECOVERY_METHODS, recovery_entry, search_objectives
    from hf_layerswap.selection.objectives import OBJECTIVES

    assert search_objectives() == ("ghosted",) and OBJECTIVES == ("removal_kl", "nll", "ghosted")
    assert [n for n, m in RECOVERY_METHODS.items() if m.attaches_at_load] == ["ghosted"]
    assert recovery_entry("fused").card_row({"boundaries": [2, 5]}, lambda b: ", ".join(map(str, b))) == (
        "ReplaceMe-style least-squares map folded into `down_proj` before boundaries 2, 5 (pruned numbering): "
        "plain transformers weights")
    assert recovery_entry(None) is None and recovery_entry("unknown") is None
    with pytest.raises(NotImplementedError, match="recovery method 'fused' is no search objective"):
        recovery_entry("fused").cut_operator(None, [1], 0.0)
