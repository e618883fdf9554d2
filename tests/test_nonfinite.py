"""Non-finite scores (NaN, inf) are results to report, never a basis for removal: on an fp16
model whose block 3 overflows, every registered strategy refuses (one shared check), the
score verbs warn naming the first broken calibration batch, a pruning leaves the model
as it was, the card shows the values as NaN, and a removal chosen on them is not
published."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch
from arch_matrix import prompts, tiny_tokenizer
from conftest import tiny_batch, tiny_model

import hf_layerswap as hl
from hf_layerswap.card import render_card
from hf_layerswap.cli import main
from hf_layerswap.plan import num_blocks
from hf_layerswap.report import PairResult, SwapReport
from hf_layerswap.rule import greedy_select
from hf_layerswap.scoring import removal_kl
from hf_layerswap.selection import STRATEGIES, register_strategy

ADVICE = (r"non-finite values are reported, never a basis for removal: load the model in float32 "
          r"\(from_pretrained\(\.\.\., dtype=torch\.float32\), or --dtype float32 on the command line\) or score on "
          r"another calibration set")


def _overflowing(dtype=torch.float16, scale=300.0, family="llama"):
    """A tiny model whose block 3 MLP overflows (fp16 max is 65504): the model's own output is NaN."""
    model = tiny_model(family).to(dtype)
    with torch.no_grad():
        for p in model.model.layers[3].mlp.parameters():
            p.mul_(scale)
    return model


def _quiet_score(model, calibration, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hl.NonFiniteScoresWarning)
        warnings.simplefilter("ignore", hl.CalibrationShortfallWarning)
        return hl.score_layers(model, calibration, progress=False, **kw)


@pytest.fixture(scope="module")
def overflow():
    model, calibration = _overflowing(), tiny_batch(4, 12)
    return model, calibration, _quiet_score(model, calibration)


def test_the_overflowing_model_gives_all_nan_scores(overflow):
    _, _, report = overflow
    assert all(math.isnan(v) for r in report.pairs for v in (r.replacement_ij, r.replacement_ji, r.interchange))
    assert report.metadata["nonfinite"] == {"first_batch": 0}
    assert list(report.nonfinite_values())[:3] == [
        "pair (0, 1) replacement_ij", "pair (0, 1) replacement_ji", "pair (0, 1) interchange"]


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_registered_strategy_refuses_nan_scores(overflow, strategy):
    model, calibration, report = overflow
    protocol = "auto" if strategy == "auto" else "interchange"
    checked = "replacement" if strategy == "auto" else "interchange"  # auto checks each scored protocol
    probes = ["replacement_ij", "replacement_ji"] if checked == "replacement" else ["interchange"]
    named = "; ".join(f"pair \\({i}, {i + 1}\\) {checked} = NaN" for i in range(5))
    with pytest.raises(hl.NonFiniteScoresError, match=(
            rf"^cannot select 1 block\(s\) on finite {checked} swap-KL scores: non-finite values: {named}; the values "
            rf"first broke at calibration batch 0 \(0-based\)\. {ADVICE}$")) as err:
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
    with pytest.raises(hl.NonFiniteScoresError, match=message + ADVICE):
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


def test_prune_refuses_and_leaves_the_model_as_it_was(overflow):
    model, calibration, _ = overflow
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(hl.NonFiniteScoresError, match=r"^cannot select 1 block\(s\) on finite interchange"):
            hl.prune(model, hl.LayerSwapConfig(num_to_remove=1, calibration=calibration, progress=False))
    assert num_blocks(model) == 6 and getattr(model.config, "layerswap", None) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_score_verbs_warn_with_the_first_broken_batch():
    model = tiny_model("llama")
    calibration = prompts(4, 12, seed=3, pad_last=0, high=100)
    calibration["input_ids"][2, 4] = 120  # only prompt 2 (batch 1 of size 2) carries the marker

    def poison(module, args, output):
        return torch.where((args[0] == 120).any(dim=1)[:, None, None], torch.full_like(output, math.nan), output)

    handle = model.model.embed_tokens.register_forward_hook(poison)
    try:
        with pytest.warns(hl.NonFiniteScoresWarning, match=(
                rf"^15 of 15 swap-KL probe values are non-finite \(NaN or inf\), first at calibration batch 1 "
                rf"\(0-based\); {ADVICE}$")):
            report = hl.score_layers(model, calibration, batch_size=2, num_prompts=4, progress=False)
        with pytest.warns(hl.NonFiniteScoresWarning, match=(
                r"^2 of 2 removal KL values are non-finite \(NaN or inf\), first at calibration batch 1 \(0-based\)")):
            values = removal_kl(model, calibration, [[1], [2]], batch_size=2, num_prompts=4)
    finally:
        handle.remove()
    assert report.metadata["nonfinite"] == {"first_batch": 1}
    assert all(math.isnan(v) for v in values)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hl.NonFiniteScoresWarning)  # finite scores: no warning
        clean = hl.score_layers(model, calibration, batch_size=2, num_prompts=4, progress=False)
    assert "nonfinite" not in clean.metadata and clean.nonfinite_values() == {}


