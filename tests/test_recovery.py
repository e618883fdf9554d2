"""Recovery of the cut: Ghosted Layers' closed-form operator and the fused (ReplaceMe-style)
variant folded into down_proj, and the calibration shortfall it warns of. Tiny random
models, plus one real-model test on SmolLM2-135M."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from arch_matrix import build
from conftest import PARAGRAPHS, assert_model_unchanged, snapshot_model, tiny_batch, tiny_checkpoint, tiny_model
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

import hf_layerswap as hl  # (the import registers the layerswap plugin, as a user would)
from hf_layerswap.calibration import build_calibration
from hf_layerswap.cli import main as hl_cli_main
from hf_layerswap.models import load_model
from hf_layerswap.layerplan import decoder_blocks, num_blocks
from hf_layerswap.recovery import (
    MAX_EPSILON,
    RecoveryReport,
    check_epsilon,
    cut_boundaries,
    recover,
    ridge_toward_identity,
)
from hf_layerswap.recovery.hadamard import hadamard_matrix, hadamard_rotation
from hf_layerswap.surgery import RECOVERY_FILE, attach_saved_recovery, attached_operators, detach_recovery
from hf_layerswap.surgery.operators import attach_operator
from hf_layerswap.scoring import masked_kl


def random_prompts(num: int, length: int, seed: int, pad_last: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (num, length), generator=g)
    mask = torch.ones(num, length, dtype=torch.long)
    mask[-1, length - pad_last :] = 0
    ids[-1, length - pad_last :] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def calib():
    """32 x 24 random prompts: 763 real tokens, far more than the tiny hidden size 32."""
    return build_calibration(random_prompts(32, 24, seed=3), num_prompts=32)


@pytest.fixture(scope="module")
def held_out():
    return random_prompts(16, 24, seed=9)


def logits_of(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch, use_cache=False).logits


def mean_kl(dense, pruned, batch) -> float:
    ref = torch.log_softmax(logits_of(dense, batch).float(), -1)
    return masked_kl(ref, logits_of(pruned, batch), batch["attention_mask"]).mean().item()


# --------------------------------------------------------------------------- algebra


def test_closed_form_equals_lstsq_on_random_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 8, generator=g, dtype=torch.float64)
    y = torch.randn(300, 8, generator=g, dtype=torch.float64)
    w, lam, cond = ridge_toward_identity(x.T @ x, x.T @ y, 0.0)
    assert lam == 0.0
    assert torch.allclose(w, torch.linalg.lstsq(x, y).solution, atol=1e-10)
    assert cond == pytest.approx(float(torch.linalg.cond(x.T @ x)), rel=1e-8)
    # ridge toward the identity = least squares on X stacked over sqrt(lambda) I, target Y over sqrt(lambda) I
    w, lam, _ = ridge_toward_identity(x.T @ x, x.T @ y, 0.1)
    assert lam == pytest.approx(0.1 * float(torch.trace(x.T @ x)) / 8)
    root = lam**0.5 * torch.eye(8, dtype=torch.float64)
    expected = torch.linalg.lstsq(torch.cat([x, root]), torch.cat([y, root])).solution
    assert torch.allclose(w, expected, atol=1e-10)


def test_exactly_linear_data_is_recovered_exactly():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 16, generator=g, dtype=torch.float64)
    a = torch.eye(16, dtype=torch.float64) + 0.3 * torch.randn(16, 16, generator=g, dtype=torch.float64)
    w, _, _ = ridge_toward_identity(x.T @ x, x.T @ (x @ a), 0.0)
    assert torch.allclose(w, a, atol=1e-10)


def test_singular_system_is_refused():
    x = torch.randn(4, 8, dtype=torch.float64)  # 4 tokens cannot span 8 dimensions
    with pytest.raises(ValueError, match="singular"):
        ridge_toward_identity(x.T @ x, x.T @ x, 0.0)


def test_the_largest_epsilon_gives_the_identity_and_larger_ones_are_refused():
    """At epsilon = 2**52 the ridge λ = epsilon · trace(XᵀX)/H swamps XᵀX to float64 rounding:
    W = I (plain removal). 1e308 used to reach torch's eigensolver (LinAlgError) and inf
    passed the config to fail after the weights had loaded."""
    g = torch.Generator().manual_seed(2)
    x = 30 * torch.randn(200, 16, generator=g, dtype=torch.float64)
    y = x @ (torch.eye(16, dtype=torch.float64) + torch.randn(16, 16, generator=g, dtype=torch.float64))
    w, lam, cond = ridge_toward_identity(x.T @ x, x.T @ y, MAX_EPSILON)
    assert MAX_EPSILON == 2.0**52 and lam == MAX_EPSILON * float(torch.trace(x.T @ x)) / 16
    assert float((w - torch.eye(16, dtype=torch.float64)).abs().max()) < 1e-14 and cond == pytest.approx(1.0)
    assert check_epsilon(MAX_EPSILON) == MAX_EPSILON and check_epsilon(0) == 0.0
    for bad in (1e308, float("inf"), float("nan"), -1.0, MAX_EPSILON * (1 + 2**-52), True, "0.1"):
        with pytest.raises(ValueError, match=r"must be a finite float >= 0 and at most 2\*\*52"):
            check_epsilon(bad)


def test_cut_boundaries():
    cuts = cut_boundaries(8, [5, 0, 1, 4])
    assert [(c["removed"], c["host"], c["boundary"], c["end"]) for c in cuts] == [
        ([0, 1], None, 0, 2),
        ([4, 5], 3, 2, 6),
    ]
    assert cut_boundaries(8, [-1])[0] == {"removed": [7], "start": 7, "end": 8, "host": 6, "boundary": 7}


# --------------------------------------------------------------------------- exact recovery of linear blocks


class LinearBlock(nn.Module):
    """A decoder block whose update is a known linear map of the residual stream: h -> h A."""

    def __init__(self, a: torch.Tensor):
        super().__init__()
        self.register_buffer("a", a)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states @ self.a


def _near_identity(size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.eye(size) + 0.2 * torch.randn(size, size, generator=g) / size**0.5


def test_ghosted_recovers_linear_blocks_and_multiplies_at_shared_boundary(calib, held_out):
    dense = tiny_model("llama")
    blocks = decoder_blocks(dense)[2]
    a2, a3, a5 = _near_identity(32, 2), _near_identity(32, 3), _near_identity(32, 5)
    blocks[2], blocks[3], blocks[5] = LinearBlock(a2), LinearBlock(a3), LinearBlock(a5)
    pruned = copy.deepcopy(dense)
    report = recover(pruned, [2, 3, 5], calib, method="ghosted", epsilon=0.0)
    ops = dict(attached_operators(pruned))
    assert sorted(ops) == [2, 3]  # cut 2..3 acts after pruned block 1, cut 5 after the new last block
    assert torch.allclose(ops[2].weight, a2 @ a3, atol=2e-5)
    assert torch.allclose(ops[3].weight, a5, atol=2e-5)
    assert [f.residual_after for f in report.boundaries] == pytest.approx([0, 0], abs=1e-5)
    assert all(f.residual_before > 0.05 for f in report.boundaries)
    assert torch.allclose(logits_of(pruned, held_out), logits_of(dense, held_out), atol=1e-4)


class MlpLinearBlock(nn.Module):
    """A block whose update is a known linear map of the previous block's MLP output:
    h -> h + m K (m read from a hook on the previous block's down_proj)."""

    def __init__(self, k: torch.Tensor, stash: dict):
        super().__init__()
        self.register_buffer("k", k)
        self.stash = stash

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states + self.stash["m"] @ self.k


def test_fused_recovers_a_map_on_the_mlp_output_exactly(calib, held_out):
    dense = tiny_model("llama")
    blocks = decoder_blocks(dense)[2]
    stash = {}
    blocks[2].mlp.down_proj.register_forward_hook(lambda mod, args, out: stash.__setitem__("m", out))
    k = _near_identity(32, 7) - torch.eye(32)
    blocks[3] = MlpLinearBlock(k, stash)
    expected = logits_of(dense, held_out)
    pruned = dense  # no deepcopy: the hook and the block share ``stash``
    before = pruned.model.layers[2].mlp.down_proj.weight.detach().clone()
    report = recover(pruned, [3], calib, method="fused", epsilon=0.0)
    (fit,) = report.boundaries
    assert fit.folded_into == "layers.2.mlp.down_proj" and fit.residual_after == pytest.approx(0, abs=1e-5)
    t = torch.eye(32) + k
    assert torch.allclose(pruned.model.layers[2].mlp.down_proj.weight, t.T @ before, atol=2e-5)
    assert attached_operators(pruned) == [] and pruned.config.num_hidden_layers == 5
    assert torch.allclose(logits_of(pruned, held_out), expected, atol=1e-4)


# --------------------------------------------------------------------------- behaviour on real (random) blocks


@pytest.mark.parametrize("method", ["ghosted", "fused", "linearpatch"])
def test_removing_zero_layers_changes_nothing(calib, method):
    model = tiny_model("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    report = recover(model, [], calib, method=method)
    assert report.boundaries == [] and report.num_tokens == 0
    assert model.config.to_dict() == config and attached_operators(model) == []
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert "save_pretrained" not in vars(model)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_ghosted_beats_plain_removal_on_held_out_kl(family, calib, held_out):
    dense = tiny_model(family)
    results = {}
    for method in ("none", "ghosted"):
        model = copy.deepcopy(dense)
        report = recover(model, [1, 4], calib, method=method)
        results[method] = (mean_kl(dense, model, held_out), report)
    (kl_none, plain), (kl_ghosted, ghosted) = results["none"], results["ghosted"]
    assert kl_ghosted < 0.9 * kl_none
    assert [f.residual_before for f in ghosted.boundaries] == pytest.approx([f.residual_before for f in plain.boundaries])
    for fit in ghosted.boundaries:  # W = I is feasible, so the fit never does worse than removal
        assert fit.residual_after < fit.residual_before
        assert fit.condition_number >= 1.0 and len(fit.ridge) == 1
    assert ghosted.num_tokens == calib.num_tokens == 763


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_fit_and_config_record(family, calib):
    model = tiny_model(family)
    report = recover(model, [2, 3], calib, method="fused")
    (fit,) = report.boundaries
    assert fit.residual_after < fit.residual_before
    record = model.config.layerswap["recovery"]
    assert record["method"] == "fused" and record["boundaries"] == [2] and record["removed_layers"] == [2, 3]
    assert record["folded_into"] == ["layers.1.mlp.down_proj"] and record["num_tokens"] == 763
    assert model.config.num_hidden_layers == 4 and attached_operators(model) == []


def test_token_budget_truncates_in_prompt_order(calib):
    model = tiny_model("llama")
    report = recover(model, [2], calib, method="ghosted", num_tokens=100)
    assert report.num_tokens == 100
    assert model.config.layerswap["recovery"]["num_tokens"] == 100


def test_bad_arguments_are_refused_and_change_nothing(calib):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="method='shadow'"):
        recover(model, [2], calib, method="shadow")
    with pytest.raises(ValueError, match="epsilon=-1"):
        recover(model, [2], calib, epsilon=-1)
    with pytest.raises(ValueError, match=r"epsilon=1e\+308: must be a finite float >= 0 and at most 2\*\*52"):
        recover(model, [2], calib, epsilon=1e308)  # not torch's LinAlgError after the calibration pass
    with pytest.raises(ValueError, match="out of range"):
        recover(model, [6], calib)
    assert model.config.num_hidden_layers == 6 and "layerswap" not in model.config.to_dict()
    recover(model, [2], calib)
    with pytest.raises(ValueError, match="already carries ghosted"):
        recover(model, [1], calib)


def test_fused_refuses_post_norm_and_no_down_proj(calib):
    gemma = tiny_model("gemma3")
    with pytest.raises(ValueError, match=r"gemma3_text block 1 .*post-norm"):
        recover(gemma, [2], calib, method="fused")
    assert gemma.config.num_hidden_layers == 6
    gpt2 = build("gpt2", num_blocks=4)
    with pytest.raises(ValueError, match="gpt2 block 1 .*no mlp.down_proj"):
        recover(gpt2, [2], calib, method="fused")
    assert len(gpt2.transformer.h) == 4


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_generation_with_cache_equals_without_cache(family, calib):
    model = tiny_model(family)
    recover(model, [0, 3], calib, method="ghosted")  # a pre-hook on block 0 and a hook after block 1
    assert [b for b, _ in attached_operators(model)] == [0, 2]
    prompt = tiny_batch()["input_ids"][:1, :5]
    with_cache = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
    without = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(with_cache, without)
    # the incremental (cached) logits equal the full-sequence logits
    full = logits_of(model, {"input_ids": with_cache})
    with torch.no_grad():
        out = model(input_ids=with_cache[:, :-1], use_cache=True)
        step = model(input_ids=with_cache[:, -1:], cache=out.cache, use_cache=True).logits
    assert torch.allclose(step[:, -1], full[:, -1], atol=1e-5)


def test_operator_stays_float32_and_detach_gives_plain_removal(calib, held_out):
    dense = tiny_model("llama")
    plain = copy.deepcopy(dense)
    recover(plain, [2], calib, method="none")
    model = copy.deepcopy(dense)
    recover(model, [2], calib, method="ghosted")
    assert model.config.layerswap["recovery"]["boundaries"] == [2]
    copied = copy.deepcopy(model)  # hooks travel with the copy
    assert torch.equal(logits_of(copied, held_out), logits_of(model, held_out))
    copied.to(torch.bfloat16)
    ((_, op),) = attached_operators(copied)
    assert op.weight.dtype == torch.float32 and logits_of(copied, held_out).dtype == torch.bfloat16
    assert detach_recovery(model) == 1
    assert "recovery" not in model.config.layerswap and "save_pretrained" not in vars(model)
    assert torch.equal(logits_of(model, held_out), logits_of(plain, held_out))


def test_report_round_trip(calib, tmp_path):
    model = tiny_model("llama")
    report = recover(model, [0, 3, 4], calib, method="ghosted")
    assert [f.boundary for f in report.boundaries] == [0, 2]
    assert len(report.boundaries[1].ridge) == 2  # one solve per removed block, product at the boundary
    again = RecoveryReport.from_json(report.to_json(tmp_path / "r.json"))
    assert again == report and again.to_dict() == report.to_dict()


# --------------------------------------------------------------------------- save / reload


def test_ghosted_save_and_reload_with_hf_layerswap(calib, held_out, tmp_path):
    model = tiny_model("qwen3")
    recover(model, [1, 4], calib, method="ghosted")
    expected = logits_of(model, held_out)
    model.save_pretrained(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert (tmp_path / "ckpt" / RECOVERY_FILE).is_file()
    assert saved["layerswap"]["recovery"]["boundaries"] == [1, 3]
    assert saved["quantization_config"] == {"quant_method": "layerswap", "recovery": "ghosted", "layers": [1, 4]}
    assert len(saved["layerswap"]["recovery"]["sha256"]) == 64

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="eager")
    assert [b for b, _ in attached_operators(reloaded)] == [1, 3]  # the plugin re-attached them on load
    assert attach_saved_recovery(reloaded) == [1, 3]  # idempotent
    assert reloaded.config.num_hidden_layers == 4 and not getattr(reloaded, "is_quantized", False)
    assert torch.equal(logits_of(reloaded, held_out), expected)
    # a second save of the reloaded model writes the same operators
    reloaded.save_pretrained(tmp_path / "again")
    first, second = (load_file(tmp_path / d / RECOVERY_FILE) for d in ("ckpt", "again"))
    assert sorted(first) == ["boundary_1", "boundary_3"]
    assert all(torch.equal(first[k], second[k]) and first[k].dtype == torch.float32 for k in first)


def test_load_model_reattaches_the_operators_of_a_ghosted_folder(calib, held_out, tmp_path):
    # every verb loads through load_model: the heal verb saved (and the eval verb measured) a
    # ghosted checkpoint without its operators when the folder's own layerswap marker was dropped
    model = tiny_model("llama")
    recover(model, [1, 4], calib, method="ghosted")
    expected = logits_of(model, held_out)
    tiny_checkpoint(tmp_path / "ckpt", model)
    loaded, _ = load_model(str(tmp_path / "ckpt"), attn_implementation="eager")
    assert [b for b, _ in attached_operators(loaded)] == [1, 3]
    assert torch.equal(logits_of(loaded, held_out), expected)


def test_reload_without_the_operator_file_is_refused(calib, tmp_path):
    model = tiny_model("llama")
    recover(model, [2], calib, method="ghosted")
    model.save_pretrained(tmp_path)
    (tmp_path / RECOVERY_FILE).unlink()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # the plugin warns; the weights load
    assert attached_operators(reloaded) == []
    with pytest.raises(FileNotFoundError, match=RECOVERY_FILE):
        attach_saved_recovery(reloaded, tmp_path)
    # a config to apply on top of the repaired model cannot be: refused, not applied to the plain one
    from hf_layerswap import LayerSwapConfig

    with pytest.raises(ValueError, match=f"{RECOVERY_FILE}.*The LayerSwapConfig passed to from_pretrained was not applied"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=LayerSwapConfig(layers=[0]))


def test_a_layerswap_config_passed_to_a_ghosted_checkpoint_applies_on_top(calib, held_out, tmp_path):
    """The checkpoint's own ``quantization_config`` (the re-attach marker) used to win over the
    argument, in transformers' merge, and every block was kept. Now the operators are
    re-attached, then the argument removes its blocks from the repaired model."""
    import warnings

    from hf_layerswap import LayerSwapConfig
    from hf_layerswap.layerplan import apply_plan

    model = tiny_model("qwen3")
    recover(model, [1, 4], calib, method="ghosted")  # 4 blocks left (original 0, 2, 3, 5); maps at boundaries 1, 3
    maps = {b: op.weight.clone() for b, op in attached_operators(model)}
    assert sorted(maps) == [1, 3]
    model.save_pretrained(tmp_path / "ghosted")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ghosted", attn_implementation="eager")
    with apply_plan(reference, [0, 2, 3]):  # the repaired model with its block 1 (original 2) skipped
        expected = logits_of(reference, held_out)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers' "the quantization_config from the model will be used"
        pruned = AutoModelForCausalLM.from_pretrained(
            tmp_path / "ghosted", attn_implementation="eager", quantization_config=LayerSwapConfig(layers=[1])
        )
    assert pruned.config.num_hidden_layers == 3 and not getattr(pruned, "is_quantized", False)
    record = pruned.config.layerswap
    assert record["removed_layers"] == [1, 2, 4] and record["kept_layers"] == [0, 3, 5]
    assert [step["removed_original_layers"] for step in record["steps"]] == [[1, 4], [2]]
    assert [step["removed_layers"] for step in record["steps"]] == [[1, 4], [1]]
    assert record["recovery"]["boundaries"] == [1, 2]
    assert [(b, torch.equal(op.weight, maps[old])) for (b, op), old in zip(attached_operators(pruned), [1, 3])] == [
        (1, True), (2, True)]  # each map follows the block it sits after
    assert torch.equal(logits_of(pruned, held_out), expected)

    pruned.save_pretrained(tmp_path / "again")  # the new step and the moved maps survive a reload
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["quantization_config"] == {"quant_method": "layerswap", "recovery": "ghosted", "layers": [1, 2, 4]}
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", attn_implementation="eager")
    assert [b for b, _ in attached_operators(again)] == [1, 2] and again.config.num_hidden_layers == 3
    assert torch.equal(logits_of(again, held_out), expected)

    # removing the blocks between the two maps: they meet at one boundary as their product, in stream order
    both = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ghosted", attn_implementation="eager", quantization_config=LayerSwapConfig(layers=[1, 2])
    )
    ((boundary, op),) = attached_operators(both)
    assert boundary == 1 and torch.equal(op.weight, maps[1] @ maps[3])
    assert both.config.layerswap["kept_layers"] == [0, 5]


