"""The model card, the Hub folder and the push verb after width compression (one-shot
sparsity) and after a repair of the cut (Ghosted Layers / fused recovery)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch
from publish_helpers import BASE_MODEL, evaluation_of, hand_report, pruned_tiny

from conftest import tiny_batch, tiny_model
from hf_layerswap import LayerSwapConfig, remove_layers, save_for_hub
from hf_layerswap.plots import PLOT_FILES
from hf_layerswap.card import SPARSITY_FILE, check_card, render_card, sparsity_mismatches
from hf_layerswap.cli.push import add_push_arguments, run_push
from hf_layerswap.cli import main as cli_main
from hf_layerswap.hub import PushRefusedError, default_commit_message
from hf_layerswap.layerplan import decoder_blocks
from hf_layerswap.recovery import recover
from hf_layerswap.surgery import RECOVERY_FILE
from hf_layerswap.sparsity import SparsityReport, config_record, sparsify
from hf_layerswap.sparsity.engine import prunable_linears


@pytest.fixture(scope="module")
def sparse_pruned():
    """The hand-report tiny model (blocks 1, 3 removed), then PALS Wanda at 50%."""
    model = pruned_tiny()
    report = sparsify(model, tiny_batch(), sparsity=0.5, allocation="pals", pruner="wanda")
    return model, report


def _section(text: str) -> str:
    """The card's sparsity section, up to the next section heading."""
    start = text.index("## Sparsity")
    return text[start:text.index("\n## ", start + 1)]


def test_sparsify_records_its_summary_in_the_config(sparse_pruned):
    model, report = sparse_pruned
    record = model.config.layerswap_sparsity
    assert record == config_record(report)
    assert record["original_blocks"] == [0, 2, 4, 5]  # numbering before the removal of 1 and 3
    assert record["num_zeros"] == sum(
        int((lin.weight == 0).sum()) for block in decoder_blocks(model)[2] for _, lin in prunable_linears(block)
    )
    assert record["block_params"] == [b.num_params for b in report.blocks]
    assert record["block_achieved"] == [b.num_zeros / b.num_params for b in report.blocks]
    assert json.loads(json.dumps(record)) == record  # config.json safe, floats exact
    assert record["allocator"]["percentile"] == 0.99 and record["allocator"]["delta"] == 0.05


def test_card_sparsity_section_carries_the_report_numbers(sparse_pruned):
    model, report = sparse_pruned
    card = render_card(model, report=hand_report(), evaluation=evaluation_of(model), base_model=BASE_MODEL,
                       sparsity_report=report, plots=[])
    data = card.data.to_dict()
    assert data["tags"] == ["layerswap", "layer-pruning", "interchange", "sparsity", "wanda"]
    assert data["layerswap"]["sparsity"] == {
        "method": "wanda", "allocation": "pals", "pattern": None, "target_sparsity": 0.5,
        "achieved_sparsity": report.achieved_sparsity, "report": SPARSITY_FILE,
    }
    section = _section(card.text)
    for block, original in zip(report.blocks, [0, 2, 4, 5]):
        row = f"| {original} | {block.target:.4f} | {block.achieved:.4f} | {block.statistic:.4g} | kept |"
        assert row in section, row
    assert f"({report.num_zeros:,} of {report.num_params:,} weights of the blocks' linear layers are zero)" in section
    assert "| Layerwise allocation | PALS: percentile-aware" in section
    assert "percentile 0.99 of \\|activation\\| (linear_inputs, pool=all)" in section  # pipes escaped in the table
    assert "| Pattern | unstructured |" in section and "| Target sparsity | 50.00% |" in section
    assert "Achieved sparsity, blocks still in the model" not in section  # nothing was removed after pruning
    assert "are 50.00% sparse (one-shot wanda, unstructured, pals allocation)" in card.text
    norms = 4 * 2 * model.config.hidden_size  # 4 blocks, two RMSNorm weights each: all that is not nn.Linear
    assert f"and the {norms:,} parameters of the blocks still in the model that are not `nn.Linear` weight" in section
    assert f"| `{SPARSITY_FILE}` |" in card.text
    assert check_card(card) == []


