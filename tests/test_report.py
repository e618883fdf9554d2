"""Results: the SwapReport's definitions (a pair's replacement value, the per-layer scores
of each protocol, the protocol gap) on a hand-built report with non-finite values, its
JSON round trip, and the PruneProvenance record a pruning step writes."""

from __future__ import annotations

import json
import math

import pytest
from conftest import nonfinite_report

from hf_layerswap.report import PruneProvenance, SwapReport


def test_report_definitions_and_json_round_trip(tmp_path):
    report = nonfinite_report()
    assert report.pair(2, 1).replacement == 0.30
    assert report.pair(3, 4).replacement == 0.03
    assert math.isnan(report.pair(4, 5).replacement)  # NaN is kept, never dropped
    assert report.layer_scores("replacement") == [5.0, 0.30, 0.30, 0.03, 0.03, pytest.approx(math.nan, nan_ok=True)]
    assert report.layer_scores("interchange") == [3.0, 0.05, 0.01, 0.01, 0.02, 0.02]
    gap = report.protocol_gap()
    assert gap["pairs"][1]["ratio"] == pytest.approx(0.05 / 0.30)
    assert gap["summary"]["finite_pairs"] == 3  # inf and nan pairs have no ratio
    path = report.to_json(tmp_path / "r.json")
    again = SwapReport.from_json(path)
    assert again == report
    assert math.isinf(again.pair(3, 4).interchange)
    assert json.loads(path.read_text())["pairs"][3]["interchange"] == "Infinity"


def test_provenance_round_trip():
    record = PruneProvenance(selection="explicit layers", config={"num_layers": None})
    assert record.to_dict() == {"selection": "explicit layers", "config": {"num_layers": None}}
    assert PruneProvenance.from_dict({**record.to_dict(), "removed_layers": [1]}) == record
    assert PruneProvenance.from_dict({}).selection == "not recorded"
    with pytest.raises(TypeError, match="needs a mapping, got list"):
        PruneProvenance.from_dict([1])