_PLAIN_RELOAD = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_warning()
    cases = json.load(open(sys.argv[1]))
    batch = torch.load(sys.argv[2])
    out = {}
    for name, directory in cases.items():
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
        with torch.no_grad():
            out[name] = model(**batch, use_cache=False).logits
    torch.save(out, sys.argv[3])
    assert not any(m.startswith("hf_layerswap") for m in sys.modules), "hf_layerswap was imported"
    """
)


def test_plain_transformers_reload(calib, held_out, tmp_path):
    """Fused checkpoints reload in plain transformers with identical logits (also the
    embedding fold of a cut at block 0, which unties Gemma-3's tied embeddings); a ghosted
    checkpoint loads as the plainly pruned model, with transformers' warning."""
    expected, cases = {}, {}
    for name, family, removed, method in [
        ("fused-llama", "llama", [2, 3], "fused"),
        ("fused-gemma3-first", "gemma3", [0], "fused"),
        ("ghosted-llama", "llama", [2, 5], "ghosted"),
    ]:
        model = tiny_model(family)
        recover(model, removed, calib, method=method)
        model.save_pretrained(tmp_path / name)
        saved = json.loads((tmp_path / name / "config.json").read_text())
        if method == "fused":
            assert "quantization_config" not in saved and not (tmp_path / name / RECOVERY_FILE).exists()
            expected[name] = logits_of(model, held_out)
        else:
            detach_recovery(model)
            expected[name] = logits_of(model, held_out)  # the plainly pruned model
        cases[name] = str(tmp_path / name)
    assert json.loads((tmp_path / "fused-gemma3-first" / "config.json").read_text())["tie_word_embeddings"] is False
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torch.save(held_out, tmp_path / "batch.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _PLAIN_RELOAD, str(tmp_path / "cases.json"), str(tmp_path / "batch.pt"),
         str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Unknown quantization type, got layerswap" in proc.stderr
    out = torch.load(tmp_path / "out.pt")
    for name in cases:
        assert torch.equal(out[name], expected[name]), name


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_smollm2_recovery_on_wikitext(smollm2, wikitext_valid):
    model, tokenizer = smollm2
    calib = build_calibration(wikitext_valid, tokenizer, num_prompts=16, seq_len=128, seed=0)
    held = build_calibration(wikitext_valid, tokenizer, num_prompts=4, seq_len=64, seed=1)
    batch = {"input_ids": held.input_ids, "attention_mask": held.attention_mask}
    removed = [13, 20]
    kls = {}
    for method in ("none", "ghosted", "fused"):
        pruned = copy.deepcopy(model)
        report = recover(pruned, removed, calib, method=method, num_tokens=1536)
        assert report.num_tokens == 1536 and report.hidden_size == 576
        for fit in report.boundaries:
            assert (fit.residual_after < fit.residual_before) if method != "none" else (
                fit.residual_after == fit.residual_before
            )
        kls[method] = mean_kl(model, pruned, batch)
        del pruned
    assert kls["ghosted"] < kls["none"]
    assert kls["fused"] < kls["none"]


# ----------------------------------------------------------------------------- registry
def test_unknown_method_lists_the_registered_ones(calib):
    from hf_layerswap.recovery import RECOVERY_METHODS, get_recovery_method

    assert {"none", "ghosted", "fused", "linearpatch"} <= set(RECOVERY_METHODS)  # and whatever else is registered
    with pytest.raises(ValueError) as err:
        recover(tiny_model("llama"), [2], calib, method="shadow")
    assert str(err.value) == f"method='shadow': allowed {list(RECOVERY_METHODS)}"
    assert get_recovery_method(None).name == "none"


def test_a_registered_toy_method_runs_end_to_end(calib):
    """One decorator: the toy method's hooks are called by recover, its map is applied, its
    record lands in config.layerswap['recovery']; an identity map equals plain removal."""
    from hf_layerswap.recovery import RECOVERY_METHODS, RecoveryMethod, register_recovery_method

    calls = []

    @register_recovery_method("toy_identity")
    class ToyIdentity(RecoveryMethod):
        default_epsilon = 0.5

        def slots(self, cut):
            return (cut["start"],)

        def accumulate(self, moments, cut, rows, delta, tapped, keep):
            calls.append(("accumulate", cut["boundary"], rows[cut["start"]].shape[0]))

        def solve(self, moments, cut, fit, epsilon):
            fit.ridge.append(epsilon)
            return moments.sq[("delta", cut["start"])], torch.eye(rows_width)

        def apply(self, model, cuts, maps, host_modules):
            calls.append(("apply", sorted(maps)))

        def record(self, fits):
            return {"toy": [f.ridge for f in fits]}

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_recovery_method("toy_identity")(ToyIdentity)
        with pytest.raises(TypeError, match="RecoveryMethod subclass"):
            register_recovery_method("not_a_method")(object)
        model = tiny_model("llama")
        rows_width = model.config.hidden_size
        plain = copy.deepcopy(model)
        report = recover(model, [2, 4], calib, method="toy_identity")
        recover(plain, [2, 4], calib, method="none")
        assert report.method == "toy_identity" and report.epsilon == 0.5
        assert [f.boundary for f in report.boundaries] == [2, 3]
        for f in report.boundaries:  # an identity map leaves the residual of plain removal
            assert f.residual_after == pytest.approx(f.residual_before, rel=1e-12) and f.ridge == [0.5]
        tokens = int(calib.attention_mask.sum())
        assert sum(n for what, _, n in [c for c in calls if c[0] == "accumulate"]) == 2 * min(tokens, report.num_tokens)
        assert calls[-1] == ("apply", [2, 3])
        record = model.config.layerswap["recovery"]
        assert record["method"] == "toy_identity" and record["toy"] == [[0.5], [0.5]]
        ids, mask = calib.input_ids[:2], calib.attention_mask[:2]
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                               plain(input_ids=ids, attention_mask=mask).logits)
    finally:
        del RECOVERY_METHODS["toy_identity"]


def test_a_methods_own_values_per_cut_are_typed_serialised_and_recorded(calib):
    """A repair keeps values of its own in ``fit.extra`` (no ad-hoc attribute on the fit): the
    report's JSON round trip keeps them and config.layerswap['recovery']['extra'] records them
    per cut; a method that sets none adds no key."""
    from hf_layerswap.recovery import RECOVERY_METHODS, BoundaryFit, RecoveryMethod, RecoveryReport, register_recovery_method
    from hf_layerswap.recovery.report import encoded_extra

    @register_recovery_method("toy_scaled")
    class ToyScaled(RecoveryMethod):
        def solve(self, moments, cut, fit, epsilon):
            fit.extra["scale"] = cut["boundary"] + 0.5
            fit.extra["spread"] = math.inf if cut["boundary"] == 3 else 0.25
            return moments.sq[("delta", cut["start"])], None

    try:
        model, plain = tiny_model("llama"), tiny_model("llama")
        report = recover(model, [2, 4], calib, method="toy_scaled")
        assert [f.extra for f in report.boundaries] == [{"scale": 2.5, "spread": 0.25}, {"scale": 3.5, "spread": math.inf}]
        assert model.config.layerswap["recovery"]["extra"] == [{"scale": 2.5, "spread": 0.25},
                                                               {"scale": 3.5, "spread": "Infinity"}]
        assert report.to_dict()["boundaries"][1]["extra"] == {"scale": 3.5, "spread": "Infinity"}
        assert RecoveryReport.from_json(report.to_json()) == report
        ghosted = recover(plain, [2, 4], calib, method="ghosted")  # sets no values of its own
        assert "extra" not in plain.config.layerswap["recovery"] and "extra" not in ghosted.to_dict()["boundaries"][0]
        assert BoundaryFit.from_dict(ghosted.boundaries[0].to_dict()).extra == {}
        with pytest.raises(TypeError, match=r"BoundaryFit.extra\['scale'\]='big': must be a float"):
            encoded_extra({"scale": "big"})
    finally:
        del RECOVERY_METHODS["toy_scaled"]


def test_a_method_s_own_value_that_is_no_float_is_refused_before_the_model_changes(calib):
    """A repair's ``solve`` that leaves a 0-d tensor in ``fit.extra`` (not a float): refused
    naming the method, the cut and the key, before a block is removed (the record of the
    values is written after the cut, so a late refusal would leave a cut model without it)."""
    from hf_layerswap.recovery import RECOVERY_METHODS, RecoveryMethod, register_recovery_method

    @register_recovery_method("toy_tensor_extra")
    class ToyTensorExtra(RecoveryMethod):
        def solve(self, moments, cut, fit, epsilon):
            fit.extra["scale"] = torch.tensor(2.5)
            return moments.sq[("delta", cut["start"])], None

    try:
        model = tiny_model("llama")
        snap = snapshot_model(model)
        with pytest.raises(TypeError, match=re.escape("recovery method 'toy_tensor_extra', cut at boundary 2: "
                                                     "BoundaryFit.extra['scale']=tensor(2.5") + r"0*\): must be a float"):
            recover(model, [2, 4], calib, method="toy_tensor_extra")
        assert_model_unchanged(model, snap)
        assert num_blocks(model) == 6 and getattr(model.config, "layerswap", None) is None
    finally:
        del RECOVERY_METHODS["toy_tensor_extra"]


# ------------------------------------------------------ calibration shortfall


def test_recovery_warns_when_the_calibration_holds_fewer_tokens_than_requested(matrix_tokenizer):
    from hf_layerswap.recovery import recover

    model = build("llama")
    calib = hl.build_calibration(PARAGRAPHS, matrix_tokenizer, num_prompts=6, seq_len=24)
    with pytest.warns(hl.CalibrationShortfallWarning, match=re.escape(
            "recovery fitted on 144 calibration tokens, fewer than the 1,000 requested (num_tokens)")):
        recover(model, [2], calib, method="ghosted", num_tokens=1000)
    assert model.config.layerswap["recovery"]["num_tokens"] == 144
    assert model.config.layerswap["recovery"]["requested_tokens"] == 1000


def test_recovery_by_default_uses_the_whole_calibration_set_without_a_warning(matrix_tokenizer):
    """``num_tokens`` defaults to "every token, at most 65,536": the user path
    (``LayerSwapConfig(recovery="ghosted")``, 64 x 128 prompts) must not warn on every load."""
    from hf_layerswap.recovery import recover

    model = build("llama")
    calib = hl.build_calibration(PARAGRAPHS, matrix_tokenizer, num_prompts=6, seq_len=24)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hl.CalibrationShortfallWarning)
        recover(model, [2], calib, method="ghosted")
        hl.prune_loaded_model(build("llama"), hl.LayerSwapConfig(
            layers=[2], recovery="ghosted", calibration=PARAGRAPHS, tokenizer=matrix_tokenizer, num_prompts=6,
            seq_len=24))
    record = model.config.layerswap["recovery"]
    assert record["num_tokens"] == 144 and "requested_tokens" not in record


