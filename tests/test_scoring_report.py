"""Results: the SwapReport's definitions (a pair's replacement value, the per-layer scores
of each protocol, the protocol gap) on a hand-built report with non-finite values, its
JSON round trip, and the PruneProvenance record a pruning step writes."""

from __future__ import annotations

import json
import math

import pytest
from conftest import nonfinite_report

from hf_layerswap.scoring.report import PairResult, PruneProvenance, SwapReport


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
    record = PruneProvenance(selection="explicit layers", config={"num_to_remove": None})
    assert record.to_dict() == {"selection": "explicit layers", "config": {"num_to_remove": None}}
    assert PruneProvenance.from_dict({**record.to_dict(), "removed_layers": [1]}) == record
    assert PruneProvenance.from_dict({}).selection == "not recorded"
    with pytest.raises(TypeError, match="needs a mapping, got list"):
        PruneProvenance.from_dict([1])


# --------------------------------------------------------------------------- loading checks


def _hand_edited(tmp_path, edit, report=None):
    data = json.loads((report or nonfinite_report()).to_json())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def _refused(path) -> str:
    with pytest.raises(ValueError) as err:
        SwapReport.from_json(path)
    prefix = f"{path} is not a valid SwapReport JSON file: "
    assert str(err.value).startswith(prefix)
    return str(err.value)[len(prefix):]


def _pair(data, i, j):
    return next(p for p in data["pairs"] if (p["i"], p["j"]) == (i, j))


def test_a_negative_kl_is_refused_naming_the_pair_and_field(tmp_path):
    path = _hand_edited(tmp_path, lambda d: _pair(d, 1, 2).update(interchange=-5.0))
    assert _refused(path) == "pairs[1] (1, 2) interchange = -5.0: a KL is >= 0 (the engine clamps each token's KL at 0)"
    trusted = SwapReport.from_json(path, trust=True)  # told to trust it: loaded as written
    assert trusted.pair(1, 2).interchange == -5.0
    path = _hand_edited(tmp_path, lambda d: _pair(d, 1, 2).update(replacement_ij=-1e-9))  # not even float noise
    assert _refused(path) == "pairs[1] (1, 2) replacement_ij = -1e-09: a KL is >= 0 (the engine clamps each token's KL at 0)"


def test_a_deleted_pair_or_a_wrong_depth_is_refused(tmp_path):
    path = _hand_edited(tmp_path, lambda d: d["pairs"].pop(2))
    assert _refused(path) == ("pairs do not match num_blocks = 6 and max_gap = 1 (every pair with 1 <= j - i <= 1, "
                              "5 in all): missing [(2, 3)]")
    path = _hand_edited(tmp_path, lambda d: d.update(num_blocks=9))
    assert _refused(path) == ("pairs do not match num_blocks = 9 and max_gap = 1 (every pair with 1 <= j - i <= 1, "
                              "8 in all): missing [(5, 6), (6, 7), (7, 8)]")
    path = _hand_edited(tmp_path, lambda d: d.update(max_gap=2))
    assert _refused(path).endswith("9 in all): missing [(0, 2), (1, 3), (2, 4), (3, 5)]")
    path = _hand_edited(tmp_path, lambda d: d["pairs"].append({**_pair(d, 1, 2), "i": 0, "j": 2}))
    assert _refused(path).endswith("5 in all): extra [(0, 2)]")
    path = _hand_edited(tmp_path, lambda d: d.update(num_blocks=6.0))
    assert _refused(path) == "num_blocks = 6.0: must be an int"
    path = _hand_edited(tmp_path, lambda d: _pair(d, 1, 2).update(j=2.5))
    assert _refused(path) == "pairs[1] j = 2.5: must be an int block index"
    path = _hand_edited(tmp_path, lambda d: d.update(max_gap=6))
    assert _refused(path) == "max_gap = 6: allowed 1..5 for num_blocks = 6"


def test_values_the_engine_cannot_produce_are_refused(tmp_path):
    cases = [
        (lambda d: _pair(d, 1, 2).update(interchange="NaN"),
         "pairs[1] (1, 2) interchange = NaN: a non-finite value loads only where metadata['nonfinite'] lists it "
         "(as the library writes it)"),
        (lambda d: _pair(d, 1, 2).update(interchange="-Infinity"),
         "pairs[1] (1, 2) interchange = -Infinity: a non-finite value loads only where metadata['nonfinite'] lists it "
         "(as the library writes it)"),
        (lambda d: _pair(d, 1, 2).update(interchange=None), "pairs[1] (1, 2) interchange is missing: every scored probe has a value"),
        (lambda d: _pair(d, 1, 2).update(replacement=0.01),
         "pairs[1] (1, 2) replacement = 0.01: it is max(replacement_ij, replacement_ji) = 0.3"),
        (lambda d: _pair(d, 1, 2).update(interchange_se=-0.1),
         "pairs[1] (1, 2) interchange_se = -0.1: a standard error is a finite number >= 0"),
        (lambda d: d.update(protocols=["interchange"]),
         "pairs[0] (0, 1) replacement_ij = 5.0: the report did not score this probe (protocols ['interchange']), so it "
         "has no value"),
        (lambda d: d["metadata"]["nonfinite"]["values"].append([1, 2, "interchange"]),
         "metadata['nonfinite']['values'] lists [(1, 2, 'interchange')] but those values are finite"),
        (lambda d: d["removal_kl"].update({"2": -0.5}), "removal_kl['2'] = -0.5: a KL is >= 0"),
        (lambda d: d["removal_kl"].update({"3,2": 0.5}),
         "removal_kl key '3,2': a set of 1..5 distinct blocks 0..5, ascending, as 'i,j,...'"),
        (lambda d: d["removal_kl"].update({"2": "NaN"}),
         "removal_kl['2'] = NaN: a non-finite value loads only where metadata['nonfinite'] lists it"),
    ]
    for edit, message in cases:
        assert _refused(_hand_edited(tmp_path, edit)) == message


