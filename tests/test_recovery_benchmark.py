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


def test_recovery_smoke_stores_each_set_and_resumes_method_by_method(tmp_path, monkeypatch, wikitext_valid):
    text = tmp_path / "test.raw"
    text.write_text(" = Title = \n\n" + "The river runs past the old mill and into the valley . " * 40, encoding="utf-8")
    monkeypatch.setattr(recovery, "EVALUATION", text)
    monkeypatch.setattr(recovery, "load_model", lambda name: (tiny_model("llama", 6, max_position_embeddings=1024),
                                                              tiny_tokenizer()))
    monkeypatch.setattr(recovery, "QUALITY_RESULTS", tmp_path)
    (tmp_path / "quality-tiny.json").write_text(json.dumps({"criteria": {"search": {"1": {"removed": [4]}}}}))
    fits = []
    real_recover = recovery.recover
    monkeypatch.setattr(recovery, "recover", lambda model, removed, calib, method, **kw: (
        fits.append((tuple(removed), method)), real_recover(model, removed, calib, method=method, **kw))[1])
    out = tmp_path / "recovery.md"
    argv = ["--models", "tiny", "--budgets", "1", "--num-prompts", "4", "--score-prompts", "2", "--seq-len", "16",
            "--num-tokens", "64", "--batch-size", "2", "--threads", "1", "--out", str(out)]
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