# ----------------------------------------------------------------------------- linearpatch
@pytest.mark.parametrize("n, how", [
    (32, "Sylvester 32"), (12, "Paley I 12 (q = 11)"), (20, "Paley I 20 (q = 19)"), (28, "Paley II 28 (q = 13)"),
    (576, "Paley II 36 (q = 17) x Sylvester 16"), (640, "Paley I 20 (q = 19) x Sylvester 32"),
    (768, "Paley I 12 (q = 11) x Sylvester 64"), (896, "Paley II 28 (q = 13) x Sylvester 32"),
])
def test_hadamard_matrices_of_hidden_sizes_that_are_not_powers_of_two(n, how):
    matrix, built = hadamard_matrix(n)
    assert built == how and matrix.shape == (n, n) and bool((matrix.abs() == 1).all())
    assert torch.equal(matrix @ matrix.T, n * torch.eye(n, dtype=torch.float64))  # exact in float64
    rotation, described = hadamard_rotation(n)
    assert described == f"Hadamard {n} = {how}, scaled by 1/sqrt({n})"
    assert torch.allclose(rotation @ rotation.T, torch.eye(n, dtype=torch.float64), atol=1e-13, rtol=0)
    assert torch.equal(rotation, matrix / n**0.5)


@pytest.mark.parametrize("n", [6, 10, 92])
def test_sizes_without_a_constructed_hadamard_matrix_get_the_seeded_random_rotation(n):
    assert hadamard_matrix(n) is None
    rotation, described = hadamard_rotation(n)
    assert described.startswith(f"random orthogonal {n} (no Hadamard matrix of order {n} is constructed")
    assert torch.allclose(rotation @ rotation.T, torch.eye(n, dtype=torch.float64), atol=1e-13, rtol=0)
    rotation[0, 0] = 7.0  # a copy: the next call is the same matrix
    again, _ = hadamard_rotation(n)
    assert torch.equal(again, hadamard_rotation(n)[0]) and float(again[0, 0]) != 7.0
    with pytest.raises(ValueError, match=r"n=0: a rotation's size is an int >= 1"):
        hadamard_rotation(0)


