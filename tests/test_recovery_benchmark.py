"""benchmarks/recovery.py on the runner, smoke-run on a tiny random Llama (character tokenizer,
a short evaluation text): every removal set is stored with its four methods, the default
search's sets are read from the quality benchmark's results and run first, a rerun runs
nothing, and a rerun after one method's result is dropped runs that method alone."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO_ROOT, tiny_model
from arch_matrix import tiny_tokenizer

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import recovery  # noqa: E402


def _tiny_run(tmp_path, monkeypatch):
    """``(page, argv)`` of a smoke run on a tiny Llama: a short evaluation text, the default
    search's set {4} in a quality results file, everything under ``tmp_path``."""
    text = tmp_path / "test.raw"
    text.write_text(" = Title = \n\n" + "The river runs past the old mill and into the valley . " * 40, encoding="utf-8")
    monkeypatch.setattr(recovery, "EVALUATION", text)
    monkeypatch.setattr(recovery, "QUALITY_RESULTS", tmp_path)
    (tmp_path / "quality-tiny.json").write_text(json.dumps({"criteria": {"search": {"1": {"removed": [4]}}}}))
    monkeypatch.setattr(recovery, "load_model", lambda name: (tiny_model("llama", 6, max_position_embeddings=1024),
                                                              tiny_tokenizer()))
    out = tmp_path / "recovery.md"
    return out, ["--models", "tiny", "--budgets", "1", "--num-prompts", "4", "--score-prompts", "2", "--seq-len", "16",
                 "--num-tokens", "64", "--batch-size", "2", "--threads", "1", "--out", str(out)]


def test_recovery_smoke_stores_each_set_and_resumes_method_by_method(tmp_path, monkeypatch, wikitext_valid):
    out, argv = _tiny_run(tmp_path, monkeypatch)
    fits = []
    real_recover = recovery.recover
    monkeypatch.setattr(recovery, "recover", lambda model, removed, calib, method, **kw: (
        fits.append((tuple(removed), method)), real_recover(model, removed, calib, method=method, **kw))[1])
    recovery.main(argv)
    store = tmp_path / "recovery-tiny.json"
    state = json.loads(store.read_text())
    result = state["result"]
    sets = {recovery.removal_key(row) for row in result["rows"]}
    assert [(r["n"], r["selection"]) for r in result["rows"]] == [
        (1, "interchange"), (1, "block-influence"), (1, "search")]
    assert result["rows"][2]["removed"] == [4] and fits[:4] == [((4,), m) for m in recovery.METHODS]
    assert [recovery.removal_key(e) for e in result["evaluated"]] == list(dict.fromkeys(
        recovery.removal_key(r) for r in result["rows"]))
    assert all(set(e["results"]) == set(recovery.METHODS) for e in result["evaluated"]) and result["complete"]
    assert len(fits) == len(recovery.METHODS) * len(sets) == 4 * len(sets)
    page = out.read_text()
    assert "| 1 | interchange |" in page and "| dPPL% linearpatch |" in page and "| not run |" not in page
    fits.clear()
    recovery.main(argv)  # everything stored: nothing runs
    assert fits == []
    first = result["evaluated"][0]
    del first["results"]["ghosted"]
    result["complete"] = False
    store.write_text(json.dumps(state))
    recovery.main(argv)
    assert fits == [(tuple(first["removed"]), "ghosted")]
    again = json.loads(store.read_text())["result"]
    assert again["complete"] and [r["removed"] for r in again["rows"]] == [r["removed"] for r in result["rows"]]


def test_recovery_search_rows_need_the_quality_results_before_any_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(recovery, "QUALITY_RESULTS", tmp_path)
    monkeypatch.setattr(recovery, "load_model", lambda name: pytest.fail("the model was loaded"))
    argv = ["--models", "tiny", "--budgets", "1", "2", "--out", str(tmp_path / "recovery.md")]
    with pytest.raises(SystemExit, match=r"quality-tiny\.json: no such file: run `python benchmarks/quality.py "
                                         r"--model tiny` first"):
        recovery.main(argv)
    (tmp_path / "quality-tiny.json").write_text(json.dumps({"criteria": {"search": {"1": {"removed": [4]}}}}))
    with pytest.raises(SystemExit, match=r"has no default-search set at budget\(s\) \[2\]"):
        recovery.main(argv)
    assert not (tmp_path / "recovery-tiny.json").exists()


def _row(n, selection, removed, **dppl):
    return {"n": n, "selection": selection, "removed": removed,
            "results": {m: ({"refused": "no"} if v is None else {"dppl_percent": v}) for m, v in dppl.items()}}


