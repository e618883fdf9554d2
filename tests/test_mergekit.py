"""The mergekit round trip: a passthrough merge that drops the same blocks gives the same
checkpoint as remove_layers, and a checkpoint of ours that mergekit prunes further is
flagged as unverified history on load instead of being extended."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import tiny_batch, tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_layerswap as hl
from hf_layerswap.surgery.history import HistoryWarning
from hf_layerswap.surgery import check_surgery_invariants

pytest.importorskip("mergekit")


def _passthrough(source, ranges, out):
    """mergekit passthrough keeping the half-open block ranges of ``source``."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    spec = {
        "merge_method": "passthrough",
        "dtype": "float32",
        "slices": [{"sources": [{"model": str(source), "layer_range": list(r)}]} for r in ranges],
    }
    config = MergeConfiguration.model_validate(yaml.safe_load(yaml.safe_dump(spec)))
    run_merge(config, str(out), options=MergeOptions(copy_tokenizer=False, write_model_card=False, quiet=True))
    return out


def _tensors(folder):
    return load_file(str(folder / "model.safetensors"))


def test_passthrough_equals_remove_layers(tmp_path):
    base = tiny_model("llama", 6)
    base.save_pretrained(tmp_path / "base")
    ours = tiny_model("llama", 6)
    hl.remove_layers(ours, [1, 3])
    ours.save_pretrained(tmp_path / "ours")
    _passthrough(tmp_path / "base", [(0, 1), (2, 3), (4, 6)], tmp_path / "merged")

    a, b = _tensors(tmp_path / "ours"), _tensors(tmp_path / "merged")
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    assert merged.config.num_hidden_layers == 4
    batch = tiny_batch()
    with torch.no_grad():
        assert torch.equal(merged(**batch).logits, ours(**batch).logits)


def test_mergekit_repruning_our_checkpoint_is_flagged_not_extended(tmp_path):
    ours = tiny_model("llama", 6)
    hl.remove_layers(ours, [1, 3])  # kept: 0, 2, 4, 5
    ours.save_pretrained(tmp_path / "ours")
    _passthrough(tmp_path / "ours", [(0, 2), (3, 4)], tmp_path / "repruned")  # drops our block 2 (original 4)

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "repruned")
    assert plain.config.num_hidden_layers == 3
    assert plain.config.layerswap["kept_layers"] == [0, 2, 4, 5]  # mergekit copied our record unchanged
    assert check_surgery_invariants(plain)

    with pytest.warns(HistoryWarning, match="mergekit"):
        loaded = AutoModelForCausalLM.from_pretrained(
            tmp_path / "repruned", quantization_config=hl.LayerSwapConfig(layers=[1], progress=False)
        )
    record = loaded.config.layerswap
    assert record["history"] == "unverified"
    assert record["kept_layers"] == [0, 2] and record["removed_layers"] == [1]
    assert record["unverified_record"]["kept_layers"] == [0, 2, 4, 5]
    assert check_surgery_invariants(loaded) == []