def _streams(model, batch) -> tuple:
    """The residual stream entering every block, over the batch's real tokens (float64 rows)."""
    with torch.no_grad():
        states = model(**batch, output_hidden_states=True, use_cache=False).hidden_states
    keep = batch["attention_mask"].bool()
    return tuple(h[keep].double() for h in states[:-1])  # entry k enters block k (the last is after the norm)


def _paper_patch(streams, start: int, end: int) -> torch.Tensor:
    """LinearPatch's P = R diag(mean|h_e R| / mean|h_s R|) Rᵀ, computed here from the streams."""
    rotation = hadamard_matrix(streams[start].shape[1])[0] / streams[start].shape[1] ** 0.5
    scale = (streams[end] @ rotation).abs().mean(0) / (streams[start] @ rotation).abs().mean(0)
    return rotation @ torch.diag(scale) @ rotation.T


def test_linearpatch_folds_at_block_0_and_hooks_elsewhere_exactly_as_the_paper_map(calib, held_out):
    """Cuts [0, 1] and [3]: the first map folded into the embedding, the second an operator at
    pruned boundary 1; both equal the paper's P computed here, and the folded model's logits
    equal those of the plainly pruned model with both maps as hooks (fp32 tolerance)."""
    dense = tiny_model("llama")
    batch = {"input_ids": calib.input_ids, "attention_mask": calib.attention_mask}
    streams = _streams(dense, batch)
    first, second = _paper_patch(streams, 0, 2), _paper_patch(streams, 3, 4)
    assert torch.allclose(first, first.T) and not torch.allclose(first, torch.eye(32, dtype=torch.float64))
    model = copy.deepcopy(dense)
    report = recover(model, [0, 1, 3], calib, method="linearpatch")
    record = model.config.layerswap["recovery"]
    assert record["method"] == "linearpatch" and record["boundaries"] == [1] and record["folded_boundaries"] == [0]
    assert record["folded_into"] == ["embed_tokens"] and record["cut_boundaries"] == [0, 1]
    assert record["rotation"] == "Hadamard 32 = Sylvester 32, scaled by 1/sqrt(32)" and record["epsilon"] == 0.0
    assert record["file"] == RECOVERY_FILE and [f.folded_into for f in report.boundaries] == ["embed_tokens", None]
    ((boundary, operator),) = attached_operators(model)
    assert boundary == 1 and torch.allclose(operator.weight.double(), second, atol=1e-5, rtol=0)
    embedding = dense.get_input_embeddings().weight.double() @ first
    assert torch.allclose(model.get_input_embeddings().weight.double(), embedding, atol=1e-5, rtol=0)

    hooked = copy.deepcopy(dense)
    hl.remove_layers(hooked, [0, 1, 3])
    attach_operator(hooked, 0, first.float())
    attach_operator(hooked, 1, second.float())
    assert torch.allclose(logits_of(model, held_out), logits_of(hooked, held_out), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits_of(model, held_out), logits_of(dense, held_out), atol=1e-3)


