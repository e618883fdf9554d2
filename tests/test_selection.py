"""Selection: the paper's greedy rule (spacing, protected blocks, non-finite scores never
selected, unmeetable budgets refused) on a hand-built report, and the "auto" protocol
choice recording both candidate sets and their removal KL; every registered strategy
refusing non-finite scores, budgets the rule cannot meet, and reports of another model."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from arch_matrix import NUM_BLOCKS, build, prompts, tiny_tokenizer
from conftest import (
    NONFINITE_ADVICE,
    assert_model_unchanged,
    nonfinite_report,
    snapshot_model,
    tiny_batch,
    tiny_model,
)

import hf_layerswap as hl
from hf_layerswap import (
    LayerSwapConfig,
    NonFiniteScoresError,
    SwapReport,
    prune_loaded_model,
    remove_layers,
    select_layers,
)
from hf_layerswap.layerplan import decoder_blocks, num_blocks
from hf_layerswap.scoring.report import PairResult
from hf_layerswap.scoring.rule import greedy_select
from hf_layerswap.selection import STRATEGIES, register_strategy
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


# ----------------------------------------------------------------------------- strategy entries
def test_a_strategy_entry_carries_what_differs():
    from hf_layerswap.selection.registry import STRATEGIES, register_strategy, strategy_entry

    greedy, auto, search = strategy_entry("greedy"), strategy_entry("auto"), strategy_entry("search")
    assert (greedy.spacing, auto.spacing, search.spacing) == (1, 1, 0)
    assert greedy.strategy_for("auto") == "auto" and greedy.strategy_for("replacement") == "greedy"
    assert greedy.scores("replacement") == ("replacement",) and auto.scores("interchange") == ("replacement", "interchange")
    assert search.reads("interchange") == () and greedy.reads("interchange") == ("interchange",)
    assert search.guided_by({"selected": [1]}, "interchange") is None
    assert auto.guided_by({"chosen_protocol": "replacement"}, "auto") == "replacement"
    assert search.values({"value": 0.25}) == [("the search's value", 0.25)]
    assert sorted(greedy.criteria) == ["interchange", "replacement"] and sorted(search.criteria) == [
        "search", "search_ghosted", "search_nll"]
    with pytest.raises(TypeError, match=r"register_strategy\('x'\): unknown entry field\(s\) \['spacinG'\]"):
        register_strategy("x", spacinG=1)
    assert "x" not in STRATEGIES
    unknown = strategy_entry("removed_since")  # a record of a strategy this process does not know still reads
    assert unknown.fn is None and unknown.guided_by({}, "interchange") == "interchange" and unknown.values({}) == []


def test_a_recovery_entry_says_if_it_attaches_and_serves_as_an_objective():
    from hf_layerswap.recovery import RECOVERY_METHODS, recovery_entry, search_objectives
    from hf_layerswap.selection.objectives import OBJECTIVES, SET_OBJECTIVES

    assert OBJECTIVES == (*SET_OBJECTIVES, *search_objectives())
    assert {"removal_kl", "nll"} <= set(SET_OBJECTIVES) and "ghosted" in search_objectives()
    assert {n: RECOVERY_METHODS[n].search_objective for n in ("none", "ghosted", "fused", "linearpatch")} == {
        "none": False, "ghosted": True, "fused": False, "linearpatch": False}
    assert {n: RECOVERY_METHODS[n].attaches_at_load for n in ("none", "ghosted", "fused", "linearpatch")} == {
        "none": False, "ghosted": True, "fused": False, "linearpatch": True}
    indices = lambda b: ", ".join(map(str, b))  # noqa: E731
    # where each map went, from the record: a cut at block 0 goes into the embedding, not a down_proj
    record = {"boundaries": [0, 5], "folded_into": ["embed_tokens", "layers.4.mlp.down_proj"]}
    assert recovery_entry("fused").card_row(record, indices) == (
        "ReplaceMe-style least-squares map folded into `embed_tokens` before boundary 0, `layers.4.mlp.down_proj` "
        "before boundary 5 (pruned numbering): plain transformers weights")
    assert recovery_entry("fused").card_row({"boundaries": [2, 5]}, indices) == (
        "ReplaceMe-style least-squares map folded into the weights before boundaries 2, 5 (the record does not name "
        "the modules) (pruned numbering): plain transformers weights")
    assert recovery_entry(None) is None and recovery_entry("unknown") is None
    with pytest.raises(NotImplementedError, match="recovery method 'fused' is no search objective"):
        recovery_entry("fused").cut_operator(None, [1], 0.0)


# --------------------- budgets, protected blocks and reports the rule refuses


def test_unmeetable_budgets_name_the_rule(matrix_llama, matrix_report):
    with pytest.raises(ValueError) as err:
        select_layers(matrix_report, 3, spacing=1, protect=(0, -1))
    assert "cannot select 3 layers of 6 with spacing=1 and protect=[0, 5]: the rules allow at most 2" in str(err.value)
    for n in (0, NUM_BLOCKS):
        with pytest.raises(ValueError, match=rf"num_to_remove={n}: allowed 1..5 for a model with 6 blocks"):
            select_layers(matrix_report, n)
    with pytest.raises(ValueError, match=r"spacing=-1: must be an int >= 0"):
        select_layers(matrix_report, 1, spacing=-1)
    # at load time: refused before scoring (no report is left), the model is left as it was
    model = build("llama")
    snap = snapshot_model(model)
    cfg = LayerSwapConfig(num_to_remove=3, calibration=prompts(), progress=False, batch_size=2, spacing=1)
    with pytest.raises(ValueError, match="cannot select 3 layers of 6"):
        prune_loaded_model(model, cfg)
    assert not hasattr(model, "layerswap_report")
    assert_model_unchanged(model, snap)


def test_check_budget_counts_what_the_rules_allow():
    from hf_layerswap.scoring.rule import check_budget

    assert check_budget(2, 6) == 2  # blocks 1..4 unprotected, no two adjacent: {1, 3} or {2, 4}
    with pytest.raises(ValueError, match=r"cannot select 3 layers of 6 with spacing=1 and protect=\[0, 5\]: the rules allow at most 2"):
        check_budget(3, 6)
    assert check_budget(4, 6, spacing=0) == 4
    assert check_budget(np.int64(5), 6, spacing=0, protect=[]) == 5
    with pytest.raises(ValueError, match=r"cannot select 3 layers of 6 with spacing=2 and protect=\[\]: the rules allow at most 2"):
        check_budget(3, 6, spacing=2, protect=[])  # {0, 3} is the most
    with pytest.raises(ValueError, match=r"num_to_remove=6: allowed 1..5"):
        check_budget(6, 6, spacing=0, protect=[])


def test_report_from_a_model_of_another_depth_is_refused(matrix_report):
    other = build("llama", num_blocks=4)
    with pytest.raises(ValueError, match=r"computed on a model with 6 blocks but this model has 4"):
        select_layers(matrix_report, 1, model=other)


def test_a_report_of_another_model_of_the_same_depth_is_refused_wherever_it_is_applied(matrix_report, tmp_path, capsys):
    """Same block count, other weights: the report's fingerprint differs. Selecting for the
    model, pruning with --report and publishing with the report all refuse it."""
    from hf_layerswap import save_for_hub
    from hf_layerswap.cli import main
    from hf_layerswap.hub import PushRefusedError

    other = build("llama")  # 6 blocks, like the scored model; then other weights
    with torch.no_grad():
        decoder_blocks(other)[2][3].mlp.down_proj.weight.mul_(0.5)
    assert num_blocks(other) == matrix_report.num_blocks
    message = "the report belongs to a different model: its fingerprint is"
    with pytest.raises(ValueError, match=message):
        select_layers(matrix_report, 1, model=other)
    with pytest.raises(ValueError, match=message):
        select_layers(matrix_report, 1, model=other, strategy="search", calibration=prompts())
    ckpt, out = tmp_path / "other", tmp_path / "out"
    other.save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    matrix_report.to_json(tmp_path / "report.json")
    capsys.readouterr()
    code = main(["prune", str(ckpt), str(out), "--num-to-remove", "1", "--report", str(tmp_path / "report.json"),
                 "--calibration", str(tmp_path / "report.json"), "--num-prompts", "2"])
    assert code == 2 and not out.exists()
    assert message in capsys.readouterr().err
    pruned = remove_layers(copy.deepcopy(other), [2])
    with pytest.raises(PushRefusedError, match="the report does not belong to this model"):
        save_for_hub(pruned, tmp_path / "pub", report=matrix_report)
    assert not (tmp_path / "pub").exists()


def test_non_finite_scores_sort_after_inf_and_never_enter_a_selection():
    pairs = [
        PairResult(0, 1, replacement_ij=0.1, replacement_ji=0.2, interchange=0.05),
        PairResult(1, 2, replacement_ij=math.inf, replacement_ji=0.3, interchange=math.inf),
        PairResult(2, 3, replacement_ij=math.nan, replacement_ji=0.4, interchange=math.nan),
    ]
    report = SwapReport(4, pairs)
    assert report.layer_scores("interchange") == pytest.approx([0.05, 0.05, math.inf, math.nan], nan_ok=True)
    assert report.ranking("interchange") == [0, 1, 2, 3]
    assert select_layers(report, 2, spacing=0, protect=()) == [0, 1]
    with pytest.raises(NonFiniteScoresError, match=r"^cannot select 3 block\(s\) on finite interchange swap-KL "
                       r"scores: non-finite values: pair \(1, 2\) interchange = inf; pair \(2, 3\) interchange = NaN\. "):
        select_layers(report, 3, spacing=0, protect=())


def test_protect_as_a_bare_int_is_refused(matrix_report):
    # protect=0 used to mean "protect nothing" (0 is falsy); protect=5 raised "'int' object is not iterable"
    for protect in (0, 5, "0"):
        with pytest.raises(ValueError) as err:
            select_layers(matrix_report, 1, protect=protect)
        assert str(err.value) == f"protect={protect!r}: must be a list of 0-based block indices, e.g. [0, -1] (or [] for none)"
    with pytest.raises(ValueError, match=r"^protect entry 1.0 is not an int: allowed ints in -6..5$"):
        select_layers(matrix_report, 1, protect=[1.0])


# ----------------------------- non-finite scores: every strategy refuses them


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_registered_strategy_refuses_nan_scores(overflow, strategy):
    model, calibration, report = overflow
    protocol = "auto" if strategy == "auto" else "interchange"
    checked = "replacement" if strategy == "auto" else "interchange"  # auto checks each scored protocol
    probes = ["replacement_ij", "replacement_ji"] if checked == "replacement" else ["interchange"]
    named = "; ".join(f"pair \\({i}, {i + 1}\\) {checked} = NaN" for i in range(5))
    with pytest.raises(hl.NonFiniteScoresError, match=(
            rf"^cannot select 1 block\(s\) on finite {checked} swap-KL scores: non-finite values: {named}; the values "
            rf"first broke at calibration batch 0 \(0-based\)\. {NONFINITE_ADVICE}$")) as err:
        hl.select_layers(report, 1, strategy=strategy, protocol=protocol, model=model, calibration=calibration)
    assert err.value.first_batch == 0 and isinstance(err.value, ValueError)
    assert len(err.value.nonfinite) == 5 and probes  # one per pair, each NaN
    assert all(math.isnan(v) for v in err.value.nonfinite.values())
    assert report.selections == [] and report.removal_kl == {}  # nothing recorded


def test_a_newly_registered_strategy_passes_through_the_same_check(overflow):
    model, calibration, report = overflow

    @register_strategy("first_unprotected_for_test")
    def first(report, num_to_remove, **_):
        return list(range(1, 1 + num_to_remove))  # ignores the scores entirely

    try:
        with pytest.raises(hl.NonFiniteScoresError, match=r"^cannot select 2 block\(s\) on finite interchange"):
            hl.select_layers(report, 2, strategy="first_unprotected_for_test")
        # finite scores enough for the budget, but the strategy takes block 2, whose score is NaN
        partial = SwapReport(6, [PairResult(i, i + 1, 0.1, 0.1, math.nan if i in (1, 2) else 0.1) for i in range(5)])
        assert partial.layer_scores("interchange")[2] != partial.layer_scores("interchange")[2]  # NaN
        with pytest.raises(hl.NonFiniteScoresError, match=(
                r"^cannot select 2 block\(s\) with a finite value: the best set the strategy found is \[1, 2\]: "
                r"non-finite values: layer 2 \(interchange score\) = NaN\. ")):
            hl.select_layers(partial, 2, strategy="first_unprotected_for_test")
        assert hl.select_layers(partial, 1, strategy="first_unprotected_for_test") == [1]  # block 1: finite (0-1)
    finally:
        STRATEGIES.pop("first_unprotected_for_test")


@pytest.mark.parametrize("strategy", ["search", "beam", "single_removal_kl"])
def test_a_set_objective_that_is_non_finite_is_refused_and_the_report_left_as_it_was(overflow, strategy):
    # finite swap-KL values, but every removal set's objective on the model is NaN
    model, calibration, _ = overflow
    report = SwapReport(6, [PairResult(i, i + 1, 0.1 * (i + 1), 0.2 * (i + 1), 0.05 * (i + 1)) for i in range(5)])
    report.removal_kl["2"] = 0.5
    message = {
        "search": r"the best set the strategy found is \[1\]: non-finite values: set 1 \(objective\) = NaN; "
                  r"set 1 \(joint removal KL\) = NaN\. ",
        "beam": r"the best set the strategy found is \[1\]: non-finite values: set 1 \(objective\) = NaN\. ",
        # a per-layer rule: every unprotected block's single-removal KL is NaN
        "single_removal_kl": r"found 0: \[\]\): non-finite values: layer 1 = NaN; layer 2 = NaN; layer 3 = NaN; "
                             r"layer 4 = NaN\. ",
    }[strategy]
    with pytest.raises(hl.NonFiniteScoresError, match=message + NONFINITE_ADVICE):
        hl.select_layers(report, 1, strategy=strategy, model=model, calibration=calibration)
    assert report.selections == [] and report.removal_kl == {"2": 0.5}


def test_greedy_rule_names_the_layers_when_only_non_finite_scores_could_fill_the_budget():
    with pytest.raises(hl.NonFiniteScoresError, match=(
            r"^cannot select 2 layers of 5 with finite scores \(found 1: \[1\]\): non-finite values: layer 2 = NaN; "
            r"layer 3 = inf\. ")) as err:
        greedy_select([0.0, 0.1, math.nan, math.inf, 0.2], 2, spacing=0)
    assert list(err.value.nonfinite) == ["layer 2", "layer 3"] and err.value.first_batch is None
    # gaps the score order leaves are not a question of finiteness, even with a NaN among them
    with pytest.raises(ValueError, match=r"the rule found only 2 \(\[2, 4\]\)") as plain:
        greedy_select([0.0, 0.5, 0.0, 0.5, 0.0, math.nan, 0.0], 3, spacing=1, protect=(0, -1))
    assert not isinstance(plain.value, hl.NonFiniteScoresError)


@pytest.mark.parametrize("strategy", ["sleb", "block_influence"])
def test_select_layers_takes_the_none_report_of_a_prune_that_scored_nothing(strategy):
    # PruneResult.report is None for a strategy that reads no swap-KL score: passed on to
    # select_layers for the same strategy it selects as prune did, not an AttributeError
    calibration = tiny_batch(4, 12)
    pruned = tiny_model("llama", 6)
    result = hl.prune(pruned, hl.LayerSwapConfig(num_to_remove=2, strategy=strategy, calibration=calibration,
                                                 progress=False))
    assert result.report is None
    assert hl.select_layers(result.report, 2, strategy=strategy, model=tiny_model("llama", 6),
                            calibration=calibration) == result.removed
    with pytest.raises(ValueError) as err:
        hl.select_layers(None, 2, strategy="greedy", model=tiny_model("llama", 6), calibration=calibration)
    assert str(err.value) == ("report=None: strategy='greedy' reads swap-KL scores; pass the SwapReport of "
                              "score_layers (or a strategy that reads none, e.g. 'sleb')")
    with pytest.raises(ValueError, match=rf"report=None with strategy='{strategy}': pass model="):
        hl.select_layers(None, 2, strategy=strategy)
