"""benchmarks/runner.py: experiment grids expand in the file's order, finished cells are
stored at once and skipped by a rerun, merges combine disjoint runs and refuse a cell
stored with different values, a shared store keeps another process's cells."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from runner import CellStore, MergeConflict, expand_grid, load_experiment, merge_files, merge_states, run_cells  # noqa: E402


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
