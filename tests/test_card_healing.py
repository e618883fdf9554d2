"""The card's healing section (hf_layerswap.card.healing): a healing run is never shown
without its before and after numbers, one that ended worse than it started is marked, and
older records and stale runs still render."""

from __future__ import annotations

import hf_layerswap as hl
from conftest import tiny_model
from hf_layerswap.card import render_card
from hf_layerswap.card.healing import healing_eval_results, healing_section, tasks_table

REMOVED = [2, 3]


def _entry(**extra):
    return {"method": "lora", "tokens": 10, "steps": 1, "kl_before": 0.2, "kl_after": 0.15, **extra}


def test_healing_without_its_numbers_is_flagged_never_shown_as_an_improvement():
    bare = healing_section({"healing": [{"method": "lora", "tokens": 10, "steps": 1}]})
    assert "not recorded: this healing cannot be judged (no finite held-out KL before and after: — → —)" in bare
    nan = healing_section({"healing": [_entry(kl_after=float("nan"))]})
    assert "cannot be judged" in nan and "nats/token (" not in nan
    worse = healing_section({"healing": [_entry(kl_after=0.25)]})
    assert "0.2000 → 0.2500 nats/token (+25.0%); **worse than before healing**" in worse
    no_end = healing_section({"healing": [_entry(perplexity={"dense": 10.0, "after_cut": 30.0, "start": "after_cut",
                                                               "contract": "matched"})]})
    assert "| Perplexity after healing | not measured |" in no_end
    assert "cannot be judged on perplexity (no value before and after)" in no_end
    ppl_worse = healing_section({"healing": [_entry(perplexity={"dense": 10.0, "after_cut": 30.0, "after_healing": 33.0,
                                                                  "start": "after_cut", "contract": "matched"})]})
    assert ("| Perplexity after healing | 33.000 (+230.0% vs the dense model); +10.0% vs the start of healing (after "
            "the cut): **worse than before healing** |") in ppl_worse
    one_side = tasks_table({"before": {"t": {"acc": 0.5}}})
    assert "cannot be judged" in one_side and "0.5000" not in one_side
    assert tasks_table({}) is None


def test_older_before_after_record_and_stale_marking_still_render():
    record = {"healing": [_entry(perplexity={"before": 30.0, "after": 24.0, "contract": "matched"})],
              "recovery": {"method": "ghosted"}}
    text = healing_section(record)
    assert "| Perplexity after the repair (ghosted) | 30.000 |" in text
    assert "| Perplexity after healing | 24.000; -20.0% vs the start of healing (after the repair) |" in text
    assert "| Perplexity of the dense model (the teacher) | not measured |" in text
    student = hl.remove_layers(tiny_model("llama", num_blocks=6), REMOVED)
    student.config.layerswap["healing"] = [_entry(perplexity={"dense": 10.0, "after_cut": 30.0, "after_healing": 20.0,
                                                              "start": "after_cut", "contract": "matched"})]
    hl.remove_layers(student, [1])
    text = healing_section(student.config.layerswap)
    assert "| Perplexity after healing | 20.000 (+100.0% vs the dense model); -33.3% vs the start" in text
    # numbered as the card's steps table numbers them: steps 0 and 1, the later cut is step 1
    assert "**stale**: removal step 1 came after this healing" in text
    card = render_card(student).text
    assert "| 0 | 6 | 2, 3 | 2, 3 |" in card and "| 1 | 4 | 1 | 1 |" in card
    assert "**stale**: removal step 1 came after this healing" in card


def test_malformed_or_empty_records_render_as_cannot_be_judged():
    judged = "lm-eval tasks: not recorded before and after healing: these task results cannot be judged and are not shown."
    assert tasks_table({"before": {}, "after": {}}) == judged
    assert tasks_table({"before": {"t": 0.5}, "after": {"t": 0.6}}) == judged
    one_sided = tasks_table({"before": {"t": {"acc": 0.5}}, "after": {"t": 0.6}})
    assert "| t | acc | 0.5000 | — | cannot be judged |" in one_sided
    card = healing_section({"healing": [_entry(tokens=None, perplexity=[1, 2])]})
    assert "| Training | — tokens, 1 steps," in card
    assert "| Perplexity before → after healing | not recorded in a readable form: this healing cannot be judged" in card


