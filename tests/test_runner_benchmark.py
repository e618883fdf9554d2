"""benchmarks/runner.py: experiment grids expand in the file's order, finished cells are
stored at once and skipped by a rerun, merges combine disjoint runs and refuse a cell
stored with different values, a shared store keeps another process's cells; a store kept as a
list of records (precision's models) resumes and merges by each record's key."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from runner import (  # noqa: E402
    CellStore,
    ListCellStore,
    MergeConflict,
    expand_grid,
    experiment_cells,
    load_experiment,
    merge_files,
    merge_states,
    run_cells,
)


def test_expand_grid_first_axis_slowest_and_scalars_copied():
    cells = expand_grid({"model": ["a", "b"], "n": [2, 4], "tokens": 8})
    assert [(c["model"], c["n"], c["tokens"]) for c in cells] == [("a", 2, 8), ("a", 4, 8), ("b", 2, 8), ("b", 4, 8)]
    assert [list(c) for c in cells] == [["model", "n", "tokens"]] * 4


def test_unknown_experiment_names_the_known_ones():
    with pytest.raises(FileNotFoundError, match=r"'nope'.*allowed: \[.*'heal'"):
        load_experiment("nope")


def test_run_cells_stores_each_cell_and_a_rerun_skips_it(tmp_path):
    path, calls = tmp_path / "r.json", []

    def run_one(cell):
        calls.append(cell)
        if cell == 3:
            raise RuntimeError("stopped")
        return {"value": cell * 10}

    store = CellStore(path, fresh=lambda: {"format": 1, "cells": {}})
    with pytest.raises(RuntimeError):
        run_cells(store, [(f"c{i}", i) for i in range(5)], run_one, tag="t")
    assert json.loads(path.read_text()) == {"format": 1, "cells": {"c0": {"value": 0}, "c1": {"value": 10},
                                                                  "c2": {"value": 20}}}
    calls.clear()
    state = run_cells(CellStore(path, fresh=dict), [(f"c{i}", i) for i in range(5) if i != 3], run_one, tag="t")
    assert calls == [4]
    assert state["cells"]["c4"] == {"value": 40} and len(state["cells"]) == 4


def test_shared_store_keeps_cells_another_process_wrote(tmp_path):
    path = tmp_path / "r.json"
    first = CellStore(path, fresh=lambda: {"cells": {}}, shared=True)
    second = CellStore(path, fresh=lambda: {"cells": {}}, shared=True)
    first.put("a", {"v": 1})
    assert second.has("a")
    second.put("b", {"v": 2})
    assert json.loads(path.read_text())["cells"] == {"a": {"v": 1}, "b": {"v": 2}}


def test_merge_combines_disjoint_runs_and_refuses_conflicting_cells(tmp_path):
    a = {"format": 1, "commands": ["x"], "environment": {"m": 1}, "cells": {"k1": {"v": 1}}, "models": {"s": {"base": 2.0}}}
    b = {"format": 1, "commands": ["y", "x"], "environment": {"m": 2}, "cells": {"k2": {"v": 2}},
         "models": {"s": {"base": 2.0}, "g": {"base": 3.0}}}
    merged = merge_states([a, b], union=("commands",), first=("environment",))
    assert merged == {"format": 1, "commands": ["x", "y"], "environment": {"m": 1},
                      "cells": {"k1": {"v": 1}, "k2": {"v": 2}}, "models": {"s": {"base": 2.0}, "g": {"base": 3.0}}}
    with pytest.raises(MergeConflict, match=r"\$\.cells\.k1\.v: 1 != 5"):
        merge_states([a, {"cells": {"k1": {"v": 5}}}])
    # the same cell measured twice: equal results merge, a timing differs and the first is kept
    again = merge_states([a, {"cells": {"k1": {"v": 1, "eval_s": 9.0}}}, {"cells": {"k1": {"v": 1, "eval_s": 7.0}}}],
                         volatile=("eval_s",))
    assert again["cells"]["k1"] == {"v": 1, "eval_s": 9.0}
    dest, src = tmp_path / "dest.json", tmp_path / "src.json"
    dest.write_text(json.dumps(a))
    src.write_text(json.dumps({"cells": {"k1": {"v": 5}}}))
    with pytest.raises(MergeConflict):
        merge_files(dest, [src])
    assert json.loads(dest.read_text()) == a  # left as it was
    with pytest.raises(FileNotFoundError, match="missing.json"):
        merge_files(dest, [tmp_path / "missing.json"])


def _model(record: dict) -> str:
    return record["model"]


def test_list_store_resumes_by_record_key_and_keeps_the_list_layout(tmp_path):
    path, calls = tmp_path / "p.json", []
    path.write_text(json.dumps({"settings": {"n": 1}, "models": [{"model": "b", "v": 2}]}))

    def run_one(name):
        calls.append(name)
        return {"model": name, "v": ord(name)}

    store = ListCellStore(path, fresh=dict, key=_model, cells="models")
    state = run_cells(store, [(m, m) for m in ("a", "b", "c")], run_one, tag="t")
    assert calls == ["a", "c"]
    assert state == {"settings": {"n": 1}, "models": [{"model": "b", "v": 2}, {"model": "a", "v": 97},
                                                      {"model": "c", "v": 99}]}
    assert json.loads(path.read_text()) == state
    store.put("b", {"model": "b", "v": 3})  # a record stored again replaces its own, in place
    assert [m["v"] for m in json.loads(path.read_text())["models"]] == [3, 97, 99]
    with pytest.raises(ValueError, match=r"record named 'a' put under the key 'b'"):
        store.put("b", {"model": "a"})


def test_keyed_merge_combines_records_and_refuses_a_conflicting_one(tmp_path):
    a = {"command": "x", "models": [{"model": "s", "base": 2.0}]}
    b = {"command": "y", "models": [{"model": "g", "base": 3.0}, {"model": "s", "base": 2.0, "extra": 1}]}
    merged = merge_states([a, b], union=(), first=("command",), keyed={"models": _model})
    assert merged == {"command": "x", "models": [{"model": "s", "base": 2.0, "extra": 1}, {"model": "g", "base": 3.0}]}
    with pytest.raises(MergeConflict, match=r"\$\.models\[s\]\.base: 2\.0 != 5\.0"):
        merge_states([a, {"models": [{"model": "s", "base": 5.0}]}], keyed={"models": _model})
    dest, src = tmp_path / "dest.json", tmp_path / "src.json"
    dest.write_text(json.dumps(a))
    src.write_text(json.dumps(b))
    assert merge_files(dest, [src], union=(), first=("command",), keyed={"models": _model}) == merged
    assert json.loads(dest.read_text()) == merged


def test_precision_experiment_gives_the_committed_run_settings():
    experiment = load_experiment("precision")
    stored = json.loads((REPO_ROOT / "benchmarks" / "results" / "precision.json").read_text())
    assert experiment["settings"] == stored["settings"]
    assert [c["model"] for c in experiment_cells(experiment)["models"]] == [m["model"] for m in stored["models"]]


def test_precision_runs_only_models_not_stored_and_keeps_the_others(tmp_path, monkeypatch):
    import precision

    calls = []

    def fake_run_model(name, args, save):
        calls.append(name)
        entry = {"model": name, "spearman": {"replacement": 1.0}}
        save(entry)
        return entry

    monkeypatch.setattr(precision, "run_model", fake_run_model)
    monkeypatch.setattr(precision, "render", lambda state: ",".join(m["model"] for m in state["models"]))
    path, page = tmp_path / "p.json", tmp_path / "p.md"
    settings = {"num_prompts": 2, "seq_len": 8, "batch_size": 1, "max_n": 2, "threads": 1, "search": False}
    path.write_text(json.dumps({"command": "old", "settings": settings,
                                "models": [{"model": "gemma3-270m", "spearman": {"replacement": 0.5}},
                                           {"model": "other", "spearman": {}}]}))
    argv = ["--models", "smollm2-135m", "gemma3-270m", "--num-prompts", "2", "--seq-len", "8", "--batch-size", "1",
            "--max-n", "2", "--no-search", "--json", str(path), "--out", str(page)]
    precision.main(argv)
    assert calls == ["smollm2-135m"]  # gemma3 was stored with these settings
    state = json.loads(path.read_text())
    assert [m["model"] for m in state["models"]] == ["smollm2-135m", "gemma3-270m", "other"]
    assert state["models"][1]["spearman"] == {"replacement": 0.5} and state["settings"] == settings
    assert page.read_text() == "smollm2-135m,gemma3-270m,other"
    calls.clear()
    precision.main(argv[:-5] + ["--search", "--json", str(path), "--out", str(page)])  # other settings: anew
    assert calls == ["smollm2-135m", "gemma3-270m"]
    assert [m["model"] for m in json.loads(path.read_text())["models"]] == ["smollm2-135m", "gemma3-270m"]


def test_nested_list_store_counts_a_partial_record_as_not_done_and_merges_at_depth(tmp_path):
    path = tmp_path / "r.json"

    def key(entry):
        return ",".join(map(str, entry["removed"]))

    store = ListCellStore(path, fresh=lambda: {"result": {"evaluated": []}}, key=key, cells=("result", "evaluated"),
                          done=lambda e: set(e["results"]) == {"none", "fused"})
    store.put("1,3", {"removed": [1, 3], "results": {"none": 1.0}})
    assert not store.has("1,3") and store.get("1,3") == {"removed": [1, 3], "results": {"none": 1.0}}
    store.put("1,3", {"removed": [1, 3], "results": {"none": 1.0, "fused": 0.5}})
    assert store.has("1,3") and json.loads(path.read_text()) == {
        "result": {"evaluated": [{"removed": [1, 3], "results": {"none": 1.0, "fused": 0.5}}]}}
    other = {"result": {"evaluated": [{"removed": [2], "results": {"none": 4.0}},
                                      {"removed": [1, 3], "results": {"none": 1.0, "ghosted": 0.7}}], "seconds": 9.0}}
    merged = merge_states([store.state, other], keyed={"evaluated": key}, volatile=("seconds",))
    assert merged["result"]["evaluated"] == [{"removed": [1, 3], "results": {"none": 1.0, "fused": 0.5, "ghosted": 0.7}},
                                             {"removed": [2], "results": {"none": 4.0}}]
    with pytest.raises(MergeConflict, match=r"\$\.result\.evaluated\[1,3\]\.results\.none: 1\.0 != 2\.0"):
        merge_states([store.state, {"result": {"evaluated": [{"removed": [1, 3], "results": {"none": 2.0}}]}}],
                     keyed={"evaluated": key})


def test_streaming_runs_only_rows_not_stored_in_the_page_order(tmp_path, monkeypatch):
    import streaming

    calls = []

    def fake_run_config(model, cap, depth_first, args):
        calls.append((model, cap, depth_first))
        return {"model": model, "cap": cap, "depth_first": depth_first, "cpu_s": 1.0, "peak_rss": 2**20}

    monkeypatch.setattr(streaming, "run_config", fake_run_config)
    monkeypatch.setattr(streaming, "write_markdown", lambda out, state: out.write_text(
        ",".join(streaming.row_key(r) for r in state["rows"])))
    page = tmp_path / "s.md"
    stored = {"model": "gemma3-270m", "cap": 0.5, "depth_first": False, "cpu_s": 7.0, "peak_rss": 1}
    page.with_suffix(".json").write_text(json.dumps({"command": "old", "num_prompts": 2, "seq_len": 8,
                                                     "models": ["gemma3-270m"], "rows": [stored]}))
    argv = ["--models", "smollm2-135m", "gemma3-270m", "--num-prompts", "2", "--seq-len", "8", "--out", str(page)]
    streaming.main(argv)
    caps = [None, 0.5, 0.25, 0.125]
    assert calls == [("smollm2-135m", c, False) for c in caps] + [("gemma3-270m", c, False) for c in caps if c != 0.5]
    state = json.loads(page.with_suffix(".json").read_text())
    assert state["models"] == ["gemma3-270m", "smollm2-135m"]  # the stored model first, then the new one
    assert page.read_text().split(",") == [f"{m}/{c}/streamed" for m in ("gemma3-270m", "smollm2-135m")
                                           for c in ("in-memory", "0.5", "0.25", "0.125")]
    assert state["rows"][1] == stored  # kept, not rerun
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"num_prompts": 4, "rows": []}))
    with pytest.raises(MergeConflict, match="num_prompts"):  # another calibration is not merged
        streaming.main(["--render-only", "--out", str(page), "--merge-from", str(other)])
    calls.clear()
    streaming.main(argv[:5] + ["--seq-len", "16", "--out", str(page)])  # another calibration: anew
    assert len(calls) == 8 and len(json.loads(page.with_suffix(".json").read_text())["rows"]) == 8


def test_nested_store_names_a_cell_by_its_keys_at_each_level(tmp_path):
    """depth=2: the layout of a table by criterion and budget (quality.py's compare_criteria state);
    a cell written into the file by other code is seen, and put keeps what that code wrote."""
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"fingerprint": {"m": 1}, "criteria": {"tail": {"1": {"removed": [4]}}}}))
    store = CellStore(path, fresh=dict, cells="criteria", depth=2, shared=True)
    assert store.has("tail/1") and not store.has("tail/2") and store.cells == {"tail/1": {"removed": [4]}}
    state = json.loads(path.read_text())
    state["ppl"] = {"4": 30.0}  # the cell's own code writes the file ...
    path.write_text(json.dumps(state))
    store.put("search/2", {"removed": [2, 3]})  # ... and the store writes over the latest file
    assert json.loads(path.read_text()) == {"fingerprint": {"m": 1}, "ppl": {"4": 30.0},
                                            "criteria": {"tail": {"1": {"removed": [4]}},
                                                         "search": {"2": {"removed": [2, 3]}}}}
    with pytest.raises(ValueError, match=r"cell key 'search': a store of depth 2 names a cell by 2 keys"):
        store.put("search", {})
    with pytest.raises(ValueError, match=r"depth=0"):
        CellStore(path, fresh=dict, depth=0)


def test_keyed_merge_with_progress_keeps_the_record_further_along():
    a = {"models": [{"model": "s", "done": 2, "v": [1, 2]}, {"model": "g", "done": 1, "v": [5]}]}
    b = {"models": [{"model": "s", "done": 3, "v": [1, 2, 3]}, {"model": "g", "done": 1, "v": [5]}]}
    options = {"union": (), "keyed": {"models": _model}, "progress": {"models": lambda r: r["done"]}}
    assert merge_states([a, b], **options) == {"models": [b["models"][0], a["models"][1]]}
    assert merge_states([b, a], **options) == b
    with pytest.raises(MergeConflict, match=r"\$\.models\[g\]\.v"):  # the same point, other values
        merge_states([a, {"models": [{"model": "g", "done": 1, "v": [6]}]}], **options)
