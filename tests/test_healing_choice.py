"""Healing's defaults: the budget chosen for the model and the device, the learning rate
chosen by a probe on the held-out KL, both recorded, priced and honoured when given."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_layerswap as hl
from conftest import counted_prune, pruned_pair, tiny_batch, tiny_model
from hf_layerswap.card.healing import heal_command, healing_section
from hf_layerswap.cli import build_parser
from hf_layerswap.cli.heal import heal_config
from hf_layerswap.config import HealConfig
from hf_layerswap.cost import Throughput
from hf_layerswap.cost.steps import ModelShape, block_flops, heal_budget
from hf_layerswap.healing import HEAL_METHODS, distillation_loss, heal, register_heal_method
from hf_layerswap.healing.choice import HEAL_SECONDS, probe_steps, time_budget
from hf_layerswap.healing.distill import RUN_FILE

def _pair():
    return pruned_pair((2, 3))


def _kl(student, teacher, prompts) -> float:
    with torch.no_grad():
        return float(distillation_loss(student(input_ids=prompts["input_ids"]).logits,
                                       teacher(input_ids=prompts["input_ids"]).logits, prompts["attention_mask"]))


def test_heal_at_its_defaults_lowers_the_kl_on_unseen_prompts_by_a_fifth():
    # 260 prompts of 128 tokens: 256 train (64 steps of 4), 4 held out; unseen: 16 other prompts.
    # The former defaults (4,096 tokens, lr 1e-4) lowered it by 7% here
    calibration = tiny_batch(batch=260, length=128, seed=3, pad_last=0)
    unseen = tiny_batch(batch=16, length=128, seed=11, pad_last=0)
    student, teacher = _pair()
    before = _kl(student, teacher, unseen)
    report = heal(student, teacher, calibration)
    after = _kl(student, teacher, unseen)
    assert after <= 0.8 * before, (before, after)
    budget, probe = report.choice["max_tokens"], report.choice["learning_rate"]
    # the device's time target allows far more on a tiny model: one pass over the 256 training prompts
    assert budget["rule"] == "time" and budget["text_limited"] and budget["device"] == "cpu"
    assert budget["throughput"].startswith("forwards timed on cpu (CPU time over torch threads): student ") and "per 4 x 128 tokens" in budget["throughput"]
    assert report.steps == budget["steps"] == 64 and report.settings["max_tokens"] == 64 * 4 * 128
    assert report.tokens == 64 * 4 * 128 and report.epochs == 1.0
    assert probe["rule"] == "probe" and probe["steps"] == probe_steps(64) == 4 and probe["prompts"] == 16
    assert [c["learning_rate"] for c in probe["candidates"]] == [3e-4, 1e-3, 3e-3]
    assert report.learning_rate == min(probe["candidates"], key=lambda c: c["kl"])["learning_rate"]
    assert probe["kl_before"] == pytest.approx(report.kl_before)
    # the values chosen, given explicitly: the same steps on the same prompts, the same weights
    again, _ = _pair()
    given = heal(again, teacher, calibration, max_tokens=report.settings["max_tokens"],
                 learning_rate=report.learning_rate)
    assert given.choice == {"max_tokens": {"rule": "given"}, "learning_rate": {"rule": "given"}}
    assert given.kl_after == report.kl_after
    assert all(torch.equal(a, b) for a, b in zip(student.state_dict().values(), again.state_dict().values()))


def test_given_values_are_honoured_exactly_and_nothing_is_probed(monkeypatch):
    import hf_layerswap.healing.distill as core

    def refused(*args, **kwargs):
        raise AssertionError("probed or timed although both values were given")

    monkeypatch.setattr(core, "probe_learning_rate", refused)
    monkeypatch.setattr(core, "_default_budget", refused)
    student, teacher = _pair()
    report = heal(student, teacher, tiny_batch(batch=12, length=16, seed=3, pad_last=0), max_tokens=96,
                  learning_rate=2.5e-3, batch_size=2, heldout_prompts=2)
    assert report.learning_rate == 2.5e-3 and report.settings["max_tokens"] == 96 and report.steps == 3
    assert report.choice == {"max_tokens": {"rule": "given"}, "learning_rate": {"rule": "given"}}


def test_the_probe_never_picks_a_diverging_rate_and_the_run_given_a_budget_keeps_it():
    register_heal_method("test_wild_rates", options=("k",), learning_rates=(1e4, 1e-3))(
        type("Wild", (HEAL_METHODS["last_k"],), {}))
    try:
        student, teacher = _pair()
        report = heal(student, teacher, tiny_batch(batch=20, length=16, seed=3, pad_last=0), method="test_wild_rates",
                      k=2, max_tokens=8 * 2 * 16, batch_size=2, heldout_prompts=2)
    finally:
        del HEAL_METHODS["test_wild_rates"]
    probe = report.choice["learning_rate"]
    assert [c["learning_rate"] for c in probe["candidates"]] == [1e-3, 1e4]  # ascending
    wild = probe["candidates"][1]["kl"]
    assert not math.isfinite(wild) or wild > probe["candidates"][0]["kl"]
    assert report.learning_rate == 1e-3 and probe["steps"] == 2 and report.steps == 8
    assert report.choice["max_tokens"] == {"rule": "given"}


@pytest.mark.parametrize("rates", [(), (0.0,), (float("nan"),), (True,)])
def test_a_method_with_bad_candidate_rates_is_refused(rates):
    with pytest.raises(ValueError, match=r"learning_rates=.*must be a non-empty sequence of finite numbers > 0"):
        register_heal_method("test_bad_rates", learning_rates=rates)
    assert "test_bad_rates" not in HEAL_METHODS


def test_the_budget_is_the_whole_steps_that_fit_the_time_target_at_the_rates():
    model = tiny_model("llama", num_blocks=6, seed=0)
    shape = ModelShape(model)
    rates = Throughput(2e9, 1e9, source="fixed for the test")
    budget = heal_budget(shape, 4, rates, 4, 128)
    # one step: the student's 4 blocks forward + backward (3 forwards) and the teacher's 6, the head after each
    positions, hidden, vocab = 4 * 128, model.config.hidden_size, model.config.vocab_size
    per_block = block_flops(sum(p.numel() for p in model.model.layers[0].parameters()), positions, 128, hidden)
    step = (3 * 4 + 6) * per_block / 2e9 + (3 + 1) * 2.0 * positions * hidden * vocab / 1e9
    assert budget["step_seconds"] == pytest.approx(step, rel=1e-12)
    assert budget["steps"] == math.floor(HEAL_SECONDS / step) and budget["max_tokens"] == budget["steps"] * 512
    assert budget["seconds"] == HEAL_SECONDS == 600.0
    slow = heal_budget(shape, 4, Throughput(1.0, 1.0), 4, 128)
    assert slow["steps"] == 1 and slow["max_tokens"] == 512  # at least one step
    # heal's own: the two forwards timed on the device, the student's three times (forward + backward)
    timed = time_budget(0.5, 1.5, 4, 128)
    assert (timed["step_seconds"], timed["steps"], timed["max_tokens"]) == (3.0, 200, 200 * 512)
    assert timed["tokens_per_second"] == 512 / 3.0


def _tiny_llama(layers: int = 8):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_dry_run_prices_the_chosen_budget_and_the_probe_as_the_real_prune_runs_them():
    torch.manual_seed(0)
    calib = {"input_ids": torch.randint(0, 128, (7, 16)), "attention_mask": torch.ones(7, 16, dtype=torch.long)}
    # 7 prompts of 16 tokens, 2 held out: one pass over the 5 others is 2 steps of 2 (the time target
    # allows thousands on this model); the probe: 3 rates x 2 steps on 4 prompts, an evaluation after each
    healing = HealConfig(seq_len=16, batch_size=2, eval_every=4, heldout_prompts=2)
    assert healing.max_tokens is None and healing.learning_rate is None
    config = hl.LayerSwapConfig(layers=[3, 5], heal=healing, batch_size=4, num_prompts=7, progress=False)
    estimate = hl.estimate_cost(_tiny_llama(), config, calibration=calib, throughput=Throughput(1e9, 1e9))
    phase = estimate.phases["healing"]
    assert phase["budget"]["steps"] == 2 and phase["budget"]["max_tokens"] == 2 * 2 * 16
    assert phase["probe"] == {"candidates": [3e-4, 1e-3, 3e-3], "steps": 2, "prompts": 4}
    assert estimate.exact and phase["exact"]
    assert (estimate.block_passes, estimate.head_passes) == counted_prune(_tiny_llama().config, config, calib)
    # per step the student's 6 blocks and the teacher's 8; the probe's 3 x 2 steps likewise; evaluations
    # (both models, one batch): the finite-start check, before training, after the last step, and the
    # probe's start and one per rate; the budget's timing: 4 forwards of each model (one untimed)
    assert phase["block_passes"] == 2 * 14 + 6 * 14 + (3 + 4) * 14 + 4 * 14
    lines = "\n".join(estimate.lines())
    assert "budget chosen: 64 tokens, 2 steps" in lines
    assert "learning-rate probe: 3 rates (0.0003, 0.001, 0.003) x 2 steps on 4 prompts" in lines


def test_an_interrupted_run_at_the_defaults_resumes_with_what_it_chose(tmp_path, monkeypatch):
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                raise KeyboardInterrupt

    calibration = tiny_batch(batch=34, length=16, seed=3, pad_last=0)
    kw = dict(batch_size=2, heldout_prompts=2, eval_every=2, method="last_k", k=2)
    whole, teacher = _pair()
    expected = heal(whole, teacher, calibration, **kw)
    cut, _ = _pair()
    with pytest.raises(KeyboardInterrupt):
        heal(cut, teacher, calibration, checkpoint_dir=tmp_path, callbacks=[Interrupt()], **kw)
    saved = (tmp_path / RUN_FILE).read_text(encoding="utf-8")
    assert '"rule": "probe"' in saved and '"rule": "time"' in saved
    import hf_layerswap.healing.distill as core

    def refused(*args, **kwargs):
        raise AssertionError("chose again on resume")

    monkeypatch.setattr(core, "probe_learning_rate", refused)
    monkeypatch.setattr(core, "_default_budget", refused)
    report = heal(cut, teacher, calibration, checkpoint_dir=tmp_path, **kw)  # the first call's choice, read back
    assert report.choice == json.loads(saved)["choice"]
    assert report.choice["learning_rate"]["candidates"] == expected.choice["learning_rate"]["candidates"]
    assert report.choice["max_tokens"]["steps"] == expected.choice["max_tokens"]["steps"] == 16
    assert report.learning_rate == expected.learning_rate and report.steps == expected.steps == 16
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), cut.state_dict().values()))


def test_the_card_and_the_command_show_what_was_chosen():
    student, teacher = _pair()
    report = heal(student, teacher, tiny_batch(batch=20, length=16, seed=3, pad_last=0), batch_size=2,
                  heldout_prompts=2, method="last_k", k=2)
    text = healing_section(student.config.layerswap)
    row = next(line for line in text.splitlines() if line.startswith("| Budget and learning rate |"))
    steps = report.choice["max_tokens"]["steps"]
    assert f"budget chosen for the device: {steps} steps ({steps * 2 * 16:,} tokens) to fit 10.0 min on cpu" in row
    assert "; fewer: one pass over the training text" in row
    rates = ", ".join(f"{c['learning_rate']} → {c['kl']:.4f}" for c in report.choice["learning_rate"]["candidates"])
    assert f"learning rate {report.learning_rate} chosen by a probe on the held-out KL: 2 steps at each rate" in row
    assert rates in row
    command = heal_command(student.config.layerswap["healing"][-1])
    assert f"--max-tokens {steps * 2 * 16} " in command and f"--learning-rate {report.learning_rate!r} " in command


def test_the_cli_leaves_both_to_heal_unless_given():
    parser = build_parser()
    args = parser.parse_args(["heal", "pruned", "base", "out"])
    config = heal_config(args)
    assert config.max_tokens is None and config.learning_rate is None
    args = parser.parse_args(["heal", "pruned", "base", "out", "--max-tokens", "8192", "--learning-rate", "2e-4"])
    config = heal_config(args)
    assert config.max_tokens == 8192 and config.learning_rate == 2e-4
    for bad, message in (({"max_tokens": 0}, r"HealConfig\(max_tokens=0\): must be an int >= 1 or None"),
                         ({"learning_rate": -1.0}, r"HealConfig\(learning_rate=-1.0\): must be a finite number > 0")):
        with pytest.raises(ValueError, match=message):
            HealConfig(**bad)
    student, teacher = _pair()
    with pytest.raises(ValueError, match=r"learning_rate=0: must be a finite number > 0 or None"):
        heal(student, teacher, tiny_batch(batch=12, length=16), learning_rate=0)
    with pytest.raises(ValueError, match=r"max_tokens=0: must be an int >= 1 or None"):
        heal(student, teacher, tiny_batch(batch=12, length=16), max_tokens=0)