def test_a_bool_in_a_numeric_field_is_never_printed_as_a_value():
    """``True`` where a perplexity stage, a loss or a setting belongs is no measurement: the card
    says so instead of printing ``True`` (or ``1.0000`` nats)."""
    card = healing_section({"healing": [_entry(final_loss=True, learning_rate=True, seed=False,
                                               perplexity={"dense": 10.0, "after_cut": True, "after_healing": 9.0,
                                                           "start": "after_cut", "contract": "matched"})]})
    assert "True" not in card and "False" not in card
    assert "| Perplexity after the cut | not recorded as a number: cannot be judged |" in card
    assert "| Final training loss | — nats/token |" in card
    assert "learning rate —, seed —" in card
    assert "| Perplexity after healing | 9.000 (-10.0% vs the dense model) |" in card
    assert "cannot be judged on perplexity (no value before and after)" in card
    nan = healing_section({"healing": [_entry(perplexity={"dense": 10.0, "after_cut": float("nan"), "after_healing": 9.0,
                                                            "start": "after_cut", "contract": "matched"})]})
    assert "| Perplexity after the cut | nan |" in nan


def test_task_results_that_got_worse_are_marked_like_kl_and_perplexity():
    """A task metric that moved the wrong way after healing is marked as the KL and the
    perplexity are: by lm-eval's recorded ``higher_is_better``, else the metric's standard
    direction; a metric of unknown direction is not judged."""
    tasks = {"before": {"mc": {"acc": 0.5, "acc_stderr": 0.1, "acc_norm": 0.4}, "roll": {"word_perplexity": 30.0},
                        "custom": {"score": 2.0}},
             "after": {"mc": {"acc": 0.25, "acc_stderr": 0.1, "acc_norm": 0.6}, "roll": {"word_perplexity": 33.0},
                       "custom": {"score": 1.0}},
             "higher_is_better": {"mc": {"acc": True, "acc_norm": True}, "roll": {"word_perplexity": False}}}
    table = tasks_table(tasks)
    assert "| mc | acc | 0.5000 ± 0.1000 | 0.2500 ± 0.1000 | -0.2500; **worse than before healing** |" in table
    assert "| mc | acc_norm | 0.4000 | 0.6000 | +0.2000 |" in table
    assert "| roll | word_perplexity | 30.0000 | 33.0000 | +3.0000; **worse than before healing** |" in table
    assert "| custom | score | 2.0000 | 1.0000 | -1.0000 |" in table
    older = tasks_table({k: v for k, v in tasks.items() if k != "higher_is_better"})
    assert "| mc | acc | 0.5000 ± 0.1000 | 0.2500 ± 0.1000 | -0.2500; **worse than before healing** |" in older
    assert "| roll | word_perplexity | 30.0000 | 33.0000 | +3.0000; **worse than before healing** |" in older
    flipped = tasks_table({**tasks, "higher_is_better": {"custom": {"score": True}}})
    assert "| custom | score | 2.0000 | 1.0000 | -1.0000; **worse than before healing** |" in flipped
    card = healing_section({"healing": [_entry(tasks=tasks)]})
    assert "-0.2500; **worse than before healing**" in card


def test_the_metadata_carries_each_measured_healing_perplexity_under_its_row_name():
    contract = {"contract": "matched", "text": "file:wiki.test.raw", "text_sha256": "ab", "window": 512, "stride": 256,
                "words": 5000}
    first = _entry(perplexity={"dense": 10.5, "after_cut": 30.25, "after_repair": float("nan"), "after_healing": 20.125,
                               "start": "after_repair", "repair": "ghosted", **contract}, stale="a later step")
    second = _entry(perplexity={"dense": 10.5, "after_earlier_healing": 21.0, "after_healing": None,
                                "start": "after_earlier_healing", "earlier_healing": 1, **contract})
    results = healing_eval_results({"healing": [first, second], "recovery": {"method": "ghosted"}})
    assert [(r.metric_name, r.metric_value) for r in results] == [
        ("Healing run 1: Perplexity of the dense model (the teacher)", 10.5),
        ("Healing run 1: Perplexity after the cut", 30.25),
        ("Healing run 1: Perplexity after healing (stale: a later step changed the model)", 20.125),
        ("Healing run 2: Perplexity of the dense model (the teacher)", 10.5),
        ("Healing run 2: Perplexity after healing run 1 (where this run started)", 21.0),
    ]  # nan and None: not measured, no entry
    assert {(r.dataset_name, r.dataset_config, r.dataset_split, r.metric_config) for r in results} == {
        ("WikiText-2 (raw)", "wikitext-2-raw-v1", "test", "matched")}
    assert results[0].metric_args == {"name": "matched", "words": 5000, "window": 512, "stride": 256, "text_sha256": "ab"}
    single = healing_eval_results({"healing": [_entry(perplexity={"after_cut": 30.0, "after_healing": 24.0,
                                                                   "start": "after_cut", "contract": "matched"})]})
    assert [(r.metric_name, r.metric_value) for r in single] == [
        ("Perplexity after the cut", 30.0), ("Perplexity after healing (this model)", 24.0)]
    assert healing_eval_results({"healing": [_entry()]}) == []