def test_adaptive_scoring_stops_at_non_finite_scores_and_reports_them():
    model, calibration = _overflowing(), tiny_batch(4, 12)
    budget = hl.scoring.AdaptiveBudget(num_to_remove=1, min_prompts=2, step=2)
    with pytest.warns(hl.NonFiniteScoresWarning, match=r"^15 of 15 swap-KL probe values are non-finite"):
        report = hl.score_layers(model, calibration, batch_size=2, num_prompts=4, adaptive=budget, progress=False)
    record = report.metadata["adaptive"]
    assert record["stopped"] == "nonfinite" and record["rounds"] == [
        {"num_prompts": 2, "selected": None, "stable": False, "closest": None}]
    assert record["reason"] == "stopped: the interchange scores cannot fill the budget with finite values"
    assert report.metadata["num_prompts"] == 2 and report.metadata["nonfinite"] == {"first_batch": 0}


def test_cli_score_warns_once_and_keeps_the_values(tmp_path, capsys):
    model = _overflowing(torch.float32, scale=1e15, family="qwen3")  # overflows float32 too
    model.save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(f"paragraph {k} of plain calibration text, long enough to count as a prompt here" for k in range(4)) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", hl.NonFiniteScoresWarning)  # said once, as the warning: line below
        warnings.simplefilter("ignore", hl.CalibrationShortfallWarning)
        assert main(["score", str(tmp_path / "base"), "--calibration", str(calib), "--num-prompts", "4",
                     "--seq-len", "12", "-o", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1
    assert "warning: 15 swap-KL value(s) are kept in the report as results: non-finite values: pair (0, 1) " \
           "replacement_ij = NaN; " in err and "; and 3 more; the values first broke at calibration batch 0" in err
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["pairs"][0]["interchange"] == "NaN" and len(saved["metadata"]["nonfinite"]["values"]) == 15
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "out"), "--num-to-remove", "1", "--strategy",
                 "greedy", "--report", str(tmp_path / "r.json")]) == 2
    assert "error: cannot select 1 block(s) on finite interchange swap-KL scores" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _pruned_with_nan_report():
    model = tiny_model("llama")
    nan_pairs = [PairResult(i, i + 1, math.nan, math.nan, math.nan) for i in range(5)]
    report = SwapReport(6, nan_pairs, metadata={"nonfinite": {"first_batch": 0}})
    hl.remove_layers(model, [2])
    return model, report


def test_card_shows_nan_and_marks_no_block_removed_on_it(tmp_path):
    model, report = _pruned_with_nan_report()  # explicit layers: the removal did not rest on the scores
    card = str(render_card(model, report=report))
    lines = card.splitlines()
    assert "| 2 | NaN | NaN | — | — | **removed** (its score is non-finite: not a basis for the removal) |" in lines
    assert "| 3 | NaN | NaN | — | — |  |" in lines  # no rank on a NaN score
    assert "| 2 | 3 | NaN | NaN | NaN | NaN | — |" in lines  # the pair row: NaN values, no I/R
    assert "| interchange | none: non-finite scores of layers 1, 2, 3, 4 | — |" in lines
    assert hl.save_for_hub(model, tmp_path / "explicit", report=report)  # explicit layers are published


def test_save_for_hub_refuses_a_removal_chosen_on_non_finite_values(tmp_path):
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = hl.prune(model, hl.LayerSwapConfig(num_to_remove=1, calibration=tiny_batch(4, 12), progress=False))
    step = model.config.layerswap["steps"][-1]
    assert step["strategy"] == "search" and math.isfinite(step["decision"]["value"])
    step["decision"]["value"] = math.nan  # as an older version recorded it
    with pytest.raises(hl.PushRefusedError, match=(
            rf"^the removal was chosen on non-finite values: step 0 \(search\) removed {re.escape(str(step['removed_layers']))} on the "
            rf"search's value = NaN; {ADVICE}, then select again \(or remove explicit layers\)$")):
        hl.save_for_hub(model, tmp_path / "out", report=result.report)
    assert not (tmp_path / "out").exists()
