"""Model card content: front matter, both protocol tables with the report's own numbers,
the candidate sets, evaluation, calibration, plots and the offline validity checks, and
non-finite scores shown as NaN."""

from __future__ import annotations

import json
import math

import pytest
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results
from publish_helpers import (
    BASE_MODEL,
    CONTENT_HASH,
    evaluation_of,
    INTERCHANGE_SET,
    REPLACEMENT_SET,
    hand_report,
    pruned,  # noqa: F401 (fixture)
    pruned_tiny,
    report,  # noqa: F401 (fixture)
)

from conftest import tiny_batch, tiny_model
import hf_layerswap as hl
from hf_layerswap import LayerSwapConfig, SwapReport, prune_loaded_model, remove_layers
from hf_layerswap.card import (
    EVALUATION_FILE,
    REPORT_FILE,
    check_card,
    normalize_evaluation,
    render_card,
    report_mismatches,
    write_card_files,
)
from hf_layerswap.plots import PLOT_FILES, planned_plots
from hf_layerswap.scoring.report import PairResult


@pytest.fixture(scope="module")
def card(pruned, report):
    return render_card(pruned, report=report, evaluation=evaluation_of(pruned), base_model=BASE_MODEL, license="apache-2.0",
                       repo_id="user/tiny-pruned")


def test_hand_report_picks_differ_by_protocol(report):
    from hf_layerswap import select_layers

    assert select_layers(report, 2, protocol="replacement") == REPLACEMENT_SET
    assert select_layers(report, 2, protocol="interchange") == INTERCHANGE_SET


def test_front_matter(card):
    data = card.data.to_dict()
    assert data["base_model"] == BASE_MODEL
    assert data["library_name"] == "transformers"
    assert data["license"] == "apache-2.0"
    assert data["tags"] == ["layerswap", "layer-pruning", "interchange"]
    assert data["layerswap"] == {
        "original_num_hidden_layers": 6, "num_hidden_layers": 4, "removed_layers": [1, 3],
        "protocol": "interchange", "report": REPORT_FILE,
    }
    name, results = model_index_to_eval_results(data["model-index"])
    assert name == "user/tiny-pruned"
    values = {r.metric_name: r.metric_value for r in results}
    assert values == {"Perplexity (this model)": 25.0, "Perplexity (base model, same contract)": 20.0}
    for r in results:
        assert (r.dataset_type, r.dataset_config, r.dataset_split, r.metric_type) == (
            "wikitext", "wikitext-2-raw-v1", "test", "perplexity")
        assert r.metric_args == {"name": "matched", "words": 5000, "window": 512, "stride": 256, "dtype": "float32"}


def test_removed_blocks_and_parameters(card, pruned):
    text = card.text
    assert "| Removed blocks (0-based, original numbering) | 1, 3 |" in text
    assert "| Kept blocks (0-based, original numbering) | 0, 2, 4, 5 |" in text
    assert "| Decoder blocks | 6 → 4 (2 removed) |" in text
    before = sum(p.numel() for p in tiny_model("llama", 6).parameters())
    after = sum(p.numel() for p in pruned.parameters())
    assert before > after
    pct = 100 * (after - before) / before
    assert f"| Parameters | {before:,} → {after:,} ({after - before:+,}, {pct:+.1f}%) |" in text


def test_both_protocol_tables_carry_the_report_numbers(card):
    text = card.text
    # per-layer scores (hand-computed in publish_helpers), ranks, status
    assert "| 1 | 0.25 | 0.05 | 3 | 4 | **removed** |" in text
    assert "| 3 | 0.12 | 0.02 | 2 | 1 | **removed** |" in text
    assert "| 0 | 0.5 | 0.3 | 5 | 6 | protected |" in text
    assert "| 2 | 0.12 | 0.05 | 1 | 5 |  |" in text
    # pair table: both replacement directions, their max, interchange, I/R
    assert "| 3 | 4 | 0.3 | 0.35 | 0.35 | 0.02 | 0.057 |" in text
    assert "| 0 | 1 | 0.5 | 0.4 | 0.5 | 0.3 | 0.600 |" in text
    assert "| 2 | 3 | 0.1 | 0.12 | 0.12 | 0.08 | 0.667 |" in text
    assert "interchange ≤ replacement on 100% of them" in text
    # what each protocol would remove, what was removed and why
    assert "| replacement | 2, 4 | 0.027 |" in text
    assert "| interchange | 1, 3 | 0.011 |" in text
    assert "| **removed** | **1, 3** | 0.011 |" in text
    assert "It is the set the interchange protocol picks; the other protocol picks a different one." in text


