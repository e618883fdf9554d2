"""Surgery: remove_layers on tiny Llama, Qwen3 (sliding/full) and Gemma3 models keeps
the invariants and the per-layer config, the pruned model's KL equals the removal KL that
scoring measured, generation with and without cache agree, and plain transformers reloads
the checkpoint (in a process without hf_layerswap) with identical logits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_batch, tiny_model

import hf_layerswap as hl
from hf_layerswap.scoring import masked_kl, removal_kl
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
        ref = torch.log_softmax(model(**batch, use_cache=False).logits.float(), -1)
    old_types = list(getattr(model.config, "layer_types", []) or [])
    hl.remove_layers(model, [1, 3])
    assert check_surgery_invariants(model) == []
    if old_types:
        assert model.config.layer_types == [old_types[i] for i in (0, 2, 4, 5)]
    assert model.config.layerswap["removed_layers"] == [1, 3]
    with torch.no_grad():
        pruned_logits = model(**batch, use_cache=False).logits
    # the removal KL from scoring equals the KL measured on the actually pruned model
    assert masked_kl(ref, pruned_logits, batch["attention_mask"]).mean().item() == pytest.approx(expected_kl, rel=1e-6)
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
