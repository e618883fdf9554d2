"""benchmarks/runner.py: experiment grids expand in the file's order, finished cells are
stored at once and skipped by a rerun, merges combine disjoint runs and refuse a cell
stored with different values, a shared store keeps another process's cells; heal.py runs
its cells through it (resume and --methods filter, without a model)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from runner import (  # noqa: E402
    CellStore,
    MergeConflict,
    expand_grid,
    experiment_cells,
    load_experiment,
    merge_files,
    merge_states,
    run_cells,
)
from wikitext import VARIANTS, wikitext_prompts  # noqa: E402


def test_expand_grid_first_axis_slowest_and_scalars_copied():
    cells = expand_grid({"model": ["a", "b"], "n": [2, 4], "tokens": 8})
    assert [(c["model"], c["n"], c["tokens"]) for c in cells] == [("a", 2, 8), ("a", 4, 8), ("b", 2, 8), ("b", 4, 8)]
    assert [list(c) for c in cells] == [["model", "n", "tokens"]] * 4


def test_heal_experiment_lists_the_groups_in_priority_order():
    cells = experiment_cells(load_experiment("heal"))
    assert list(cells) == ["pilot", "n6", "criteria", "budgets", "long"]
    assert [c["lr"] for c in cells["pilot"]] == [1e-4, 3e-4, 1e-3, 3e-5, 1e-4]
    assert [(c["model"], c["n"], c["method"]) for c in cells["budgets"]][:3] == [
        ("smollm2-135m", 2, "lora"), ("smollm2-135m", 2, "ghosted+lora"), ("smollm2-135m", 4, "lora")]


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


def _heal():
    spec = importlib.util.spec_from_file_location("heal_benchmark_runner", REPO_ROOT / "benchmarks" / "heal.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_heal_runs_only_missing_cells_of_the_chosen_methods(tmp_path, monkeypatch):
    bench = _heal()
    ran = []

    def fake_cell(self, cell):
        ran.append(bench.cell_key(cell))
        return {**cell, "removed": [1], "healed": {"dppl": 1.0}, "heal_cpu_s": 1.0,
                "report": {"kl_before": 0.5, "kl_after": 0.4, "steps": 3}}

    monkeypatch.setattr(bench.Runner, "run_cell", fake_cell)
    path = tmp_path / "heal.json"
    stored = bench.PLAN["n6"][0]
    path.write_text(json.dumps({**bench.new_state(), "cells": {bench.cell_key(stored): {"kept": True}}}))
    state = bench.run(["n6"], path, "python benchmarks/heal.py --groups n6 --threads 1", methods=["ghosted+lora", "lora"])
    assert ran == ["smollm2-135m|search|n6|lora|32768|lr0.001"]
    on_disk = json.loads(path.read_text())
    assert on_disk["cells"] == state["cells"] and on_disk["cells"][bench.cell_key(stored)] == {"kept": True}
    assert on_disk["commands"] == ["python benchmarks/heal.py --groups n6 --threads 1"]


def test_wikitext_variants_name_what_a_prompt_is(wikitext_valid):
    sections = wikitext_prompts(1000, seed=0, path=wikitext_valid)
    lines = wikitext_prompts(5000, seed=0, variant="lines", path=wikitext_valid)
    assert (len(sections), len(lines)) == (538, 1713)  # every prompt of the validation split
    assert sorted(VARIANTS) == ["lines", "sections"]
    # a section joins the paragraphs (lines) under one heading: every line lies inside one section
    assert all(any(line in section for section in sections) for line in lines[:20])
    assert wikitext_prompts(3, seed=1) != wikitext_prompts(3, seed=0)
    with pytest.raises(ValueError, match=r"variant='paragraphs': allowed \['lines', 'sections'\]"):
        wikitext_prompts(3, variant="paragraphs")


def test_sparsity_experiment_is_exactly_the_stored_grid():
    """experiments/sparsity.toml expands to the configurations the committed pages store, no more, no less."""
    spec = importlib.util.spec_from_file_location("sparsity_benchmark_runner", REPO_ROOT / "benchmarks" / "sparsity.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argvs = bench.experiment_argvs("sparsity")
    assert argvs[-1] == ["--model", "smollm2-135m", "--sparsity", "0.5", "--num-prompts", "32", "--seq-len", "128",
                         "--threads", "1", "--allocations", "pals/source=block_input", "pals/invert=true", "--methods",
                         "wanda", "--seeds", "0"]
    planned = {}
    for argv in argvs:
        args = bench.build_parser().parse_args(argv)
        planned.setdefault(args.model, set()).update(bench.config_key(*c, vars(args)) for c in bench.configurations(args))
    for model, keys in planned.items():
        stored = json.loads((REPO_ROOT / "benchmarks" / "results" / f"sparsity-{model}.json").read_text())["runs"]
        assert keys == set(stored), model
    assert {m: len(k) for m, k in planned.items()} == {"smollm2-135m": 200, "gemma3-270m": 198}
    with pytest.raises(ValueError, match=r"--groups \['nope'\]: experiment 'sparsity' has the groups \['unstructured', 'nm', 'pals_variants'\]"):
        bench.experiment_argvs("sparsity", ["nope"])