def test_card_shows_the_searched_set_next_to_each_protocols_set():
    model = tiny_model("llama", num_blocks=6)
    batch = tiny_batch()
    prune_loaded_model(model, LayerSwapConfig(num_to_remove=2, calibration=batch, progress=False))
    report = model.layerswap_report
    record = report.selections[-1]
    card = str(render_card(model, report=report))
    assert "`strategy='search'`" in card and "**removal_kl**" in card
    assert "guided by both swap-KL protocols" in card
    for p in ("replacement", "interchange"):
        entry = record["protocol_sets"][p]
        row = f"| {p} | {', '.join(map(str, entry['set']))} | {entry['value']:.4g} |"
        assert row in card
    removed = model.config.layerswap["removed_layers"]
    assert removed == record["selected"]
    assert f"| **removed** | **{', '.join(map(str, removed))}** | {record['value']:.4g} |" in card
    assert "spacing=1, protect=[0, -1] for each protocol's rule; the search itself used spacing=0" in card


def test_evaluation_calibration_cost_and_snippets(card):
    text = card.text
    assert "| base | 20.000 | [19.500, 20.600] | 2.996 | 6,000 | 24 |" in text
    assert "| pruned (this model) | 25.000 | [24.100, 25.900] | 3.219 | 6,000 | 24 |" in text
    assert "ΔPPL = +25.0%" in text
    assert "| window | 512 |" in text and "| stride | 256 |" in text and '| bos | {"added": false} |' in text
    assert "| source | file:wiki.test.raw |" in text and "versions" not in text.split("## Evaluation")[1].split("## Calibration")[0]
    import transformers

    live = transformers.__version__  # removal ran in this process, the card is rendered now
    assert "| Library | scoring | removal | evaluation | card |" in text
    assert f"| transformers | 5.24.0 | {live} | 5.24.0 | {live} |" in text
    assert f"| Content hash | `{CONTENT_HASH}` |" in text
    assert "| Prompts × tokens | 8 prompts × up to 32 tokens (250 real tokens) |" in text
    assert "| Tokenizer special tokens | `add_special_tokens=True`: the tokenizer's own BOS policy" in text
    assert "| Forward passes | 16 sweeps" in text
    assert 'AutoModelForCausalLM.from_pretrained("user/tiny-pruned")' in text
    assert f'"{BASE_MODEL}",\n    quantization_config=LayerSwapConfig(num_to_remove=2, protocol=\'interchange\'' in text
    assert "trust_remote_code" in text  # the card says it is not needed


