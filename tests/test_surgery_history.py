"""Removal history checked on load: a config.layerswap record that no longer describes the
model (another tool pruned or reordered its blocks) is flagged once, marked unverified and
never extended."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_batch, tiny_model
from torch import nn
from transformers import AutoModelForCausalLM

import hf_layerswap as hl
from hf_layerswap.card import render_card
from hf_layerswap.surgery.history import (
    HistoryWarning,
    history_problems,
    history_status,
    mark_history_unverified,
    verify_history,
)
from hf_layerswap.layerplan import model_fingerprint
from hf_layerswap.surgery import check_surgery_invariants


def _drop_block_outside(model, index: int):
    """What a passthrough merge does to our checkpoint: a block goes, config.layerswap stays."""
    blocks = model.model.layers
    model.model.layers = nn.ModuleList([b for i, b in enumerate(blocks) if i != index])
    model.config.num_hidden_layers = len(model.model.layers)
    for pos, block in enumerate(model.model.layers):
        block.self_attn.layer_idx = pos
    return model


def _swap_blocks(model, i: int, j: int):
    """Blocks reordered by another tool: the count matches, the weights do not."""
    blocks = list(model.model.layers)
    blocks[i], blocks[j] = blocks[j], blocks[i]
    model.model.layers = nn.ModuleList(blocks)
    for pos, block in enumerate(model.model.layers):
        block.self_attn.layer_idx = pos
    return model


@pytest.fixture
def pruned_dir(tmp_path):
    model = tiny_model("llama", 6)
    hl.remove_layers(model, [1, 3])
    model.save_pretrained(tmp_path / "pruned")
    return tmp_path / "pruned"


def test_own_checkpoint_verifies_after_reload(pruned_dir):
    model = AutoModelForCausalLM.from_pretrained(pruned_dir)
    record = model.config.layerswap
    assert record["kept_layers"] == [0, 2, 4, 5]
    assert record["steps"][-1]["fingerprint_after"] == model_fingerprint(model)
    assert record["steps"][-1]["dtype_after"] == "torch.float32"
    with warnings.catch_warnings():
        warnings.simplefilter("error", HistoryWarning)
        assert verify_history(model) is True
    assert history_status(model) == "verified"
    # a second removal extends the verified record in the original numbering
    hl.remove_layers(model, [1])
    assert model.config.layerswap["removed_layers"] == [1, 2, 3]
    assert model.config.layerswap["kept_layers"] == [0, 4, 5]
    assert check_surgery_invariants(model) == []
    # a bf16 reload cannot be compared by fingerprint and is not flagged for that
    bf16 = AutoModelForCausalLM.from_pretrained(pruned_dir, dtype=torch.bfloat16)
    assert history_problems(bf16) == []


def test_repruned_elsewhere_is_flagged_on_plugin_load(pruned_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(pruned_dir)
    _drop_block_outside(model, 2)  # original block 4 goes; the record still lists 4 kept blocks
    model.save_pretrained(tmp_path / "repruned")
    assert check_surgery_invariants(AutoModelForCausalLM.from_pretrained(tmp_path / "repruned"))  # the old gap

    with pytest.warns(HistoryWarning, match="mergekit") as caught:
        loaded = AutoModelForCausalLM.from_pretrained(
            tmp_path / "repruned", quantization_config=hl.LayerSwapConfig(layers=[1], progress=False)
        )
    assert len([w for w in caught if issubclass(w.category, HistoryWarning)]) == 1
    record = loaded.config.layerswap
    assert record["history"] == "unverified"
    assert "4 kept blocks but the model has 3" in record["unverified_reasons"][0]
    # the wrong record was not extended: numbering restarts at the checkpoint as loaded
    assert record["original_num_hidden_layers"] == 3
    assert record["removed_layers"] == [1]
    assert record["kept_layers"] == [0, 2]
    assert len(record["steps"]) == 1 and record["steps"][0]["removed_original_layers"] == [1]
    assert record["unverified_record"]["kept_layers"] == [0, 2, 4, 5]
    assert check_surgery_invariants(loaded) == []
    assert loaded.config.num_hidden_layers == 2

    # already unverified: no second warning, and the card says so
    with warnings.catch_warnings():
        warnings.simplefilter("error", HistoryWarning)
        assert verify_history(loaded) is False
    card = str(render_card(loaded))
    assert "Removal history unverified" in card
    assert "history: unverified" in card
    assert "not repeated as fact" in card

    # the unverified history survives save and reload
    loaded.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert history_status(again) == "unverified"
    assert history_problems(again) == []


def test_remove_layers_on_loaded_model_never_extends_a_wrong_record(pruned_dir):
    model = AutoModelForCausalLM.from_pretrained(pruned_dir)
    _drop_block_outside(model, 3)  # original block 5 goes
    with pytest.warns(HistoryWarning, match="block count changed outside hf_layerswap"):
        hl.remove_layers(model, [1])
    record = model.config.layerswap
    assert record["history"] == "unverified"
    assert record["kept_layers"] == [0, 2] and record["removed_layers"] == [1]
    assert 5 not in record["kept_layers"]


def test_reordered_blocks_fail_the_fingerprint(pruned_dir, tmp_path):
    model = _swap_blocks(AutoModelForCausalLM.from_pretrained(pruned_dir), 1, 2)
    problems = history_problems(model)
    assert len(problems) == 1 and "weights differ" in problems[0]
    ids = tiny_batch()
    with pytest.warns(HistoryWarning, match="weights changed after the removal was recorded"):
        assert verify_history(model) is False
    assert model.config.layerswap["kept_layers"] == [0, 1, 2, 3]
    with torch.no_grad():
        assert torch.isfinite(model(**ids).logits).all()


def test_publishing_refuses_a_wrong_record_as_verified(pruned_dir, tmp_path):
    model = _swap_blocks(AutoModelForCausalLM.from_pretrained(pruned_dir), 1, 2)
    with pytest.raises(hl.PushRefusedError, match="cannot be published as verified.*mark_history_unverified"):
        hl.save_for_hub(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    mark_history_unverified(model)
    hl.save_for_hub(model, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Removal history unverified" in card and "weights differ" in card


def test_a_hand_edited_removed_list_is_refused_before_publishing(pruned_dir, tmp_path, capsys):
    """config.json edited to claim blocks 1, 2 removed where the steps (and the weights) say
    1, 3: kept and removed still make up 0..5, so only replaying the steps catches it."""
    import json

    from hf_layerswap.cli import main

    config = json.loads((pruned_dir / "config.json").read_text())
    assert config["layerswap"]["steps"][0]["removed_original_layers"] == [1, 3]
    config["layerswap"].update(removed_layers=[1, 2], kept_layers=[0, 3, 4, 5])
    (pruned_dir / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(pruned_dir)
    assert history_problems(model) == [
        "config.layerswap lists removed blocks [1, 2] but its removal steps removed [1, 3] (original numbering)"
    ]
    with pytest.raises(hl.PushRefusedError, match=r"cannot be published as verified.*removal steps removed \[1, 3\]"):
        hl.save_for_hub(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    code = main(["push", str(pruned_dir), "me/edited", "--output-dir", str(tmp_path / "pushed")])
    assert code == 2 and not (tmp_path / "pushed").exists()
    assert "its removal steps removed [1, 3]" in capsys.readouterr().err
    # a step whose own indices disagree is named too
    model.config.layerswap.update(removed_layers=[1, 3], kept_layers=[0, 2, 4, 5])
    model.config.layerswap["steps"][0]["removed_original_layers"] = [1, 2]
    assert history_problems(model) == [
        "removal step 0 removed blocks [1, 3] of 6, which are original blocks [1, 3], but it records original blocks [1, 2]"
    ]
