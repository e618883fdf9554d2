"""The steps of a prune (hf_layerswap/steps.py): one loop in ``prune``, ``estimate_cost`` and
the card; an ordered recipe after the removal (remove -> heal -> sparsify -> heal) through
``hl.prune``, ``from_pretrained`` and the CLI; the default path unchanged."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_batch, tiny_checkpoint, tiny_model
from transformers import AutoModelForCausalLM, TrainerCallback

import hf_layerswap as hl
from hf_layerswap.card import render_card
from hf_layerswap.card.checks import sparsity_mismatches
from hf_layerswap.cli import main
from hf_layerswap.config import HealConfig, RecoveryConfig, SparsityConfig
from hf_layerswap.cost import Throughput, estimate_cost
from hf_layerswap.healing.distill import RUN_FILE
from hf_layerswap.healing.measure import PERPLEXITY_STAGES
from hf_layerswap.healing.trainer import DistillationTrainer
from hf_layerswap.layerplan import decoder_blocks
from hf_layerswap.sparsity.engine import prunable_linears
from hf_layerswap.steps import HealStep, RemoveStep, ScoreStep, SelectStep, SparsifyStep, recipe_steps

pytestmark = pytest.mark.filterwarnings("ignore::hf_layerswap.calibration.CalibrationShortfallWarning")

RATES = Throughput(block_flops_per_second=1e9, head_flops_per_second=1e9, source="given")


def _heal(**extra):
    return HealConfig(method="last_k", max_tokens=8 * 16 * 4, seq_len=16, learning_rate=1e-3, eval_every=2,
                      patience=3, options={"k": 2}, **extra)


def _sparse():
    return SparsityConfig(0.5, allocation="uniform", pruner="magnitude")


def _recipe_config(**extra):
    return hl.LayerSwapConfig(layers=[2, 3], calibration=tiny_batch(batch=12, length=16, seed=3, pad_last=0),
                              recipe=[_heal(), _sparse(), _heal(seed=1)], progress=False, **extra)


def _zeros(model) -> int:
    _, _, blocks = decoder_blocks(model)
    return sum(int((lin.weight == 0).sum()) for block in blocks for _, lin in prunable_linears(block))


def _kinds(record) -> list[str]:
    return [entry["step"] for entry in record["recipe"]]


def test_recipe_heal_sparsify_heal_through_prune_keeps_the_sparsity_and_reloads(tmp_path):
    model = tiny_model("llama", num_blocks=6, seed=0)
    result = hl.prune(model, _recipe_config())
    record = model.config.layerswap
    assert _kinds(record) == ["remove", "heal", "sparsify", "heal"]
    assert [entry["step"] for entry in record["steps"][-1]["config"]["recipe"]] == ["heal", "sparsify", "heal"]
    sparsify_entry = record["recipe"][2]
    sparsity = model.config.layerswap_sparsity
    # the second heal kept every zero: the sparsify step's achieved sparsity is still the model's, exactly
    assert _zeros(model) == sparsity["num_zeros"] == sparsify_entry["num_zeros"]
    assert _zeros(model) / sparsity["num_params"] == sparsify_entry["achieved_sparsity"] == sparsity["achieved_sparsity"]
    assert sparsity_mismatches(model) == []
    assert len(result.heal_reports) == 2 and result.heal_report is result.heal_reports[1]
    assert not result.heal_reports[1].reverted and result.heal_reports[1].steps > 0
    assert result.heal_reports[1].kept_zeros["zeros"] == sparsity["num_zeros"]
    assert [h["stale"] is not None for h in (dict(h, stale=h.get("stale")) for h in record["healing"])] == [True, False]
    assert record["recipe"][3]["kept_zeros"] == sparsity["num_zeros"] and record["recipe"][3]["run"] == 2
    hl.save_for_hub(model, tmp_path / "out", sparsity_report=result.sparsity_report)
    card = (tmp_path / "out" / "README.md").read_text()
    rows = [line.split(" | ")[1] for line in card.split("## Steps")[1].splitlines() if line.startswith("| ") and
            line.split(" | ")[0][2:].isdigit()]
    assert rows == ["Remove", "Heal", "Sparsify", "Heal"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert _zeros(reloaded) == sparsity["num_zeros"] and reloaded.config.num_hidden_layers == 4
    assert _kinds(reloaded.config.layerswap) == ["remove", "heal", "sparsify", "heal"]
    saved = hl.LayerSwapConfig.from_dict(reloaded.config.layerswap["steps"][-1]["config"])
    assert saved.after_removal() == _recipe_config().after_removal()


def test_recipe_through_from_pretrained_and_its_config_round_trip(tmp_path):
    tiny_model("llama", num_blocks=6, seed=0).save_pretrained(tmp_path / "base")
    cfg = _recipe_config()
    assert hl.LayerSwapConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg,
                                                 attn_implementation="eager")
    direct = tiny_model("llama", num_blocks=6, seed=0)
    hl.prune(direct, _recipe_config())
    assert _kinds(model.config.layerswap) == ["remove", "heal", "sparsify", "heal"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), direct.state_dict().values()))
    model.save_pretrained(tmp_path / "saved")
    stored = json.loads((tmp_path / "saved" / "config.json").read_text())  # plain: the config in the step's record
    assert "quantization_config" not in stored
    recorded = stored["layerswap"]["steps"][-1]["config"]
    assert [e["step"] for e in recorded["recipe"]] == ["heal", "sparsify", "heal"]
    assert hl.LayerSwapConfig.from_dict(recorded).after_removal() == cfg.after_removal()


def test_estimate_cost_prices_each_step_of_the_recipe_in_order():
    cfg = _recipe_config()
    est = estimate_cost(tiny_model("llama", num_blocks=6, seed=0), cfg, throughput=RATES)
    assert list(est.phases) == ["healing", "sparsity", "healing 2"]
    heal_only = estimate_cost(tiny_model("llama", num_blocks=6, seed=0),
                              hl.LayerSwapConfig(layers=[2, 3], calibration=cfg.calibration, heal=_heal(),
                                                 progress=False), throughput=RATES)
    sparse_only = estimate_cost(tiny_model("llama", num_blocks=6, seed=0),
                                hl.LayerSwapConfig(layers=[2, 3], calibration=cfg.calibration, sparsity=_sparse(),
                                                   progress=False), throughput=RATES)
    assert est.phases["healing"]["block_passes"] == heal_only.phases["healing"]["block_passes"] > 0
    assert est.phases["healing 2"]["block_passes"] == heal_only.phases["healing"]["block_passes"]
    assert est.phases["sparsity"]["block_passes"] == sparse_only.phases["sparsity"]["block_passes"] > 0
    assert est.block_passes == 2 * heal_only.block_passes + sparse_only.block_passes
    lines = est.lines()
    assert [line.split()[0] for line in lines if line.startswith("  healing") or line.startswith("  sparsity")] == [
        "healing", "sparsity", "healing"]


def test_steps_of_a_config_in_order():
    scored = hl.LayerSwapConfig(num_to_remove=2, recovery="ghosted", heal=_heal())
    assert [type(s) for s in recipe_steps(scored)] == [ScoreStep, SelectStep, RemoveStep, type(recipe_steps(scored)[3]),
                                                      HealStep]
    assert [s.kind for s in recipe_steps(scored)] == ["score", "select", "remove", "repair", "heal"]
    assert [s.kind for s in recipe_steps(_recipe_config())] == ["remove", "heal", "sparsify", "heal"]
    assert [s.kind for s in recipe_steps(hl.LayerSwapConfig(sparsity=0.5))] == ["score", "sparsify"]
    assert isinstance(recipe_steps(_recipe_config())[2], SparsifyStep)
    assert recipe_steps(scored)[2].repaired and not recipe_steps(_recipe_config())[0].repaired


def test_recipe_refusals_name_the_value_and_why():
    with pytest.raises(ValueError, match=r"LayerSwapConfig\(recipe=\.\.\., heal=\.\.\.\) is contradictory"):
        hl.LayerSwapConfig(layers=[2], recipe=[_heal()], heal="lora")
    with pytest.raises(ValueError, match=r"step 1 is a repair \('ghosted'\) after 'heal': a repair fits the cut on "
                                         r"the dense model's streams"):
        hl.LayerSwapConfig(layers=[2], recipe=[_heal(), RecoveryConfig("ghosted")])
    with pytest.raises(ValueError, match=r"recipe\[0\]=\{'step': 'prune'\}\): its 'step' must be one of "
                                         r"\['repair', 'heal', 'sparsify'\]"):
        hl.LayerSwapConfig(layers=[2], recipe=[{"step": "prune"}])
    with pytest.raises(ValueError, match=r"recipe\[0\]=heal 'last_k'\) needs num_to_remove or layers"):
        hl.LayerSwapConfig(recipe=[_heal()])
    with pytest.raises(ValueError, match=r"LayerSwapConfig\(sparsity=1\.5\): must be a float in \[0, 1\)"):
        hl.LayerSwapConfig(layers=[2], recipe=[SparsityConfig(1.5)])
    repaired = hl.LayerSwapConfig(layers=[2], recipe=[{"step": "repair", "method": "fused"}, _heal()])
    assert repaired.repair() == RecoveryConfig("fused") and repaired.recovery is None


def test_prune_recipe_through_the_cli(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "base", tiny_model("llama", num_blocks=6, seed=0))
    text = tmp_path / "calib.txt"
    text.write_text("\n\n".join(" ".join(f"w{(7 * p + 3 * k) % 120}" for k in range(40)) for p in range(24)) + "\n")
    heal = ["--heal", "last_k", "--heal-option", "k=2", "--heal-max-tokens", "512", "--heal-seq-len", "16",
            "--heal-learning-rate", "1e-3", "--heal-eval-every", "2", "--heal-perplexity", str(text)]
    sparse = ["--sparsity", "0.5", "--allocation", "uniform", "--pruner", "magnitude"]

    def argv(out, *flags):
        return ["prune", str(tmp_path / "base"), str(tmp_path / out), "--layers", "2", "3", "--calibration", str(text),
                *flags]

    assert main(argv("p", "--recipe", "heal,sparsify,heal", *heal, *sparse)) == 0
    saved = json.loads((tmp_path / "p" / "config.json").read_text())
    assert _kinds(saved["layerswap"]) == ["remove", "heal", "sparsify", "heal"]
    assert saved["layerswap"]["recipe"][2]["num_zeros"] == saved["layerswap_sparsity"]["num_zeros"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "p")
    assert _zeros(reloaded) == saved["layerswap_sparsity"]["num_zeros"]
    card = (tmp_path / "p" / "README.md").read_text()
    assert "| 2 | Heal |" in card and "| Perplexity after the sparsification (where this run started) | " in card
    first, second = saved["layerswap"]["healing"]  # the second heal starts after the sparsify: its own stages
    measured = [[k for k in PERPLEXITY_STAGES if run["perplexity"].get(k) is not None] for run in (first, second)]
    assert second["perplexity"]["start"] == "after_sparsity" and first["stale"].startswith("sparsification")
    assert measured == [["dense", "after_cut", "after_healing"],
                        ["dense", "after_cut", "after_sparsity", "after_healing"]]
    capsys.readouterr()
    assert main(argv("q", "--recipe", "heal,sparsify,heal", *heal, "--dry-run", *sparse)) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.startswith(("  healing", "  sparsity"))] == [
        "healing", "sparsity", "healing"]
    priced = [line.split(": ")[-1].rstrip(")") for line in out.splitlines() if "of which perplexity" in line]
    assert priced == [", ".join(stages) for stages in measured]  # each heal step priced with the stages it measures
    for flags, message in (
        (["--recipe", "heal,prune"], "error: --recipe 'heal,prune': give comma-separated steps from ['repair', "
                                     "'heal', 'sparsify'], e.g. heal,sparsify,heal (['prune'] unknown)"),
        (["--recipe", "heal,sparsify"], "error: --recipe heal,sparsify needs --sparsity for its sparsify step"),
        (["--recipe", "heal", *sparse], "error: --sparsity given but --recipe heal has no such step"),
        (["--recipe", "sparsify,repair", "--recovery", "ghosted", *sparse], "error: LayerSwapConfig(recipe=...): "
                                                                             "step 1 is a repair ('ghosted') after 'sparsify'"),
    ):
        assert main(argv("r", *flags)) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "r").exists()


def test_the_default_path_is_the_fixed_sequence_of_the_public_verbs():
    # LayerSwapConfig(num_to_remove=n): score -> select -> remove, as before the steps; the record
    # gains only the "recipe" list (and the config its "recipe": None)
    calib = tiny_batch(batch=8, length=16)
    model = tiny_model("llama", num_blocks=6, seed=0)
    result = hl.prune(model, hl.LayerSwapConfig(num_to_remove=2, strategy="greedy", calibration=calib,
                                                progress=False))
    manual = tiny_model("llama", num_blocks=6, seed=0)
    cal = hl.build_calibration(calib)
    report = hl.score_layers(manual, cal, protocols=("interchange",), progress=False)
    layers = hl.select_layers(report, 2, protocol="interchange")
    hl.remove_layers(manual, layers)
    assert result.removed == layers == manual.config.layerswap["removed_layers"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), manual.state_dict().values()))
    assert set(model.config.layerswap) - set(manual.config.layerswap) == {"recipe"}
    assert _kinds(model.config.layerswap) == ["score", "select", "remove"]
    assert hl.LayerSwapConfig(num_to_remove=2).to_dict()["recipe"] is None
    assert "## Steps" not in str(render_card(model, report=result.report, plots=[]))
    copied = copy.deepcopy(model.config.layerswap)
    assert [e["removal_step"] for e in copied["recipe"]] == [0, 0, 0]


class _InterruptSecondHeal(TrainerCallback):
    def __init__(self):
        self.trainers = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainers += 1

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainers == 2 and state.global_step == 4:
            raise KeyboardInterrupt


def test_an_interrupted_recipe_resumes_each_heal_from_its_own_folder(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "base", tiny_model("llama", num_blocks=6, seed=0))
    text = tmp_path / "calib.txt"
    text.write_text("\n\n".join(" ".join(f"w{(7 * p + 3 * k) % 120}" for k in range(40)) for p in range(24)) + "\n")

    def command(out):
        return ["prune", str(tmp_path / "base"), str(tmp_path / out), "--layers", "2", "3", "--calibration", str(text),
                "--recipe", "heal,sparsify,heal", "--heal", "last_k", "--heal-option", "k=2", "--heal-max-tokens",
                "512", "--heal-seq-len", "16", "--heal-learning-rate", "1e-3", "--heal-eval-every", "2",
                "--sparsity", "0.5", "--allocation", "uniform", "--pruner", "magnitude"]

    assert main(command("whole")) == 0
    interrupt, original = _InterruptSecondHeal(), DistillationTrainer.__init__

    def with_interrupt(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.add_callback(interrupt)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DistillationTrainer, "__init__", with_interrupt)
        assert main(command("p")) == 130
    folder = tmp_path / "p.heal-checkpoints"
    assert (folder / RUN_FILE).is_file() and (folder / "heal-2" / RUN_FILE).is_file()
    assert "run the same command again to resume" in capsys.readouterr().err
    assert main(command("p")) == 0  # each heal resumes from its own checkpoints, then the run ends
    assert not folder.exists()
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "p").state_dict()
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "whole").state_dict()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_the_steps_table_names_the_repair_as_its_record_states_it():
    # the repair row read only the method and printed "at boundaries none ..., stored in `None`"
    model = tiny_model("llama", num_blocks=6, seed=0)
    config = hl.LayerSwapConfig(layers=[2], recovery="ghosted", calibration=tiny_batch(batch=8, length=16, seed=3))
    result = hl.prune(model, config)
    card = str(render_card(result.model, report=result.report, plots=[]))
    row = next(line for line in card.splitlines() if line.startswith("| 2 | Repair |"))
    assert "at boundaries 2 (pruned numbering)" in row and "`layerswap_recovery.safetensors`" in row
    assert "none" not in row and "None" not in row