def test_an_evaluation_is_refused_unless_both_results_are_of_these_models_under_one_contract(pruned, report):
    """No contract, two contracts, or results of other weights: refused, never published as the
    pruning cost "under the contract below" (it used to read -50% with "not recorded")."""
    good = evaluation_of(pruned)
    with pytest.raises(ValueError, match=r"evaluation\['base'\] \(ppl 10\) records no contract"):
        render_card(pruned, report=report, evaluation={"base": {"ppl": 10}, "pruned": {"ppl": 5}})
    other = json.loads(json.dumps(good))
    other["base"]["contract"]["window"] = 1024
    with pytest.raises(ValueError, match=r"measured under different contracts \(differing: window; window: base 1024, "
                                         r"pruned 512\)"):
        render_card(pruned, report=report, evaluation=other)
    # identities: a pair from another model (or the base measured twice) is not this model's
    foreign = tiny_model("llama", 4, seed=5)
    from hf_layerswap.layerplan import model_fingerprint

    other = json.loads(json.dumps(good))
    other["pruned"]["contract"]["model"] = {"name": "another", "fingerprint": model_fingerprint(foreign)}
    with pytest.raises(ValueError, match=r"evaluation\['pruned'\] measured weights \w{12} \(another\), not this "
                                         r"model's \w{12}: it is another model's result"):
        render_card(pruned, report=report, evaluation=other)
    other = json.loads(json.dumps(good))
    other["base"] = other["pruned"]
    with pytest.raises(ValueError, match=r"evaluation\['base'\] measured weights .* not the scored base model's"):
        render_card(pruned, report=report, evaluation=other)
    other = json.loads(json.dumps(good))
    del other["pruned"]["contract"]["model"]
    with pytest.raises(ValueError, match=r"evaluation\['pruned'\] does not record the weights it measured"):
        render_card(pruned, report=report, evaluation=other)
    # the same checks on a config: the weights recorded after the last removal step
    with pytest.raises(ValueError, match="it is another model's result"):
        render_card(pruned.config, report=report, evaluation={"pruned": json.loads(json.dumps(good))["base"]})
    assert "ΔPPL = +25.0%" in render_card(pruned.config, report=report, evaluation=good).text


def test_an_eval_verb_result_pair_is_accepted_and_a_lone_one_refused(pruned, report):
    good = evaluation_of(pruned)
    verb = {k: {"model": {"name": "x", "num_blocks": 4}, "perplexity": v, "tasks": None} for k, v in good.items()}
    text = render_card(pruned, report=report, evaluation=verb, base_model=BASE_MODEL).text
    assert "| pruned (this model) | 25.000 |" in text and "ΔPPL = +25.0%" in text
    with pytest.raises(ValueError, match="evaluation is one model's `hf-layerswap eval` result, not the pair"):
        render_card(pruned, report=report, evaluation=verb["pruned"])
    verb["base"]["perplexity"] = None
    with pytest.raises(ValueError, match=r"evaluation\['base'\] is an `hf-layerswap eval` result without perplexity"):
        render_card(pruned, report=report, evaluation=verb)


def test_text_that_is_not_a_hub_dataset_is_named_by_its_source(pruned, report):
    contract = {"source": "embedded:pydoc_data.topics", "split": "evaluation",
                "model": evaluation_of(pruned)["pruned"]["contract"]["model"]}
    embedded = {"pruned": {"ppl": 30.0, "contract": contract}}
    card = render_card(pruned, report=report, evaluation=embedded, base_model=BASE_MODEL)
    _, (result,) = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert (result.dataset_type, result.dataset_name, result.dataset_split) == (
        "text", "embedded:pydoc_data.topics", "evaluation")
    assert "ΔPPL" not in card.text


def test_card_validates_offline_and_loads_back(card, tmp_path):
    assert check_card(card) == []
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    assert loaded.data.to_dict() == card.data.to_dict()
    assert loaded.text == card.text
    broken = ModelCard(str(card).replace("library_name: transformers", "library_name: other"))
    assert check_card(broken) == ["library_name is 'other', expected 'transformers'"]


def test_write_card_files_plots_and_sidecars(pruned, report, tmp_path):
    written = write_card_files(tmp_path, pruned, report=report, evaluation=evaluation_of(pruned), base_model=BASE_MODEL)
    assert set(written) == {"README.md", REPORT_FILE, EVALUATION_FILE, PLOT_FILES["layer_scores"], PLOT_FILES["protocol_gap"]}
    for key in ("layer_scores", "protocol_gap"):
        data = (tmp_path / PLOT_FILES[key]).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"]({PLOT_FILES[key]})" in (tmp_path / "README.md").read_text()
    assert SwapReport.from_json(tmp_path / REPORT_FILE) == report
    ev = json.loads((tmp_path / EVALUATION_FILE).read_text())
    assert ev["pruned"]["ppl"] == 25.0 and ev["delta_ppl_percent"] == pytest.approx(25.0)
    assert check_card((tmp_path / "README.md").read_text(), tmp_path) == []
    (tmp_path / PLOT_FILES["protocol_gap"]).unlink()
    assert check_card((tmp_path / "README.md").read_text(), tmp_path) == [
        f"the card shows {PLOT_FILES['protocol_gap']} but the folder has no such file"
    ]


