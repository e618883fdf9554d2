"""benchmarks/quality.py on the runner: a smoke run on a tiny model stores each cell (criterion,
budget) in the library's compare_criteria state, a rerun computes nothing, a larger run skips the
stored cells, pieces of other processes merge in (a cell stored differently is refused), and the
experiment's ``pages`` group gives exactly the cells and repair the committed pages ran."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from arch_matrix import tiny_tokenizer
from conftest import REPO_ROOT, benchmark_script, tiny_batch, tiny_model
from hf_layerswap.calibration import build_calibration, embedded_text
from hf_layerswap.layerplan import decoder_blocks

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from runner import MergeConflict, experiment_cells, load_experiment  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


def _module():
    return benchmark_script("quality")


@pytest.fixture
def bench(tmp_path, monkeypatch):
    """The script with a tiny 8-block Llama (block 3 an identity) for the model, 4 random
    prompts for the calibration and 150 words of the embedded text for the evaluation; every
    compare_criteria call recorded as (criteria, budgets)."""
    module = _module()
    model = tiny_model("llama", 8, max_position_embeddings=1024)
    with torch.no_grad():  # block 3 returns its input: Block Influence removes it first
        block = decoder_blocks(model)[2][3]
        block.self_attn.o_proj.weight.zero_()
        block.mlp.down_proj.weight.zero_()
    text = tmp_path / "evaluation.txt"
    text.write_text(embedded_text("evaluation")[:3000], encoding="utf-8")
    monkeypatch.setattr(module, "load_model", lambda name: (model, tiny_tokenizer()))
    monkeypatch.setattr(module, "wikitext_calibration", lambda tok, n, length: build_calibration(tiny_batch(4, 12), num_prompts=4))
    monkeypatch.setattr(module, "EVALUATION", text)
    calls, harness = [], module.compare_criteria

    def recorded(model, calib, budgets, **kwargs):
        calls.append((tuple(kwargs["criteria"]), tuple(budgets)))
        return harness(model, calib, budgets, **kwargs)

    monkeypatch.setattr(module, "compare_criteria", recorded)
    module.calls = calls
    return module


def _run(bench, results, *extra):
    args = ["--model", "smollm2-135m", "--max-words", "150", "--max-gap", "2", "--results", str(results), *extra]
    assert bench.main(args) == 0
    return json.loads((results / "quality-smollm2-135m.json").read_text(encoding="utf-8"))


def test_smoke_run_stores_cells_and_a_rerun_computes_nothing(bench, tmp_path, monkeypatch):
    results = tmp_path / "r"
    state = _run(bench, results, "--criteria", "block_influence", "interchange", "--budgets", "1", "2")
    # one call per cell (criterion slowest), then the table over every cell
    assert bench.calls == [(("block_influence",), (1,)), (("block_influence",), (2,)), (("interchange",), (1,)),
                           (("interchange",), (2,)), (("block_influence", "interchange"), (1, 2))]
    assert {c: sorted(per_n) for c, per_n in state["criteria"].items()} == {"block_influence": ["1", "2"],
                                                                          "interchange": ["1", "2"]}
    assert state["criteria"]["block_influence"]["1"]["removed"] == [3]
    rows = {(r["criterion"], r["n"]): r for r in state["comparison"]["rows"]}
    assert list(rows) == [("block_influence", 1), ("block_influence", 2), ("interchange", 1), ("interchange", 2)]
    assert abs(rows[("block_influence", 1)]["dppl"]) < 1e-6  # removing an identity block costs nothing
    assert list(state["extras"]) == ["gap_extension", "plan_check"]
    check = state["extras"]["plan_check"]
    assert check["removed"] == rows[("interchange", 1)]["removed"]
    assert check["ppl_by_plan"] == pytest.approx(check["ppl_by_copy"], rel=1e-10)
    page = (results / "quality-smollm2-135m.md").read_text(encoding="utf-8")
    assert "| block_influence | 1 | 3 |" in page and (results / "quality.md").is_file()
    assert "python benchmarks/quality.py --model smollm2-135m" in state["command"]

    def boom(*args, **kwargs):
        raise AssertionError("measured again although the state has it")

    monkeypatch.setattr(bench, "evaluate_removed", boom)
    monkeypatch.setattr(bench, "gap_extension", boom)
    bench.calls.clear()
    again = _run(bench, results, "--criteria", "block_influence", "interchange", "--budgets", "1", "2")
    assert bench.calls == [(("block_influence", "interchange"), (1, 2))]  # only the table: every cell is stored
    assert again["comparison"]["rows"] == state["comparison"]["rows"]
    bench.calls.clear()
    larger = _run(bench, results, "--criteria", "block_influence", "interchange", "tail", "--budgets", "1", "2", "3")
    assert bench.calls == [(("block_influence",), (3,)), (("interchange",), (3,)), (("tail",), (1,)), (("tail",), (2,)),
                           (("tail",), (3,)), (("block_influence", "interchange", "tail"), (1, 2, 3))]
    assert {(r["criterion"], r["n"]): r for r in larger["comparison"]["rows"]}[("interchange", 2)] == \
        rows[("interchange", 2)]


def test_pieces_of_other_processes_merge_and_a_conflicting_cell_is_refused(bench, tmp_path):
    piece = _run(bench, tmp_path / "piece", "--criteria", "tail", "--budgets", "1", "2", "--max-gap", "1")
    main = tmp_path / "main"
    _run(bench, main, "--criteria", "block_influence", "--budgets", "1", "2")
    bench.calls.clear()
    merged = _run(bench, main, "--criteria", "block_influence", "tail", "--budgets", "1", "2",
                  "--merge-from", str(tmp_path / "piece" / "quality-smollm2-135m.json"))
    assert bench.calls == [(("block_influence", "tail"), (1, 2))]  # the piece's cells are not run again
    assert merged["criteria"]["tail"] == piece["criteria"]["tail"] and merged["merged_runs"] == 2
    assert "--merge-from" not in merged["command"]
    assert "(Run as 2 processes over disjoint criteria" in (main / "quality-smollm2-135m.md").read_text(encoding="utf-8")
    piece["criteria"]["tail"]["1"]["removed"] = [1]
    (tmp_path / "piece" / "quality-smollm2-135m.json").write_text(json.dumps(piece), encoding="utf-8")
    with pytest.raises(MergeConflict, match=r"\$\.criteria\.tail\.1\.removed"):
        bench.main(["--model", "smollm2-135m", "--render-only", "--results", str(main),
                    "--merge-from", str(tmp_path / "piece" / "quality-smollm2-135m.json")])


def test_pages_group_gives_the_committed_cells_and_repair():
    experiment = load_experiment("quality")
    pages = experiment_cells(experiment)["pages"]
    for model in ("smollm2-135m", "gemma3-270m"):
        stored = json.loads((RESULTS / f"quality-{model}.json").read_text(encoding="utf-8"))
        comparison = stored["comparison"]
        assert [(c["criterion"], c["n"]) for c in pages if c["model"] == model] == \
            [(r["criterion"], r["n"]) for r in comparison["rows"]]
        repair = experiment["repair"][model]
        assert comparison["recovery"] == repair["method"]
        assert f"--recovery {repair['method']} --recovery-criteria {' '.join(repair['criteria'])}" in stored["command"]
        settings = experiment["settings"]
        assert comparison["calibration"]["num_prompts"] == settings["num_prompts"]
        assert comparison["params"]["batch_size"] == settings["batch_size"]
        assert comparison["params"]["options"] == {
            "random": {"draws": settings["random_draws"], **experiment["criterion_options"]["random"]},
            "interchange_beam": {"evaluator": settings["beam_evaluator"],
                                 **experiment["criterion_options"]["interchange_beam"]}}


def test_groups_set_the_cells_and_the_repair_of_the_model():
    bench = _module()
    args = bench.parser().parse_args(["--model", "gemma3-270m", "--groups", "pages"])
    criteria, budgets, cells = bench.model_cells(args)
    assert budgets == [1, 2, 3, 4, 5, 6] and len(cells) == 11 * 6 and cells[:2] == [("block_influence", 1),
                                                                                   ("block_influence", 2)]
    assert "search_ghosted" not in criteria
    assert (args.recovery, args.recovery_criteria) == ("ghosted", ["block_influence", "sleb", "interchange_beam",
                                                                   "search"])


def _row(criterion, n, removed, dppl, ci=(None, None)):
    return {"criterion": criterion, "n": n, "removed": removed, "dppl": dppl, "dppl_ci": list(ci)}


def test_objectives_section_counts_each_objective_and_says_why_it_missed():
    bench = _module()
    rows = [_row("sleb", 1, [1], 10.0, (8.0, 12.0)), _row("search", 1, [2], 11.0, (9.0, 13.0)),
            _row("search_nll", 1, [1], 10.0, (8.0, 12.0)), _row("random", 1, [3], 1.0, (0.5, 1.5)),
            _row("sleb", 2, [1, 2], 20.0, (18.0, 22.0)), _row("search", 2, [2, 3], 25.0, (23.0, 27.0)),
            _row("search_nll", 2, [1, 2], 20.0, (18.0, 22.0)), _row("search_ghosted", 2, [3, 4], 30.0, (28.0, 32.0))]
    values = {"removal_kl": {"2,3": 0.5, "1,2": 0.7}, "nll": {"2,3": 3.2, "1,2": 3.1},
              "ghosted": {"3,4": 0.3, "1,2": 0.2}}
    lines, counts = bench.objectives_section(rows, [1, 2], values)
    # random is no candidate for the lowest; {2} +11.0 is inside {1}'s CI (upper +12.0)
    assert counts == {"removal_kl": (1, 2), "nll": (2, 2), "ghosted": (0, 1)}
    assert "| n | lowest (criterion) | dPPL % | its 95% CI | removal_kl | nll | ghosted |" in lines
    assert "| 1 | {1} (sleb) | +10.0 | [+8.0, +12.0] | {2} +11.0 met | {1} +10.0 met | - |" in lines
    assert "| 2 | {1,2} (sleb) | +20.0 | [+18.0, +22.0] | {2,3} +25.0 missed | {1,2} +20.0 met | {3,4} +30.0 missed |" \
        in lines
    assert "Met: removal_kl 1 of 2, nll 2 of 2, ghosted 0 of 1." in lines
    assert ("- n=2, removal_kl: chose {2,3} +25.0% over {1,2} (sleb) +20.0% (CI upper +22.0); the objective misranks "
            "them: it rates {2,3} lower (calibration, chosen vs lowest: removal_kl 0.5000 vs 0.7000; nll 3.2000 vs "
            "3.1000).") in lines
    assert ("- n=2, ghosted: chose {3,4} +30.0% over {1,2} (sleb) +20.0% (CI upper +22.0); the search did not reach "
            "{1,2}, which its objective rates lower (calibration, chosen vs lowest: ghosted 0.3000 vs 0.2000).") in lines
    assert bench.objective_sets(rows, [1, 2]) == [[[2, 3], [1, 2]], [[3, 4], [1, 2]]]  # per missed cell
    # a stored cell of a search the table does not hold yet: its dPPL% from its stored perplexity
    table = [r for r in rows if (r["criterion"], r["n"]) not in (("search_nll", 2), ("search_ghosted", 2))]
    state = {"comparison": {"rows": table, "params": {"budgets": [1, 2]}, "base": {"ppl": 20.0}},
             "criteria": {"search_nll": {"1": {"removed": [1]}, "2": {"removed": [1, 2]}},
                          "search_ghosted": {"2": {"removed": [3, 4]}}},  # no perplexity stored: left out
             "ppl": {"1": {"ppl": 22.0}, "1,2": {"ppl": 24.0}}}
    partial = bench.objective_rows(state)
    assert partial[:-1] == table and partial[-1] == {"criterion": "search_nll", "n": 2, "removed": [1, 2],
                                                     "dppl": pytest.approx(20.0), "dppl_ci": None}
    lines, counts = bench.objectives_section(partial, [1, 2], {})
    assert counts == {"removal_kl": (1, 2), "nll": (2, 2)}
    assert "| 2 | {1,2} (sleb) | +20.0 | [+18.0, +22.0] | {2,3} +25.0 missed | {1,2} +20.0 met * |" in lines
    assert any(line.startswith("\\* a cell of a search whose run has not reached") for line in lines)
    assert bench.objectives_section([_row("sleb", 1, [1], 10.0, (8.0, 12.0))], [1], {}) == ([], {})


def test_a_run_stores_each_objective_of_the_sets_of_each_miss(bench, tmp_path, monkeypatch):
    from hf_layerswap.selection.objectives import OBJECTIVES, SetObjective

    results = tmp_path / "r"
    monkeypatch.setattr(bench, "meets", lambda mine, best: False)  # every cell a miss: every set is read
    state = _run(bench, results, "--criteria", "block_influence", "search", "search_nll", "--budgets", "1")
    rows = {r["criterion"]: r for r in state["comparison"]["rows"]}
    sets = list({",".join(map(str, r["removed"])): r["removed"] for r in rows.values()}.values())
    assert len(sets) >= 2
    stored = state["extras"]["objective_values"]
    assert sorted(stored) == sorted(OBJECTIVES) and all(sorted(v) == sorted(",".join(map(str, s)) for s in sets)
                                                         for v in stored.values())
    # the removal KL as the harness stored it; the others scored on the calibration prompts
    assert stored["removal_kl"] == {k: state["removal_kl"][k] for k in stored["removal_kl"]}
    model, _ = bench.load_model("smollm2-135m")
    calib = bench.wikitext_calibration(None, 4, 12)
    for objective in OBJECTIVES:
        expected = SetObjective(model, calib, objective, batch_size=8)(sets)
        assert [stored[objective][",".join(map(str, s))] for s in sets] == pytest.approx(expected, rel=1e-9)
    page = (results / "quality-smollm2-135m.md").read_text(encoding="utf-8")
    assert "## Objectives of the search" in page and "| n | lowest (criterion) | dPPL % | its 95% CI | removal_kl | nll |" \
        in page
    assert "## Objectives across models" in (results / "quality.md").read_text(encoding="utf-8")

    def boom(*args, **kwargs):
        raise AssertionError("scored again although the state has it")

    monkeypatch.setattr(bench, "SetObjective", boom)
    again = _run(bench, results, "--criteria", "block_influence", "search", "search_nll", "--budgets", "1")
    assert again["extras"]["objective_values"] == stored


def test_the_default_objective_changes_only_for_strictly_more_cells_met_on_every_cell():
    choice = _module().default_choice
    lines = choice({"removal_kl": [10, 12], "nll": [1, 3], "ghosted": [0, 6]})
    assert lines[0] == ("Choosing the default: an objective replaces `removal_kl` (10 of 12 met) only when it is "
                        "measured on every cell and meets strictly more of them.")
    assert lines[1:] == ["- `nll`: misses 2 of the 3 measured, at least as many as the default: it cannot replace it.",
                         "- `ghosted`: misses 6 of the 6 measured, at least as many as the default: it cannot replace it."]
    assert choice({"removal_kl": [10, 12], "nll": [5, 5]})[1] == \
        "- `nll`: misses 0 of the 5 measured; not measured on every cell yet."
    assert choice({"removal_kl": [10, 12], "nll": [11, 12]})[1] == "- `nll`: meets more (11 of 12): it replaces the default."
    assert choice({"removal_kl": [10, 12], "nll": [10, 12]})[1] == \
        "- `nll`: misses 2 of the 12 measured, at least as many as the default: it cannot replace it."