def test_non_finite_values_the_library_wrote_load_back():
    report = nonfinite_report()
    report.removal_kl["1,2"] = math.nan
    data = report.to_dict()
    assert data["metadata"]["nonfinite"] == {"values": [[3, 4, "interchange"], [4, 5, "replacement_ij"]],
                                             "removal_kl": ["1,2"]}
    back = SwapReport.from_dict(data)
    assert back == report and back.metadata == report.metadata  # the list is not kept in memory
    assert math.isinf(back.pair(3, 4).interchange) and math.isnan(back.removal_kl["1,2"])
    assert "nonfinite" not in SwapReport(2, [PairResult(0, 1, 0.1, 0.2, 0.3)]).to_dict()["metadata"]


def test_prune_report_refuses_a_hand_edited_report_before_the_model_loads(tmp_path, capsys):
    from hf_layerswap.cli import main

    report = SwapReport(6, [PairResult(i, i + 1, 0.1 * (i + 1), 0.2 * (i + 1), 0.05 * (i + 1)) for i in range(5)])
    path = _hand_edited(tmp_path, lambda d: _pair(d, 1, 2).update(interchange=-5.0), report)
    # an empty folder where the model would be: the report is refused before it would load
    (tmp_path / "no-model-here").mkdir()
    rc = main(["prune", str(tmp_path / "no-model-here"), str(tmp_path / "out"), "--num-to-remove", "1", "--strategy",
               "greedy", "--report", str(path)])
    assert rc == 2
    assert (f"error: {path} is not a valid SwapReport JSON file: pairs[1] (1, 2) interchange = -5.0: a KL is >= 0"
            in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


# --------------------------------------------- truncated or hand-edited files


def test_truncated_or_hand_edited_report_files_name_the_file(matrix_report, tmp_path):
    good = matrix_report.to_json(tmp_path / "good.json").read_text()
    cases = {
        "truncated": good[: good.index('": "', len(good) // 2) + 4],  # cut just inside a string value
        "empty": "",
        "a list": "[]",
    }
    expected = {
        "truncated": "is not a valid SwapReport JSON file: Unterminated string starting at",
        "empty": "is not a valid SwapReport JSON file: Expecting value: line 1 column 1 (char 0)",
        "a list": "is not a valid SwapReport JSON file: not a SwapReport dict: got list",
    }
    for name, text in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(ValueError) as err:
            SwapReport.from_json(path)
        assert str(err.value).startswith(f"{path} {expected[name]}")
    edits = [
        (lambda d: d.pop("pairs"), "SwapReport dict is missing ['pairs']"),
        (lambda d: d["pairs"][0].update(interchange="nan"),
         "value 'nan' is not a number: allowed a JSON number, null, 'NaN', 'Infinity' or '-Infinity'"),
        (lambda d: d["pairs"].append(d["pairs"][0]), "pairs [(0, 1)] occur more than once: each pair (i, j) has one result"),
        (lambda d: d["pairs"][0].pop("i"),
         "TypeError: PairResult.__init__() missing 1 required positional argument: 'i'"),
    ]
    for edit, message in edits:
        path = _hand_edited(tmp_path, edit, matrix_report)
        with pytest.raises(ValueError) as err:
            SwapReport.from_json(path)
        assert str(err.value) == f"{path} is not a valid SwapReport JSON file: {message}"


def test_two_runs_that_differ_only_in_the_machine_compare_equal_without_timings():
    """The free memory an automatic ``max_memory`` was read from, wall seconds and peak memory
    describe the machine; ``to_dict(timings=False)`` compares the runs themselves."""
    first = nonfinite_report()
    second = nonfinite_report()
    first.metadata.update(seconds=1.5, peak_memory={"cpu": 10}, max_memory=2**30,
                          max_memory_source="auto: 25% of 21.6 GiB free on cpu")
    second.metadata.update(seconds=2.5, peak_memory={"cpu": 20}, max_memory=2**30,
                           max_memory_source="auto: 25% of 21.5 GiB free on cpu")
    assert first.to_dict() != second.to_dict()
    assert first.to_dict(timings=False) == second.to_dict(timings=False)
    assert first.to_dict(timings=False)["metadata"]["max_memory"] == 2**30  # the setting itself stays
    second.metadata["max_memory"] = 2**29
    assert first.to_dict(timings=False) != second.to_dict(timings=False)