def test_planned_plots_follow_the_report():
    report = hand_report()
    assert planned_plots(report) == ["layer_scores", "protocol_gap"]
    wide = SwapReport(6, list(report.pairs), max_gap=2)
    assert planned_plots(wide) == ["layer_scores", "protocol_gap", "pair_heatmap"]
    one = SwapReport(6, list(report.pairs), protocols=("interchange",))
    assert planned_plots(one) == ["layer_scores"]
    assert planned_plots(None) == []


def test_report_must_belong_to_the_model(pruned, report):
    assert report_mismatches(pruned, report) == []
    short = SwapReport(5, [p for p in report.pairs if p.j < 5])
    assert report_mismatches(pruned, short) == ["the report scored 5 blocks but the model was pruned from 6 blocks"]
    changed = hand_report()
    changed.pairs[0].interchange = 0.31
    (problem,) = report_mismatches(pruned, changed)
    assert "interchange layer scores differ from those recorded in config.layerswap (step 0)" in problem
    with pytest.raises(ValueError, match="does not belong to this model"):
        render_card(pruned, report=short)
    unpruned = tiny_model("llama", 5)
    assert report_mismatches(unpruned, short) == []


def test_weight_fingerprint_ties_a_report_to_its_model(report):
    from hf_layerswap.layerplan import model_fingerprint

    scored = tiny_model("llama", 6, seed=0)
    stamped = SwapReport.from_dict(report.to_dict())
    stamped.metadata["model"] = {"fingerprint": model_fingerprint(scored)}
    assert report_mismatches(scored, stamped) == []
    (problem,) = report_mismatches(tiny_model("llama", 6, seed=1), stamped)
    assert "fingerprint" in problem and "(now): it was computed on other weights" in problem
    pruned = remove_layers(tiny_model("llama", 6, seed=1), [1, 3])
    pruned.config.layerswap["steps"][0]["fingerprint_before"] = model_fingerprint(tiny_model("llama", 6, seed=1))
    (problem,) = report_mismatches(pruned, stamped)
    assert "(before removal)" in problem


def test_normalize_evaluation_accepts_objects_and_dicts():
    class Result:
        def to_dict(self):
            return {"ppl": 12.5, "contract": {"split": "test"}}

    assert normalize_evaluation({"pruned": Result()}) == {"pruned": {"ppl": 12.5, "contract": {"split": "test"}}}
    with pytest.raises(ValueError, match=r"unknown keys \['after'\]"):
        normalize_evaluation({"after": {"ppl": 1.0}})
    with pytest.raises(ValueError, match=r"evaluation\['base'\]\['ppl'\] must be a finite positive number, got nan"):
        normalize_evaluation({"base": {"ppl": float("nan")}})
    with pytest.raises(TypeError, match="PerplexityResult or its dict, got int"):
        normalize_evaluation({"base": 3})


def test_config_only_card_and_explicit_removal(report):
    model = tiny_model("llama", 6)
    remove_layers(model, [2, 4])  # no provenance: explicit removal without a selection record
    card = render_card(model.config, report=report, base_model=BASE_MODEL)
    text = card.text
    before = sum(p.numel() for p in tiny_model("llama", 6).parameters())
    assert f"| Parameters | {before:,} → " in text  # counted on a meta-device instance of the config
    assert "| **removed** | **2, 4** | 0.027 |" in text
    assert "`remove_layers` was called without a selection record. It is the set the replacement protocol picks" in text
    assert "LayerSwapConfig(layers=[2, 4])" in text
    assert card.data.to_dict()["tags"] == ["layerswap", "layer-pruning"]


