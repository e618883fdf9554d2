"""benchmarks/runner.py: experiment grids expand in the file's order, finished cells are
stored at once and skipped by a rerun, merges combine disjoint runs and refuse a cell
stored with different values, a shared store keeps another process's cells; a store kept as a
list of records (precision's models) resumes and merges by each record's key."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO_ROOT, benchmark_script

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

    def fake_run_config(model, cap, depth_first, head_slices, args):
        calls.append((model, cap, depth_first, head_slices))
        return {"model": model, "cap": cap, "depth_first": depth_first, "head_slices": head_slices,
                "cpu_s": 1.0, "peak_rss": 2**20}

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
    rows = [(c, False) for c in caps] + [(None, True)]  # the caps, then the in-memory run in the head's slices
    assert calls == ([("smollm2-135m", c, False, h) for c, h in rows]
                     + [("gemma3-270m", c, False, h) for c, h in rows if c != 0.5])
    state = json.loads(page.with_suffix(".json").read_text())
    assert state["models"] == ["gemma3-270m", "smollm2-135m"]  # the stored model first, then the new one
    assert page.read_text().split(",") == [key for m in ("gemma3-270m", "smollm2-135m")
                                           for key in [f"{m}/{c}/streamed" for c in ("in-memory", "0.5", "0.25", "0.125")]
                                           + [f"{m}/in-memory/vocabulary-slices"]]
    assert state["rows"][1] == stored  # kept, not rerun
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"num_prompts": 4, "rows": []}))
    with pytest.raises(MergeConflict, match="num_prompts"):  # another calibration is not merged
        streaming.main(["--render-only", "--out", str(page), "--merge-from", str(other)])
    calls.clear()
    streaming.main(argv[:5] + ["--seq-len", "16", "--out", str(page)])  # another calibration: anew
    assert len(calls) == 10 and len(json.loads(page.with_suffix(".json").read_text())["rows"]) == 10


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
    with pytest.raises(ValueError, match=r"cell key 'search': a store of depth 2 names a cell by 2 non-empty keys"):
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


@pytest.mark.parametrize("text, message", [
    ('{"cells": {"a": {"v": 1}, "b": {"v"', r"is not complete JSON \(Expecting ':' delimiter at character 35 of 35\): cut short"),
    ("", r"is not complete JSON \(Expecting value at character 0 of 0\)"),
    ('[{"v": 1}]', r"holds a JSON list, not a results state"),
])
def test_a_cut_short_results_file_is_refused_and_left_as_it_is(tmp_path, text, message):
    """A state file cut short (a copy, a write of another tool) or not a state: every store and
    merge refuses it, naming the file, and no write replaces it (its cells would be lost)."""
    path, other = tmp_path / "r.json", tmp_path / "other.json"
    path.write_text(text)
    other.write_text(json.dumps({"cells": {"c": {"v": 3}}}))
    calls = []
    for make in (lambda: CellStore(path, fresh=lambda: {"cells": {}}),
                 lambda: ListCellStore(path, fresh=dict, key=lambda r: r["k"])):
        with pytest.raises(ValueError, match=f"results file {path} " + message):
            run_cells(make(), [("a", 1)], calls.append, tag="t")
    shared = CellStore(other, fresh=dict, shared=True)
    other.write_text(text)  # cut short under a running shared store: its next look is refused
    with pytest.raises(ValueError, match=message):
        shared.has("c")
    with pytest.raises(ValueError, match=f"--merge-from results file {path} " + message):
        merge_files(tmp_path / "merged.json", [path])
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"cells": {"d": {"v": 4}}}))
    with pytest.raises(ValueError, match=f"results file {path} " + message):  # the destination itself
        merge_files(path, [good])
    assert calls == [] and path.read_text() == text and not (tmp_path / "merged.json").exists()


def test_a_nested_cell_key_holding_a_slash_is_refused_before_the_cell_runs(tmp_path):
    """depth=2: "a/b/3" would land as criterion "a", budget "b/3" (or criterion "a/b" seen as
    another): refused before the cell runs, as a key with an empty part is."""
    store = CellStore(tmp_path / "q.json", fresh=dict, cells="criteria", depth=2)
    calls = []
    for key in ("a/b/3", "a/", "/3"):
        with pytest.raises(ValueError, match=f"cell key '{key}': a store of depth 2 names a cell by 2 non-empty"):
            run_cells(store, [(key, 1)], calls.append, tag="t")
    assert calls == [] and not (tmp_path / "q.json").exists()
    run_cells(store, [("a/3", 1)], lambda cell: {"v": cell}, tag="t")
    assert json.loads((tmp_path / "q.json").read_text()) == {"criteria": {"a": {"3": {"v": 1}}}}
    flat = CellStore(tmp_path / "f.json", fresh=dict)  # depth 1: a key is one name, '/' included
    run_cells(flat, [("a/b/3", 1)], lambda cell: {"v": cell}, tag="t")
    assert json.loads((tmp_path / "f.json").read_text()) == {"cells": {"a/b/3": {"v": 1}}}


def test_precision_merge_refuses_a_piece_measured_with_other_settings(tmp_path):
    import precision

    settings = {"num_prompts": 2, "seq_len": 8, "batch_size": 1, "max_n": 2, "threads": 1, "search": False}
    path, piece = tmp_path / "p.json", tmp_path / "piece.json"
    path.write_text(json.dumps({"command": "a", "settings": settings, "models": [{"model": "m1", "v": 1}]}))
    piece.write_text(json.dumps({"command": "b", "settings": {**settings, "num_prompts": 4},
                                 "models": [{"model": "m2", "v": 2}]}))
    argv = ["--json", str(path), "--out", str(tmp_path / "p.md"), "--merge-from", str(piece), "--render-only"]
    with pytest.raises(MergeConflict, match=r"\$\.settings\.num_prompts: 2 != 4"):
        precision.main(argv)
    assert json.loads(path.read_text())["models"] == [{"model": "m1", "v": 1}]
    piece.write_text(json.dumps({"command": "b", "settings": settings, "models": [{"model": "m2", "v": 2}]}))
    merged = precision.merge_files(path, [piece], union=(), keyed={"models": precision.model_key},
                                   first=("command", "machine", "versions", "started"))
    assert [m["model"] for m in merged["models"]] == ["m1", "m2"] and merged["command"] == "a"
    piece.write_text('{"settings": {"max_n"')  # cut short: named, not a JSONDecodeError
    with pytest.raises(ValueError, match=f"--merge-from results file {piece} is not complete JSON"):
        precision.main(argv)


@pytest.mark.parametrize("script, argv", [
    ("speed", ["--render-only", "--out", "{d}/speed.md"]),
    ("sparsity", ["--render-only", "--json", "{d}/s.json", "--output", "{d}/s.md"]),
    ("precision", ["--render-only", "--json", "{d}/p.json", "--out", "{d}/p.md"]),
    ("streaming", ["--render-only", "--out", "{d}/st.md"]),
])
def test_render_only_without_a_results_file_names_it_and_writes_nothing(tmp_path, script, argv):
    module = benchmark_script(script)
    with pytest.raises(FileNotFoundError, match=r"--render-only: results file .*\.json: no such file"):
        module.main([a.format(d=tmp_path) for a in argv])
    assert list(tmp_path.iterdir()) == []


def test_quality_render_only_refuses_a_folder_without_results_and_a_state_without_its_table(tmp_path):
    quality = benchmark_script("quality")
    with pytest.raises(SystemExit, match=r"--render-only: no quality-\*\.json in .*: nothing to render"):
        quality.main(["--render-only", "--results", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "quality-smollm2-135m.json").write_text(json.dumps({"criteria": {"tail": {"1": {"removed": [4]}}}}))
    with pytest.raises(SystemExit, match=r"holds cells but no table .*: run the model's command"):
        quality.main(["--render-only", "--results", str(tmp_path)])
    assert [p.name for p in tmp_path.iterdir()] == ["quality-smollm2-135m.json"]
