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