def test_a_removal_of_named_blocks_reproduces_without_a_protocol(report):
    # the blocks were named, so no protocol guided them: the card says "none recorded" and its
    # reproduce snippet must not name the config's default protocol either
    model = tiny_model("llama", 6)
    hl.prune_loaded_model(model, hl.LayerSwapConfig(layers=[2, 4]))
    text = render_card(model.config, report=report, base_model=BASE_MODEL).text
    assert "| Protocol guiding the removal | none recorded |" in text
    assert "quantization_config=LayerSwapConfig(layers=[2, 4])," in text


def test_the_scored_model_row_names_the_scored_base_not_the_last_model_loaded():
    """A pruned checkpoint pushed from its folder or repo: the report names the base it scored;
    the model as loaded names the pruned checkpoint, which was never scored."""
    report = hand_report()
    report.metadata["model"] = {"name": BASE_MODEL, "revision": "a1b2c3", "class": "LlamaForCausalLM"}
    model = pruned_tiny(report)
    model.layerswap_identity = {"name": "me/tiny-pruned-4L", "revision": "d4e5f6", "source": None}
    text = render_card(model, report=report).text
    assert f"| Scored model | {BASE_MODEL} @ a1b2c3 |" in text
    assert f"[{BASE_MODEL}](https://huggingface.co/{BASE_MODEL})" in text  # the base model, not the pruned repo
    # without a report: the base model the removal record names, never the pruned checkpoint itself
    model.config.layerswap["base_model"] = BASE_MODEL
    model.config.layerswap["steps"][0]["calibration"] = dict(report.metadata["calibration"])
    text = render_card(model).text
    assert f"| Scored model | {BASE_MODEL} |" in text and "tiny-pruned-4L" not in text.split("## Calibration")[-1]
    del model.config.layerswap["base_model"]
    assert "| Scored model |" not in render_card(model).text