@pytest.mark.parametrize("family, removed", [("llama", [2]), ("qwen3", [1, 4])])
def test_linearpatch_lowers_the_removal_kl(family, removed, calib, held_out):
    """On the calibration set (and held out) the repaired cut is closer to the dense model than
    plain removal; Ghosted Layers' unconstrained operator, whose family contains LinearPatch's
    symmetric maps, does better still on the set it was fitted on."""
    dense = tiny_model(family)
    batch = {"input_ids": calib.input_ids, "attention_mask": calib.attention_mask}
    kls = {}
    for method in ("none", "linearpatch", "ghosted"):
        model = copy.deepcopy(dense)
        recover(model, removed, calib, method=method)
        kls[method] = (mean_kl(dense, model, batch), mean_kl(dense, model, held_out))
    assert kls["linearpatch"][0] < 0.99 * kls["none"][0] and kls["linearpatch"][1] < kls["none"][1]
    assert kls["ghosted"][0] < kls["linearpatch"][0]


def test_linearpatch_refuses_post_norm_blocks_before_any_forward(calib, tmp_path, capsys):
    """On post-norm blocks (Gemma-3) the stream carries massive channels on every token, which
    the rotation and a non-uniform D spread into every channel (Gemma-3-270M, blocks 7-8:
    perplexity 41 -> 8.8e13 while its fit residual was below plain removal's). The repair is
    refused before any forward pass and the model is unchanged; by prune before its scoring
    too. A cut of block 0, folded into the input embedding, stays allowed."""
    gemma = tiny_model("gemma3")
    state = {k: v.clone() for k, v in gemma.state_dict().items()}
    calls = []
    handles = [b.register_forward_hook(lambda *_: calls.append(1)) for b in gemma.model.layers]
    message = (r"linearpatch recovery cannot repair a cut after gemma3_text block 1 \(post-norm blocks: the MLP "
               r"output passes through post_feedforward_layernorm before it is added\).*use method='ghosted'")
    with pytest.raises(ValueError, match=message):
        recover(gemma, [2, 3], calib, method="linearpatch")
    config = hl.LayerSwapConfig(layers=[2, 3], recovery="linearpatch", progress=False)
    with pytest.raises(ValueError, match=message):
        hl.prune(gemma, config, calibration=calib)
    assert calls == [] and gemma.config.num_hidden_layers == 6 and "layerswap" not in gemma.config.to_dict()
    assert all(torch.equal(v, state[k]) for k, v in gemma.state_dict().items())
    for h in handles:
        h.remove()
    gemma.save_pretrained(tmp_path / "gemma")
    assert hl_cli_main(["prune", str(tmp_path / "gemma"), str(tmp_path / "out"), "--layers", "2", "3", "--recovery",
                        "linearpatch", "--num-prompts", "8", "--seq-len", "16"]) == 2
    assert re.search("error: " + message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
    report = recover(gemma, [0, 1], calib, method="linearpatch")
    assert gemma.config.layerswap["recovery"]["folded_boundaries"] == [0] and report.method == "linearpatch"


def test_linearpatch_epsilon_is_refused_before_the_model_changes(calib):
    model = tiny_model("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"epsilon=0\.001: method='linearpatch' has no ridge; allowed: None or 0\.0"):
        recover(model, [2], calib, method="linearpatch", epsilon=1e-3)
    assert model.config.num_hidden_layers == 6 and all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert recover(model, [2], calib, method="linearpatch", epsilon=0).epsilon == 0.0


def test_linearpatch_save_and_reload(calib, held_out, tmp_path):
    """With an operator: the file and the marker, re-attached on reload, the same logits, the
    record still linearpatch after another removal. Folded only (a cut of block 0): a plain
    transformers checkpoint, no operator file, no marker."""
    model = tiny_model("qwen3")
    recover(model, [0, 3], calib, method="linearpatch")
    expected = logits_of(model, held_out)
    model.save_pretrained(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert saved["quantization_config"] == {"quant_method": "layerswap", "recovery": "linearpatch", "layers": [0, 3]}
    assert saved["layerswap"]["recovery"]["boundaries"] == [2] and saved["layerswap"]["recovery"]["method"] == "linearpatch"
    assert saved["layerswap"]["recovery"]["loader"].startswith("linearpatch operators live in ")
    assert sorted(load_file(tmp_path / "ckpt" / RECOVERY_FILE)) == ["boundary_2"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="eager")
    assert [b for b, _ in attached_operators(reloaded)] == [2]
    assert torch.equal(logits_of(reloaded, held_out), expected)
    hl.remove_layers(reloaded, [3])  # the operator moves with the cut; the record stays linearpatch
    assert reloaded.config.layerswap["recovery"]["method"] == "linearpatch"
    assert reloaded.config.layerswap["recovery"]["boundaries"] == [2]

    folded = tiny_model("qwen3")
    recover(folded, [0], calib, method="linearpatch")
    expected = logits_of(folded, held_out)
    assert attached_operators(folded) == [] and "save_pretrained" not in vars(folded)
    folded.save_pretrained(tmp_path / "plain")
    saved = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "quantization_config" not in saved and not (tmp_path / "plain" / RECOVERY_FILE).exists()
    assert saved["layerswap"]["recovery"]["folded_boundaries"] == [0] and saved["layerswap"]["recovery"]["boundaries"] == []
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", attn_implementation="eager")
    assert attach_saved_recovery(again) == [] and torch.equal(logits_of(again, held_out), expected)


def test_detaching_linearpatch_operators_keeps_the_record_of_the_fold(calib):
    model = tiny_model("llama")
    recover(model, [0, 3], calib, method="linearpatch")
    assert detach_recovery(model) == 1
    record = model.config.layerswap["recovery"]
    assert record["method"] == "linearpatch" and record["folded_boundaries"] == [0] and record["boundaries"] == []
    assert "file" not in record and attached_operators(model) == []
    model = tiny_model("llama")
    recover(model, [3], calib, method="linearpatch")
    assert detach_recovery(model) == 1 and "recovery" not in model.config.layerswap


def test_a_fit_under_a_small_budget_takes_fewer_prompts_per_batch_and_gives_the_same_repair():
    """Under a working-memory budget smaller than a full batch's captures beside the moments,
    the fit takes fewer prompts per batch (the moments are float64 sums over the same rows,
    so the repair is the same to float64 rounding); a budget the moments alone exceed on a
    CPU warns MemoryBudgetWarning with the need and the budget before the fit."""
    from hf_layerswap.cost.steps import ModelShape, recovery_phase
    from hf_layerswap.recovery.fit import fit_memory
    from hf_layerswap.scoring.settings import MemoryBudgetWarning

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    calib = hl.CalibrationSet(ids, torch.ones_like(ids), "random tokens")
    cfg = hl.LayerSwapConfig(layers=[2, 3], recovery="ghosted", num_prompts=8, seq_len=64, batch_size=8)
    full = recovery_phase(ModelShape(model), calib, cfg, 0)
    moments = 8 * model.config.hidden_size**2 * (2 * 2 + 1)  # XᵀX, XᵀY per removed block, one more for the cut
    budget = moments + (full["working_bytes"] - moments) // 2
    small = recovery_phase(ModelShape(model), calib, cfg, 0, budget)
    assert full["batch_size"] == 8 and small["batch_size"] < 8 and small["within_budget"]
    assert small["working_bytes"] <= budget < full["working_bytes"]
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryBudgetWarning)
        whole = hl.recover(a, [2, 3], calib, method="ghosted", batch_size=8)
        sliced = hl.recover(b, [2, 3], calib, method="ghosted", batch_size=8, max_memory=budget)
    assert whole.num_tokens == sliced.num_tokens == 8 * 64
    assert [f.residual_after for f in sliced.boundaries] == pytest.approx([f.residual_after for f in whole.boundaries], rel=1e-9)
    ids = calib.input_ids[:2]
    with torch.no_grad():
        assert torch.allclose(a(ids).logits, b(ids).logits, rtol=0, atol=1e-5)
    assert moments > 1 << 20  # 2.5 MiB of moments: a 1 MiB budget cannot hold them on a CPU
    with pytest.warns(MemoryBudgetWarning, match=r"ghosted repair's fit needs .* MiB .*max_memory=1\.0 MiB"):
        hl.recover(copy.deepcopy(model), [2, 3], calib, method="ghosted", batch_size=8, max_memory="1MiB")
    # on an accelerator the moments go to host memory instead, and the device keeps within the budget
    plan = fit_memory(calib, 8, 10**6, slots=3, hidden=64, element_bytes=4, moment_bytes=10**9,
                      activation=lambda b, w: 0, budget=1 << 20, accelerator=True)
    assert plan["moments_on_host"] and plan["host_bytes"] == 10**9 and plan["device_bytes"] <= 1 << 20
    on_cpu = fit_memory(calib, 8, 10**6, slots=3, hidden=64, element_bytes=4, moment_bytes=10**9,
                        activation=lambda b, w: 0, budget=1 << 20)
    assert not on_cpu["moments_on_host"] and not on_cpu["within_budget"] and on_cpu["batch_size"] == 1
