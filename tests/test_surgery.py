"""Surgery: remove_layers on tiny Llama, Qwen3 (sliding/full) and Gemma3 models keeps
the invariants and the per-layer config, the pruned model's KL equals the removal KL that
scoring measured, generation with and without cache agree, and plain transformers reloads
the checkpoint (in a process without hf_layerswap) with identical logits; bad indices and
provenance are refused by name and leave the model as it was."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from arch_matrix import NUM_BLOCKS, build
from conftest import assert_model_unchanged, snapshot_model, tiny_batch, tiny_model

import hf_layerswap as hl
from hf_layerswap import LayerSwapConfig, prune_loaded_model, remove_layers
from hf_layerswap.scoring import removal_kl
from hf_layerswap.surgery import check_surgery_invariants


SUBPROCESS_RELOAD = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    path, ids, mask = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert "hf_layerswap" not in sys.modules
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    torch.save({"logits": logits, "num_blocks": len(model.model.layers)}, path + "/reloaded.pt")
    """
)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_surgery_generate_and_plain_reload(family, tmp_path):
    model = tiny_model(family)
    batch = tiny_batch()
    expected_kl = removal_kl(model, batch, [1, 3])
    with torch.no_grad():
        ref = torch.log_softmax(model(**batch, use_cache=False).logits.double(), -1)
    old_types = list(getattr(model.config, "layer_types", []) or [])
    hl.remove_layers(model, [1, 3])
    assert check_surgery_invariants(model) == []
    if old_types:
        assert model.config.layer_types == [old_types[i] for i in (0, 2, 4, 5)]
    assert model.config.layerswap["removed_layers"] == [1, 3]
    with torch.no_grad():
        pruned_logits = model(**batch, use_cache=False).logits
    # the removal KL from scoring equals the KL measured on the actually pruned model, both in float64
    # (the engine sums in float64: an fp32 log-softmax would differ by its own rounding)
    lq = torch.log_softmax(pruned_logits.double(), -1)
    mask = batch["attention_mask"].bool()
    per_position = (ref.exp() * (ref - lq)).sum(-1)
    measured = ((per_position * mask).sum(1) / mask.sum(1)).mean().item()
    assert measured == pytest.approx(expected_kl, rel=1e-9)
    prompt = batch["input_ids"][:1, :5]
    with_cache = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    without = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False)
    assert torch.equal(with_cache, without)

    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 4
    subprocess.run(
        [sys.executable, "-c", SUBPROCESS_RELOAD, str(tmp_path),
         json.dumps(batch["input_ids"].tolist()), json.dumps(batch["attention_mask"].tolist())],
        check=True,
    )
    out = torch.load(tmp_path / "reloaded.pt")
    assert out["num_blocks"] == 4
    assert torch.equal(out["logits"], pruned_logits)


# ---------------------------- refused indices and provenance: nothing changes


BAD_INDICES = [
    ([6], "layer index 6 is out of range for a model with 6 blocks: allowed 0..5 (or -6..-1 from the end)"),
    ([0, 99], "layer index 99 is out of range"),
    ([-7], "layer index -7 is out of range"),
    ([1, 1], "duplicate layer indices [1] in [1, 1]"),
    ([1, -5], "duplicate layer indices [1] in [1, -5] (after resolving negative indices)"),
    ([], "no layer indices given"),
    (list(range(NUM_BLOCKS)), "would leave no block: at most 5 of 6 can go"),
    ([-6, -5, -4, -3, -2, -1], "would leave no block"),
]


@pytest.mark.parametrize(("layers", "message"), BAD_INDICES, ids=[str(x[0]) for x in BAD_INDICES])
def test_bad_removal_indices_are_refused_and_change_nothing(layers, message):
    model = build("llama")
    snap = snapshot_model(model)
    with pytest.raises(ValueError) as err:
        remove_layers(model, layers)
    assert message in str(err.value)
    assert_model_unchanged(model, snap)
    if layers:  # the load-time path gives the same error (an empty list is refused by the config itself)
        with pytest.raises(ValueError) as err2:
            prune_loaded_model(model, LayerSwapConfig(layers=layers))
        assert str(err2.value) == str(err.value)
        assert_model_unchanged(model, snap)


@pytest.mark.parametrize("layers", [[True], [1.0], ["1"], 2, "12"])
def test_non_integer_indices_are_type_errors(matrix_llama, layers):
    with pytest.raises(TypeError, match=r"int"):
        remove_layers(matrix_llama, layers)


def test_a_generator_of_indices_is_reported_as_given():
    with pytest.raises(ValueError) as err:
        remove_layers(build("llama"), (i for i in (2, 2)))
    assert str(err.value) == "duplicate layer indices [2] in [2, 2] (after resolving negative indices)"


@pytest.mark.parametrize(
    ("provenance", "kind", "message"),
    [
        ("by hand", TypeError, "provenance must be a dict of JSON-able facts, got str"),
        ({"removed_layers": [4]}, ValueError,
         "provenance keys ['removed_layers'] are computed by remove_layers and cannot be given"),
        ({"note": {1, 2}}, TypeError,
         "provenance must be JSON-able (it is saved in config.json): Object of type set is not JSON serializable"),
    ],
    ids=["str", "reserved", "not-json"],
)
def test_bad_provenance_is_refused_before_the_model_changes(provenance, kind, message):
    model = build("llama")
    snap = snapshot_model(model)
    with pytest.raises(kind) as err:
        remove_layers(model, [1], provenance=provenance)
    assert str(err.value) == message
    assert_model_unchanged(model, snap)
    assert getattr(model.config, "layerswap", None) is None