def test_the_example_card_shows_what_the_default_path_publishes():
    """model_cards/smollm2-135m is regenerated by model_cards/regenerate.py through the default
    LayerSwapConfig; it fails here when the example and the default disagree on strategy."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "model_cards"
    decision = SwapReport.from_json(root / "smollm2-135m" / "layerswap_report.json").selections[-1]
    default = LayerSwapConfig()
    assert decision.get("strategy") == default.strategy
    assert decision.get("objective") == (default.objective or "removal_kl")
    removed = decision["selected"]
    card = (root / "smollm2-135m" / "README.md").read_text(encoding="utf-8")
    assert f"decoder blocks **{', '.join(map(str, removed))}** removed" in card
    listing = (root / "README.md").read_text(encoding="utf-8")
    assert f"blocks {removed[0]} and {removed[1]} removed" in listing


# ---------------------------------------------- non-finite scores in the card


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


@pytest.mark.parametrize("strategy", ["angular_distance", "block_influence", "sleb", "single_removal_kl"])
def test_a_strategy_that_reads_no_protocol_is_not_credited_to_one(strategy):
    # these criteria rank blocks on the model itself: the config's default protocol
    # ('interchange') did not guide the removal, so the card names none
    model = tiny_model("llama", 6)
    result = hl.prune(model, hl.LayerSwapConfig(num_to_remove=2, strategy=strategy, calibration=tiny_batch(),
                                                progress=False))
    assert result.report is None and model.layerswap_report is None  # it reads no swap-KL score: none measured
    text = render_card(model.config, report=result.report, base_model=BASE_MODEL).text
    assert f"| Protocol guiding the removal | none: strategy `{strategy}` reads no swap-KL score |" in text
    assert "swap-KL protocol." not in text.split("## What was removed")[0]
    # the card states what did not happen, and why; no empty table
    assert (f"## How the blocks were chosen\n\nNo swap-KL tables were measured for this removal: strategy `{strategy}` "
            "reads no swap-KL score, so the prune scored no pair of blocks") in text
    assert f"**Why this set:** strategy **{strategy}** ({strategy}, protect=[0, -1])." in text
    assert "## Swap-KL diagnostics" not in text and "s(i)" not in text
    assert render_card(model.config, report=result.report, base_model=BASE_MODEL).data.to_dict()["tags"] == [
        "layerswap", "layer-pruning"]


def test_a_re_prune_by_a_strategy_that_reads_no_protocol_is_not_credited_to_the_earlier_step_s_protocol():
    # greedy on interchange removes one block, then angular_distance (guided by no protocol) one
    # more: the last removal was guided by no protocol; the card does not name the first step's
    model = tiny_model("llama", 6)
    hl.prune(model, hl.LayerSwapConfig(num_to_remove=1, strategy="greedy", calibration=tiny_batch(), progress=False))
    result = hl.prune(model, hl.LayerSwapConfig(num_to_remove=1, strategy="angular_distance", calibration=tiny_batch(),
                                                progress=False))
    assert result.report is None and len(model.config.layerswap["steps"]) == 2
    text = render_card(model.config, report=result.report, base_model=BASE_MODEL).text
    assert "| Protocol guiding the removal | none: strategy `angular_distance` reads no swap-KL score |" in text
    assert "swap-KL protocol." not in text.split("## What was removed")[0]
    # the other way round, the last step (greedy on interchange) is credited to its protocol
    model = tiny_model("llama", 6)
    hl.prune(model, hl.LayerSwapConfig(num_to_remove=1, strategy="angular_distance", calibration=tiny_batch(),
                                       progress=False))
    result = hl.prune(model, hl.LayerSwapConfig(num_to_remove=1, strategy="greedy", calibration=tiny_batch(),
                                                progress=False))
    text = render_card(model.config, report=result.report, base_model=BASE_MODEL).text
    assert "| Protocol guiding the removal | interchange |" in text
    assert "using the **interchange** swap-KL protocol." in text


def test_score_protocols_measure_the_tables_for_a_strategy_that_reads_none():
    model = tiny_model("llama", 6)
    result = hl.prune(model, hl.LayerSwapConfig(num_to_remove=2, strategy="block_influence", calibration=tiny_batch(),
                                                score_protocols=["replacement", "interchange"], progress=False))
    assert result.report.protocols == ("replacement", "interchange") and len(result.report.pairs) == 5
    text = render_card(model.config, report=result.report, base_model=BASE_MODEL).text
    assert "## Swap-KL diagnostics" in text and "No swap-KL tables were measured" not in text
    assert "| Protocol guiding the removal | none recorded |" in text


def test_a_strategy_of_no_model_pass_is_described_by_its_registry_entry_not_as_measured(tmp_path):
    """A positional control (guided by no protocol, no model pass): the card's first sentence and
    its reason are the entry's card_summary and card_reason; nothing claims a measurement."""
    from hf_layerswap.selection.registry import NO_PROTOCOL, register_strategy

    summary = " by a positional rule: the last unprotected blocks, without any model pass."
    reason = "a positional control: the last unprotected blocks, chosen without reading the model or any score."

    @register_strategy("test_last_blocks", options=(), guided_by=NO_PROTOCOL, card_summary=summary,
                       card_reason=lambda record, kl, indices: reason,
                       cost=lambda plan: plan.counts(exact=True, note="no model pass"))
    def _last_blocks(report, n, *, protect, **_):
        return list(range(report.num_blocks - 1 - n, report.num_blocks - 1))

    model = tiny_model("llama", 6)
    result = hl.prune(model, hl.LayerSwapConfig(num_to_remove=2, strategy="test_last_blocks", progress=False))
    assert result.removed == [3, 4] and result.report is None and result.calibration is None
    folder = hl.save_for_hub(model, tmp_path / "card", base_model=BASE_MODEL)
    text = (folder / "README.md").read_text()
    assert check_card(text, folder) == [] and not (folder / "layerswap_report.json").exists()
    assert f"selected with `hf_layerswap`{summary}" in text
    assert f"**Why this set:** {reason}" in text
    assert "No swap-KL tables were measured for this removal: strategy `test_last_blocks` reads no swap-KL score" in text
    assert "`--score-protocols` on the command line" in text  # what a command-line user types, too
    # the reproduce line repeats what chose the blocks: no protocol guided them, so it names none
    assert "LayerSwapConfig(num_to_remove=2, strategy='test_last_blocks')" in text and "protocol=" not in text
    for claim in ("## Swap-KL diagnostics", "## Calibration", "## Cost of scoring", "calibration prompts",
                  "Joint removal KL", "swap-KL protocol."):
        assert claim not in text, claim