def test_recovery_recommends_the_repair_best_on_the_search_rows():
    smol = {"model": "a", "rows": [
        _row(1, "interchange", [3], none=9.0, fused=1.0, ghosted=5.0, linearpatch=8.0),  # not a search row
        _row(1, "search", [2], none=9.0, fused=4.0, ghosted=3.0, linearpatch=8.0),
        _row(2, "search", [2, 3], none=20.0, fused=9.0, ghosted=10.0, linearpatch=12.0),
        _row(3, "search", [1, 2, 3], none=30.0, fused=20.0, ghosted=11.0),  # linearpatch not run: left out
    ]}
    gemma = {"model": "b", "rows": [_row(1, "search", [4], none=50.0, fused=None, ghosted=6.0, linearpatch=40.0)]}
    assert [(row["n"], best, values) for row, best, values in recovery.best_repairs(gemma)] == [
        (1, "ghosted", {"ghosted": 6.0, "linearpatch": 40.0})]
    lines = recovery.recommendation([smol, gemma])
    assert lines[0] == ("**Recommended repair: ghosted**, by measurement: the lowest dPPL% on 2 of the 3 rows on the "
                        "default search's sets (n = 1..2; fused on 1).")
    assert lines[1] == "- a: n=1 [2]: fused +4.0, **ghosted** +3.0, linearpatch +8.0; n=2 [2, 3]: **fused** +9.0, " \
                       "ghosted +10.0, linearpatch +12.0."
    assert lines[2] == "- b: n=1 [4]: **ghosted** +6.0, linearpatch +40.0."
    assert lines[4].startswith("LinearPatch loses to ghosted on 3 of the 3 search rows where both ran (median "
                               "dPPL% +12.0 against +6.0).")
    assert recovery.recommendation([{"model": "c", "rows": smol["rows"][:1]}]) == [
        "No search row has every repair measured yet: no recommendation."]
    blown = {"model": "c", "rows": [_row(6, "search", [1, 2], none=700.0, fused=None, ghosted=110.0, linearpatch=3.3e24)]}
    assert recovery.recommendation([blown])[1] == "- c: n=6 [1, 2]: **ghosted** +110.0, linearpatch +3.30e+24."


def test_recovery_a_set_missing_a_method_keeps_its_row_while_that_method_runs(tmp_path, monkeypatch, wikitext_valid):
    out, argv = _tiny_run(tmp_path, monkeypatch)
    recovery.main(argv)
    store = tmp_path / "recovery-tiny.json"
    state = json.loads(store.read_text())
    for entry in state["result"]["evaluated"]:  # a method added after these sets ran
        del entry["results"]["linearpatch"]
    state["result"]["rows"] = []
    store.write_text(json.dumps(state))

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(recovery, "run_method", stop)
    with pytest.raises(KeyboardInterrupt):
        recovery.main(argv)
    rows = json.loads(store.read_text())["result"]["rows"]
    assert [(r["n"], r["selection"]) for r in rows] == [(1, "interchange"), (1, "block-influence"), (1, "search")]
    assert all(set(r["results"]) == {"none", "fused", "ghosted"} for r in rows)
    recovery.main([*argv, "--render-only"])
    assert out.read_text().count("| not run |") == 2 * len(rows)  # its dPPL and residual cells


def test_recovery_reverse_runs_the_search_sets_from_the_top_budget_first(tmp_path, monkeypatch, wikitext_valid):
    out, argv = _tiny_run(tmp_path, monkeypatch)
    (tmp_path / "quality-tiny.json").write_text(json.dumps({"criteria": {"search": {
        "1": {"removed": [4]}, "2": {"removed": [3, 4]}}}}))
    fits = []
    measured = {"dppl_percent": 1.0, "dppl_ci": [0.5, 1.5], "recovery": {"boundaries": []}}  # not measured here
    monkeypatch.setattr(recovery, "run_method", lambda name, model, tok, base, calib, row, method, args, t0: (
        fits.append((row["selection"], tuple(row["removed"]))), measured)[1])
    argv[argv.index("--budgets") + 1:argv.index("--budgets") + 2] = ["1", "2"]
    recovery.main([*argv, "--reverse"])
    order = list(dict.fromkeys(fits))
    assert order[:2] == [("search", (3, 4)), ("search", (4,))] and len(fits) == len(order) * len(recovery.METHODS)
    assert json.loads((tmp_path / "recovery-tiny.json").read_text())["settings"]["budgets"] == [1, 2]


def test_a_stored_result_of_a_method_refused_since_becomes_that_refusal_with_the_measurement_kept():
    # Gemma-3's post-norm blocks: linearpatch and fused are refused there, ghosted is not
    model = tiny_model("gemma3", 4)
    measured = {"dppl_percent": 900.0, "dppl_ci": [800.0, 1000.0]}
    entry = {"removed": [2], "results": {"none": {"dppl_percent": 50.0, "dppl_ci": [45.0, 55.0]},
                                         "ghosted": {"dppl_percent": 10.0, "dppl_ci": [8.0, 12.0]},
                                         "linearpatch": dict(measured), "fused": {"refused": "before"}}}
    assert recovery.refuse_stored(model, entry) is True
    lp = entry["results"]["linearpatch"]
    assert lp["measured_before_refusal"] == measured and "linearpatch recovery cannot repair a cut after" in lp["refused"]
    assert entry["results"]["ghosted"]["dppl_percent"] == 10.0 and entry["results"]["fused"] == {"refused": "before"}
    assert recovery.refuse_stored(model, entry) is False  # nothing left to refuse
    row = {"n": 1, "selection": "search", **entry}
    notes = recovery._observations({"rows": [row]})
    assert notes[-1].startswith("linearpatch is not applicable to this model: linearpatch recovery cannot repair")
    assert notes[-1].endswith("Measured before the library refused it, linearpatch left dPPL% above plain removal on "
                              "1 of the 1 sets it ran on (median +900.0 against +50.0 with no repair)")
    assert notes[0] == "fused is not applicable to this model: before"