def test_card_from_the_config_record_alone_after_a_plain_reload(sparse_pruned, tmp_path):
    """save_pretrained + plain transformers from_pretrained keep the summary; the card
    shows the same per-block numbers (no allocator statistic without the report)."""
    from transformers import AutoModelForCausalLM

    model, report = sparse_pruned
    model.save_pretrained(tmp_path)
    script = (
        "import json, sys\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "print(json.dumps(m.config.layerswap_sparsity))\n"
        "assert 'hf_layerswap' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == config_record(report)

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    section = _section(render_card(reloaded, plots=[]).text)
    for block, original in zip(report.blocks, [0, 2, 4, 5]):
        assert f"| {original} | {block.target:.4f} | {block.achieved:.4f} | — | kept |" in section
    assert f"{SPARSITY_FILE}" not in render_card(reloaded, plots=[]).text  # no sidecar without the report


def test_sparsity_report_must_belong_to_the_model(sparse_pruned):
    model, report = sparse_pruned
    assert sparsity_mismatches(model, report) == []
    assert sparsity_mismatches(model.config, report) == []
    # one weight changed after pruning
    changed = pruned_tiny()
    changed_report = sparsify(changed, tiny_batch(), sparsity=0.5, allocation="pals", pruner="wanda")
    weight = dict(prunable_linears(decoder_blocks(changed)[2][1]))["mlp.down_proj"].weight
    flat = weight.data.view(-1)
    flat[int((flat == 0).nonzero()[0])] = 1.0
    (problem,) = sparsity_mismatches(changed, changed_report)
    zeros = changed_report.blocks[1].num_zeros
    assert problem == (
        f"block 2 (original numbering) has {zeros - 1} zero weights, fewer than the {zeros} the sparsity report "
        "records: its weights changed after pruning"
    )
    # a report of another pruning run disagrees with the config record
    other = SparsityReport.from_dict(report.to_dict())
    other.allocation = "uniform"
    assert sparsity_mismatches(model, other) == [
        "the sparsity report differs from config.layerswap_sparsity in ['allocation']"
    ]
    # a report covering blocks the model does not have
    dense = tiny_model("llama", 6)
    problems = sparsity_mismatches(dense, report)
    assert problems == [
        "the sparsity report covers blocks [0, 2, 4, 5] (original numbering) but the model also has blocks [1, 3]"
    ]
    with pytest.raises(ValueError, match="the sparsity report does not belong to this model"):
        render_card(dense, sparsity_report=report)
    with pytest.raises(TypeError, match="sparsity must be a SparsityReport, got dict"):
        sparsity_mismatches(model, report.to_dict())


def test_save_for_hub_refuses_a_foreign_sparsity_report_and_writes_nothing(sparse_pruned, tmp_path):
    _, report = sparse_pruned
    with pytest.raises(PushRefusedError, match="the sparsity report does not belong to this model"):
        save_for_hub(tiny_model("llama", 6), tmp_path / "never", sparsity_report=report)
    assert not (tmp_path / "never").exists()


def test_removal_after_pruning_is_shown_in_the_original_numbering(tmp_path):
    model = tiny_model("llama", 6)
    report = sparsify(model, tiny_batch(), sparsity=0.6, allocation="owl", pruner="sparsegpt")
    remove_layers(model, [2])
    assert sparsity_mismatches(model, report) == []
    written = save_for_hub(model, tmp_path / "out", sparsity_report=report)
    text = (written / "README.md").read_text()
    section = _section(text)
    assert f"| 2 | {report.blocks[2].target:.4f} | {report.blocks[2].achieved:.4f} |" in section
    assert "| removed after pruning |" in section
    kept = [b for b in report.blocks if b.index != 2]
    in_model = sum(b.num_zeros for b in kept) / sum(b.num_params for b in kept)
    assert f"| Achieved sparsity, blocks still in the model | {100 * in_model:.4f}% " in section
    # the headline, the front matter and the commit message give the blocks still there
    assert f"are {100 * in_model:.2f}% sparse (one-shot sparsegpt" in text
    from huggingface_hub import ModelCard

    assert ModelCard.load(written / "README.md").data.to_dict()["layerswap"]["sparsity"]["achieved_sparsity"] == in_model
    assert default_commit_message(model) == (
        f"Upload layer-pruned model: blocks [2] of 6 removed, {100 * in_model:.1f}% sparse (sparsegpt) (hf_layerswap)"
    )
    assert "| Layerwise allocation | OWL: outlier-weighted layerwise sparsity (Yin et al., 2024); M = 5, lambda = 0.08 |" in section


def test_from_pretrained_with_sparsity_publishes_its_evidence(tmp_path):
    """LayerSwapConfig(sparsity=...) -> save_for_hub picks the model's own sparsity report:
    sidecar (loads back equal), per-block plot, card section; the CLI push reads the sidecar."""
    from transformers import AutoModelForCausalLM

    tiny_model("llama", 6).save_pretrained(tmp_path / "base")
    batch = tiny_batch()
    cfg = LayerSwapConfig(layers=[1, 3], calibration=batch, sparsity=0.5, allocation="uniform", pruner="wanda",
                          progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg, attn_implementation="eager")
    report = model.layerswap_sparsity_report
    assert report.achieved_sparsity == 0.5 and model.config.layerswap_sparsity == config_record(report)
    folder = save_for_hub(model, tmp_path / "folder", repo_id="user/tiny-sparse")
    names = {p.name for p in folder.iterdir()}
    assert {SPARSITY_FILE, PLOT_FILES["sparsity"], "README.md", "model.safetensors"} <= names
    assert SparsityReport.from_json(folder / SPARSITY_FILE) == report
    png = (folder / PLOT_FILES["sparsity"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    text = (folder / "README.md").read_text()
    assert f"]({PLOT_FILES['sparsity']})" in text and check_card(text, folder) == []
    assert "| 0 | 0.5000 | 0.5000 | — | kept |" in _section(text)

    parser = add_push_arguments(argparse.ArgumentParser(prog="hf-layerswap push"))
    args = parser.parse_args([str(folder), "user/tiny-sparse", "--output-dir", str(tmp_path / "again")])
    assert run_push(args) == 0
    assert SparsityReport.from_json(tmp_path / "again" / SPARSITY_FILE) == report
    assert _section((tmp_path / "again" / "README.md").read_text()) == _section(text)
    # a missing sidecar is refused before anything loads: one error line, exit 2
    assert cli_main(["push", str(folder), "user/x", "--sparsity-report", str(tmp_path / "none.json"),
                     "--output-dir", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_sparsity_report_plot_is_the_card_plot(sparse_pruned, tmp_path):
    _, report = sparse_pruned
    a = report.plot(tmp_path / "a.png")
    from hf_layerswap.plots import write_sparsity_plot

    b = write_sparsity_plot(config_record(report), tmp_path / "b.png")
    assert a.read_bytes() == b.read_bytes() and a.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.png"]  # no temporary file left


@pytest.mark.parametrize("method", ["ghosted", "fused"])
def test_card_names_the_repair_and_how_to_load_it(method, tmp_path):
    model = tiny_model("llama", 6)
    calib = tiny_batch(batch=6, length=16, pad_last=0)
    recover(model, [2, 3], calib, method=method)
    folder = save_for_hub(model, tmp_path / method)
    text = (folder / "README.md").read_text()
    card = render_card(model)
    assert card.data.to_dict()["layerswap"]["recovery"] == method
    if method == "ghosted":
        assert "| Repair of the cut | Ghosted Layers closed-form operator I + M at boundaries 2 (pruned numbering), " \
               f"stored in `{RECOVERY_FILE}` |" in text
        assert "import hf_layerswap  # registers the loader" in text
        assert "import\n`hf_layerswap` before `from_pretrained` to apply them" in text
        assert "`hf_layerswap` is not needed to load it" not in text
        assert f"| `{RECOVERY_FILE}` |" in text and (folder / RECOVERY_FILE).is_file()
    else:
        assert ("| Repair of the cut | ReplaceMe-style least-squares map folded into `layers.1.mlp.down_proj` before "
                "boundary 2 (pruned numbering): plain transformers weights |") in text
        assert "`hf_layerswap` is not needed to load it" in text
        assert "import hf_layerswap" not in text.split("## How to use this model")[1].split("## How to reproduce")[0]
    assert check_card(text, folder) == []


def test_a_linearpatch_repair_names_its_operators_and_its_fold(tmp_path):
    """Operators at boundary 2: loaded with hf_layerswap, the file listed. Folded only (a cut of
    block 0): a plain transformers checkpoint, published without an operator file."""
    calib = tiny_batch(batch=6, length=16, pad_last=0)
    model = tiny_model("llama", 6)
    recover(model, [0, 3], calib, method="linearpatch")
    folder = save_for_hub(model, tmp_path / "hooked")
    text = (folder / "README.md").read_text()
    assert ("| Repair of the cut | LinearPatch H·D·Hᵀ (Hadamard 32 = Sylvester 32, scaled by 1/sqrt(32)), folded into "
            "`embed_tokens` at boundary 0: plain transformers weights; operators at boundaries 2, stored in "
            f"`{RECOVERY_FILE}` (pruned numbering) |") in text
    assert "import hf_layerswap  # registers the loader" in text
    assert f"| `{RECOVERY_FILE}` |" in text and (folder / RECOVERY_FILE).is_file()
    assert check_card(text, folder) == []

    model = tiny_model("llama", 6)
    recover(model, [0, 1], calib, method="linearpatch")
    folder = save_for_hub(model, tmp_path / "folded")
    text = (folder / "README.md").read_text()
    assert ("| Repair of the cut | LinearPatch H·D·Hᵀ (Hadamard 32 = Sylvester 32, scaled by 1/sqrt(32)), folded into "
            "`embed_tokens` at boundary 0: plain transformers weights (pruned numbering) |") in text
    assert "`hf_layerswap` is not needed to load it" in text and not (folder / RECOVERY_FILE).exists()
    assert render_card(model).data.to_dict()["layerswap"]["recovery"] == "linearpatch"
    assert check_card(text, folder) == []


def test_a_fused_repair_at_block_0_is_named_where_it_was_folded():
    """A cut at block 0 has no block before it: the map goes into the input embedding, and
    the card says so (it said `down_proj`)."""
    model = tiny_model("llama", 6)
    recover(model, [0], tiny_batch(batch=6, length=16, pad_last=0), method="fused")
    assert model.config.layerswap["recovery"]["folded_into"] == ["embed_tokens"]
    text = render_card(model).text
    assert ("| Repair of the cut | ReplaceMe-style least-squares map folded into `embed_tokens` before boundary 0 "
            "(pruned numbering): plain transformers weights |") in text
    assert "down_proj" not in text


def test_sparse_reload_gives_the_same_logits_through_the_folder(sparse_pruned, tmp_path):
    from transformers import AutoModelForCausalLM

    model, report = sparse_pruned
    folder = save_for_hub(model, tmp_path / "f", sparsity_report=report)
    again = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    batch = tiny_batch()
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, model(**batch).logits)
    assert sparsity_mismatches(again, report) == []


def test_weights_changed_after_pruning_are_refused_without_a_report(tmp_path):
    """The config summary alone is checked against the weights too: a model trained (or
    repaired with a fused map) after pruning cannot publish the old sparsity numbers."""
    model = tiny_model("llama", 6)
    report = sparsify(model, tiny_batch(), sparsity=0.5, allocation="uniform", pruner="wanda")
    model.layerswap_sparsity_report = None  # as after a plain-transformers reload
    assert sparsity_mismatches(model) == []
    weight = decoder_blocks(model)[2][4].mlp.up_proj.weight
    weight.data.add_(1e-3)  # one optimizer-like step: no zero left in that linear
    zeros_now = sum(int((lin.weight == 0).sum()) for _, lin in prunable_linears(decoder_blocks(model)[2][4]))
    (problem,) = sparsity_mismatches(model)
    assert problem == (
        f"block 4 (original numbering) has {zeros_now} zero weights, fewer than the {report.blocks[4].num_zeros} "
        "config.layerswap_sparsity records: its weights changed after pruning"
    )
    with pytest.raises(ValueError, match="no longer describes this model.*delete model.config.layerswap_sparsity"):
        render_card(model)
    with pytest.raises(PushRefusedError, match="config.layerswap_sparsity no longer describes this model"):
        save_for_hub(model, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_a_second_pass_keeps_the_first_and_updates_the_models_report():
    model = pruned_tiny()
    first = sparsify(model, tiny_batch(), sparsity=0.5, allocation="pals", pruner="wanda")
    second = sparsify(model, tiny_batch(), sparsity=0.6, allocation="uniform", pruner="magnitude")
    assert model.layerswap_sparsity_report is second
    record = model.config.layerswap_sparsity
    assert record["method"] == "magnitude" and record["previous"] == [config_record(first)]
    assert second.num_zeros >= first.num_zeros  # zeros of the first pass stay zero
    section = _section(render_card(model, plots=[]).text)
    assert (
        "| Earlier pruning passes (oldest first) | wanda, unstructured, pals allocation, target 50.00%, achieved "
        f"{100 * first.achieved_sparsity:.4f}% (the zeros they left count in the achieved sparsity above) |"
    ) in section
    assert sparsity_mismatches(model) == [] and sparsity_mismatches(model, second) == []


def test_moe_expert_tensors_are_named_as_kept_dense():
    import arch_matrix

    model = arch_matrix.build("qwen3_moe")
    report = sparsify(model, arch_matrix.prompts(), sparsity=0.5, allocation="uniform", pruner="wanda")
    blocks = decoder_blocks(model)[2]
    dense = sum(p.numel() for b in blocks for p in b.parameters()) - report.num_params
    assert dense > 0 and sum(model.config.layerswap_sparsity["block_dense_params"]) == dense
    text = render_card(model, plots=[]).text
    assert f"and the {dense:,} parameters of the blocks still in the model that are not `nn.Linear`" in _section(text)
    assert ": 50.0% sparse linear layers" in text.splitlines()[1]  # the title claims the linears, not the blocks


def test_refused_inputs_leave_no_file_and_a_corrupt_sidecar_is_refused(sparse_pruned, tmp_path):
    from hf_layerswap.card import write_card_files

    _, report = sparse_pruned
    with pytest.raises(ValueError, match="does not belong to this model"):
        write_card_files(tmp_path / "cards", tiny_model("llama", 6), sparsity_report=report)
    assert not (tmp_path / "cards").exists() or list((tmp_path / "cards").iterdir()) == []
    folder = save_for_hub(sparse_pruned[0], tmp_path / "folder", sparsity_report=report)
    (folder / SPARSITY_FILE).write_text("{not json")
    parser = add_push_arguments(argparse.ArgumentParser(prog="hf-layerswap push"))
    assert run_push(parser.parse_args([str(folder), "user/x", "--output-dir", str(tmp_path / "x")])) == 2
    assert not (tmp_path / "x").exists()


def test_ghosted_checkpoint_reloads_repaired_and_a_detached_one_is_refused(tmp_path):
    """The card's snippet (import hf_layerswap, then from_pretrained) re-attaches the
    operators; a model that carries the record but no operator is not published."""
    from transformers import AutoModelForCausalLM

    from hf_layerswap.surgery import attached_operators

    model = tiny_model("llama", 6)
    recover(model, [2, 3], tiny_batch(batch=6, length=16, pad_last=0), method="ghosted")
    folder = save_for_hub(model, tmp_path / "ghosted")
    again = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    assert [b for b, _ in attached_operators(again)] == [2]
    batch = tiny_batch()
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, model(**batch).logits)
    # without the loader marker (as after editing config.json) the record stays, the operator does not
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    bare = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    assert attached_operators(bare) == [] and bare.config.layerswap["recovery"]["method"] == "ghosted"
    with pytest.raises(PushRefusedError, match=r"records ghosted recovery modules at boundaries \[2\] but none is attached"):
        save_for_hub(bare, tmp_path / "never")
    # a later removal drops the record, but the card still sees the attached operator
    remove_layers(again, [0])
    text = render_card(again).text
    assert "import hf_layerswap  # registers the loader" in text and "`hf_layerswap` is not needed" not in text


def test_fp16_conversion_flushing_tiny_survivors_is_not_a_change():
    model = tiny_model("llama", 6)
    report = sparsify(model, tiny_batch(), sparsity=0.5, allocation="uniform", pruner="sparsegpt")
    weight = decoder_blocks(model)[2][0].self_attn.q_proj.weight
    survivor = int((weight.data.view(-1) != 0).nonzero()[0])
    weight.data.view(-1)[survivor] = 2e-8  # below fp16's smallest subnormal: it becomes 0 in half precision
    model.half()
    assert sum(int((lin.weight == 0).sum()) for _, lin in prunable_linears(decoder_blocks(model)[2][0])) == (
        report.blocks[0].num_zeros + 1
    )
    assert sparsity_mismatches(model, report) == [] and sparsity_mismatches(model) == []


def test_sparsity_only_config_scores_and_sparsifies_without_removal(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_model("llama", 4).save_pretrained(tmp_path / "base")
    cfg = LayerSwapConfig(calibration=tiny_batch(), sparsity=0.5, allocation="uniform", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg, attn_implementation="eager")
    assert model.config.num_hidden_layers == 4 and model.layerswap_report.num_blocks == 4
    assert model.layerswap_sparsity_report.achieved_sparsity == 0.5
    assert model.config.layerswap_sparsity["original_blocks"] == [0, 1, 2, 3]


def test_a_report_keeps_the_earlier_passes_and_a_stale_attached_report_is_not_published(tmp_path):
    model = tiny_model("llama", 6)
    sparsify(model, tiny_batch(), sparsity=0.5, allocation="uniform", pruner="wanda")
    second = sparsify(model, tiny_batch(), sparsity=0.6, allocation="uniform", pruner="wanda")
    section = _section(render_card(model, sparsity_report=second, plots=[]).text)
    assert "| Earlier pruning passes (oldest first) | wanda, unstructured, uniform allocation, target 50.00%" in section
    # the user drops the summary: the report the model still carries is not published by default
    del model.config.layerswap_sparsity
    folder = save_for_hub(model, tmp_path / "plain")
    assert SPARSITY_FILE not in {p.name for p in folder.iterdir()}
    assert "## Sparsity" not in (folder / "README.md").read_text()


def test_magnitude_card_does_not_claim_calibration(tmp_path):
    model = tiny_model("llama", 6)
    sparsify(model, tiny_batch(), sparsity=0.5, allocation="uniform", pruner="magnitude")
    section = _section(render_card(model, plots=[]).text)
    assert "pruned one-shot by weight magnitude." in section
    assert "calibrated" not in section and "| Calibration |" not in section


def test_ghosted_checkpoint_in_a_subfolder_loads_plainly_with_a_warning(tmp_path, caplog):
    """The plugin looks for the operator file where the model was named; where it cannot
    see it (a subfolder), the weights still load, with a warning, and attaching by hand works."""
    import logging

    from transformers import AutoModelForCausalLM

    from hf_layerswap.surgery import attach_saved_recovery, attached_operators

    model = tiny_model("llama", 6)
    recover(model, [2, 3], tiny_batch(batch=6, length=16, pad_last=0), method="ghosted")
    model.save_pretrained(tmp_path / "repo" / "sub")
    with caplog.at_level(logging.WARNING, logger="hf_layerswap.integration"):
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="sub", attn_implementation="eager")
    assert attached_operators(again) == []
    assert "loaded as the plainly pruned model, without the repair operators" in caplog.text
    assert attach_saved_recovery(again, tmp_path / "repo" / "sub") == [2]
    batch = tiny_batch()
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, model(**batch).logits)