def test_a_repair_of_an_earlier_step_stays_on_the_card_after_a_later_cut(report):
    # step 0's fused map stays folded into the weights after step 1 removes another block,
    # though the top-level record now holds step 1 (no repair)
    model = tiny_model("llama", 6)
    hl.prune(model, hl.LayerSwapConfig(layers=[4], recovery="fused", calibration=tiny_batch(), progress=False))
    hl.prune(model, hl.LayerSwapConfig(layers=[2]))
    assert "recovery" not in model.config.layerswap
    text = render_card(model.config, base_model=BASE_MODEL).text
    rows = [line for line in text.splitlines() if line.startswith(("| 0 | 6 | 4 | 4 |", "| 1 | 5 | 2 | 2 |"))]
    assert len(rows) == 2
    assert rows[0].endswith("; cut repaired (`fused` recovery) |")
    assert "repaired" not in rows[1]


def test_the_card_metadata_carries_the_measured_perplexities_exactly(tmp_path):
    import copy

    from arch_matrix import tiny_tokenizer

    text = tmp_path / "wiki.test.raw"  # the WikiText-2 raw test file's name: the card names the dataset
    text.write_text("\n\n".join(" ".join(f"w{(7 * p + 3 * k) % 50} x" for k in range(30)) for p in range(8)) + "\n")
    tok = tiny_tokenizer()
    dense = tiny_model("llama", num_blocks=6, max_position_embeddings=512)
    base = hl.evaluate_perplexity(dense, str(text), tokenizer=tok, bootstrap=0, progress=False)
    model = remove_layers(copy.deepcopy(dense), [2, 3])
    pruned = hl.evaluate_perplexity(model, str(text), tokenizer=tok, bootstrap=0, progress=False)
    write_card_files(tmp_path / "card", model, evaluation={"base": base, "pruned": pruned}, base_model=BASE_MODEL)
    results = ModelCard.load(tmp_path / "card" / "README.md").data.eval_results
    assert {r.metric_name: r.metric_value for r in results} == {
        "Perplexity (this model)": pruned.ppl, "Perplexity (base model, same contract)": base.ppl}
    for r in results:
        assert (r.task_type, r.dataset_type, r.dataset_name, r.dataset_config, r.dataset_split, r.metric_type,
                r.metric_config) == ("text-generation", "wikitext", "WikiText-2 (raw)", "wikitext-2-raw-v1", "test",
                                     "perplexity", "matched")
        assert r.metric_args == {k: pruned.contract[k] for k in (
            "name", "words", "window", "stride", "scored_tokens", "dtype", "text_sha256")}
    # nothing measured: no model-index at all
    bare = render_card(model, base_model=BASE_MODEL)
    assert "model-index" not in bare.data.to_dict() and bare.data.eval_results is None
    assert "model-index" not in ModelCard(str(bare)).data.to_dict()


def test_the_card_states_the_strategy_options_given():
    model = tiny_model("llama", 6)
    hl.prune(model, hl.LayerSwapConfig(num_to_remove=1, strategy="beam", strategy_options={"width": 1},
                                       calibration=tiny_batch(), progress=False))
    text = render_card(model.config, base_model=BASE_MODEL).text
    assert ("| Strategy options | `width=1` (given); the others at their defaults: `seed_size=12`, "
            "`include_greedy=True` |") in text
    plain = tiny_model("llama", 6)
    hl.prune(plain, hl.LayerSwapConfig(num_to_remove=1, strategy="beam", calibration=tiny_batch(), progress=False))
    assert "Strategy options" not in render_card(plain.config, base_model=BASE_MODEL).text
