"""Healing: distillation from the dense teacher through transformers' Trainer."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import re
import shlex
import warnings
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

import hf_layerswap as hl
from hf_layerswap.card import check_card
from hf_layerswap.card.healing import heal_command, healing_section
from hf_layerswap.cli import main
from hf_layerswap.cli.heal import add_heal_args, heal_config
from hf_layerswap.config import HealConfig, LayerSwapConfig
from hf_layerswap.healing import distillation_loss
from hf_layerswap import layerplan as hl_plan
from hf_layerswap.healing.distill import RUN_FILE
from hf_layerswap.healing.teacher import teacher_origin
from hf_layerswap.healing.loss import teacher_top_k, top_k_distillation_loss
from hf_layerswap.healing.methods import cut_neighbours
from hf_layerswap.healing.trainer import DistillationTrainer, resolve_patience
from hf_layerswap.surgery.history import verify_history, weights_changed_later, weights_sample
from hf_layerswap.pipeline import prune
from hf_layerswap.card.checks import sparsity_mismatches
from hf_layerswap.layerplan import decoder_blocks
from hf_layerswap.sparsity.engine import prunable_linears

from conftest import assert_model_unchanged, pruned_pair, snapshot_model, tiny_batch, tiny_checkpoint, tiny_model

REMOVED = [2, 3]


def _pair():
    return pruned_pair(REMOVED)


def _calibration(n=12, length=16):
    return tiny_batch(batch=n, length=length, seed=3, pad_last=0)


class _Vocab:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return len(self.vocab)


def _heldout_kl(student, teacher, calib):
    ids, mask = calib["input_ids"][-4:], calib["attention_mask"][-4:]
    with torch.no_grad():
        return float(distillation_loss(student(input_ids=ids).logits, teacher(input_ids=ids).logits, mask))


def test_distillation_loss_hand_computed():
    # one position, two tokens: teacher p = (0.5, 0.5), student q = softmax(0, log 3) = (0.25, 0.75)
    t = torch.zeros(1, 1, 2)
    s = torch.tensor([[[0.0, torch.log(torch.tensor(3.0))]]])
    kl = distillation_loss(s, t, torch.ones(1, 1))
    expected = 0.5 * torch.log(torch.tensor(0.5 / 0.25)) + 0.5 * torch.log(torch.tensor(0.5 / 0.75))
    assert kl.item() == pytest.approx(expected.item(), abs=1e-6)
    assert distillation_loss(t, t, torch.ones(1, 1)).item() == pytest.approx(0.0, abs=1e-7)


def test_cut_neighbours_from_record():
    student, _ = _pair()
    # original 0..5, removed 2,3: kept [0, 1, 4, 5]; blocks 1 and 2 (original 1 and 4) border the cut
    assert cut_neighbours(student) == [1, 2]


@pytest.mark.parametrize("method,lr,options", [("lora", 1e-2, {"lora_r": 4}), ("adjacent", 1e-3, {}), ("last_k", 1e-3, {"k": 2})])
def test_heal_lowers_heldout_kl_and_reloads_plain(tmp_path, method, lr, options):
    student, teacher = _pair()
    calib = _calibration()
    before = _heldout_kl(student, teacher, calib)
    report = hl.heal(student, teacher, calib, method=method, max_tokens=8 * 16 * 4, seq_len=16,
                     batch_size=4, learning_rate=lr, eval_every=2, patience=3, **options)
    assert report.kl_before == pytest.approx(before, rel=1e-5)
    after = _heldout_kl(student, teacher, calib)
    assert after == pytest.approx(report.kl_after, rel=1e-5, abs=1e-7)  # LoRA merged: fp32 rounding
    assert after < before and not report.reverted
    assert not any("lora" in name for name, _ in student.named_modules())
    assert type(student).__module__.startswith("transformers.")
    record = student.config.layerswap
    assert record["removed_layers"] == REMOVED
    assert record["healing"][-1]["method"] == method
    assert record["healing"][-1]["kl_after"] == report.kl_after
    # healing changes the weights on purpose: the removal's fingerprint no longer applies
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verify_history(student)
    student.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = calib["input_ids"][:2]
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, student(input_ids=ids).logits)
    assert reloaded.config.layerswap["healing"] == record["healing"]
    assert hl.HealReport.from_json(report.to_json()) == report


def test_divergent_learning_rate_returns_start_weights():
    student, teacher = _pair()
    start = {k: v.clone() for k, v in student.state_dict().items()}
    report = hl.heal(student, teacher, _calibration(), method="last_k", max_tokens=4 * 16 * 4, seq_len=16,
                     batch_size=4, learning_rate=1e4, eval_every=1, patience=2)
    assert report.reverted and report.kl_after == report.kl_before
    assert all(torch.equal(student.state_dict()[k], v) for k, v in start.items())
    assert report.patience == 2 and report.steps == 2  # two evaluations without improvement, then the stop


def test_a_measurement_failing_after_training_leaves_the_healed_model_recorded(monkeypatch):
    # the healed weights were in the model with no healing record in config.layerswap
    def broken(*_):
        raise RuntimeError("the evaluation after healing failed")

    student, teacher = _pair()
    start = {k: v.clone() for k, v in student.state_dict().items()}
    monkeypatch.setattr(hl.healing.measure.HealMeasures, "finish", broken)
    with pytest.raises(RuntimeError, match="after healing failed"):
        hl.heal(student, teacher, _calibration(), method="last_k", k=2, max_tokens=4 * 16 * 4, seq_len=16,
                learning_rate=1e-3, eval_every=1)
    entry = student.config.layerswap["healing"][-1]
    assert not all(torch.equal(student.state_dict()[k], v) for k, v in start.items())  # healed
    assert entry["steps"] == 4 and entry["kl_after"] < entry["kl_before"] and entry["perplexity"] == {}
    assert student.layerswap_heal_report.kl_after == entry["kl_after"]


def test_tokens_per_step_is_what_the_steps_trained():
    # 8 training prompts in batches of 3: an epoch is 3 + 3 + 2 prompts, 128 real tokens in 3 steps
    student, teacher = _pair()
    report = hl.heal(student, teacher, _calibration(), method="last_k", k=2, max_tokens=3 * 3 * 16, seq_len=16,
                     batch_size=3, eval_every=1, learning_rate=1e-3)
    assert (report.tokens, report.steps) == (128, 3)
    assert report.tokens_per_step == student.config.layerswap["healing"][-1]["tokens_per_step"] == 128 / 3


def test_given_tensors_count_their_own_width_in_the_budget():
    # 12 prompts of 32 tokens with seq_len=16 (a pipeline's removal tensors under the default 128 alike):
    # max_tokens is spent at the prompts' own width, not at seq_len's (8 steps, twice the budget)
    student, teacher = _pair()
    report = hl.heal(student, teacher, tiny_batch(batch=12, length=32, seed=3, pad_last=0), method="last_k", k=2,
                     max_tokens=4 * 4 * 32, seq_len=16, batch_size=4, eval_every=2, learning_rate=1e-3)
    assert (report.steps, report.tokens) == (4, 4 * 4 * 32)
    with pytest.raises(TypeError, match="calibration mapping needs torch tensors"):  # build_calibration's own words
        hl.heal(student, teacher, {k: v.tolist() for k, v in _calibration().items()}, method="last_k", k=2)


def test_default_patience_is_a_tenth_of_the_planned_evaluations():
    assert resolve_patience(None, 512, 4) == 13  # 128 evaluations planned
    assert resolve_patience(None, 400, 1) == 40
    assert resolve_patience(None, 8, 4) == 2 and resolve_patience(None, 1, 1) == 2  # at least 2
    assert resolve_patience(5, 512, 4) == 5  # a given count is kept
    student, teacher = _pair()
    # 24 steps, held-out KL after each: 24 evaluations planned, patience ceil(2.4) = 3; a divergent
    # rate never improves, so training stops after the third evaluation
    report = hl.heal(student, teacher, _calibration(), method="last_k", max_tokens=24 * 16 * 4, seq_len=16,
                     batch_size=4, learning_rate=1e4, eval_every=1)
    assert report.patience == 3 and report.steps == 3 and report.reverted
    assert student.config.layerswap["healing"][-1]["patience"] == 3


def test_mismatched_teacher_refused_before_training():
    student, teacher = _pair()
    start = {k: v.clone() for k, v in student.state_dict().items()}
    other = tiny_model("llama", num_blocks=6, vocab_size=64)
    with pytest.raises(ValueError, match="vocab_size=64"):
        hl.heal(student, other, _calibration())
    with pytest.raises(ValueError, match="teacher is the student itself"):
        hl.heal(student, student, _calibration())
    with pytest.raises(ValueError, match=r"^method='nope': allowed \['adjacent', 'last_k', 'lora'\]$"):
        hl.heal(student, teacher, _calibration(), method="nope")
    with pytest.raises(ValueError, match="teacher tokenizer"):
        hl.heal(student, teacher, _calibration(), tokenizer=_Vocab({"a": 0, "b": 1}), teacher_tokenizer=_Vocab({"a": 0, "c": 1}))
    with pytest.raises(ValueError, match="k=9"):
        hl.heal(student, teacher, _calibration(), method="last_k", k=9)
    deeper = tiny_model("llama", num_blocks=8, seed=0)  # same vocabulary, not the model the student was cut from
    with pytest.raises(ValueError, match="teacher has 8 blocks but the student was cut from a model of 6"):
        hl.heal(student, deeper, _calibration(), method="last_k", k=2)
    # a second cut: the model before it (4 blocks, the pipeline's teacher) or the original (6) teach it
    again = copy.deepcopy(student)
    hl.remove_layers(again, [0])
    with pytest.raises(ValueError, match="teacher has 5 blocks but the student was cut from a model of 4 or 6"):
        hl.heal(again, tiny_model("llama", num_blocks=5), _calibration(), method="last_k", k=2)
    assert hl.heal(again, student, _calibration(), method="last_k", k=2, max_tokens=64, seq_len=16).steps == 1
    assert all(torch.equal(student.state_dict()[k], v) for k, v in start.items())
    assert "healing" not in student.config.layerswap



def test_a_teacher_with_other_weights_is_refused_unless_allowed_and_then_named():
    # same shape, other weights: healing ran to exit 0 and the card said "distilled from the
    # dense model it was cut from"
    student, teacher = _pair()
    start = {k: v.clone() for k, v in student.state_dict().items()}
    foreign = tiny_model("llama", num_blocks=6, seed=1)
    step = student.config.layerswap["steps"][0]
    with pytest.raises(ValueError, match=re.escape(
            "the teacher is not the model the student was cut from: its weights differ from those config.layerswap "
            f"recorded before removal step 1 (fingerprint {hl_plan.model_fingerprint(foreign)[:12]} now; same shape, "
            "other weights")):
        hl.heal(student, foreign, _calibration(), method="last_k", k=2, max_tokens=64, seq_len=16)
    assert all(torch.equal(student.state_dict()[k], v) for k, v in start.items())
    assert "healing" not in student.config.layerswap
    # a bfloat16 or float16 copy of the right teacher is the same model
    assert step["weights_sample_before"] == weights_sample(teacher)
    for dtype in (torch.bfloat16, torch.float16):
        assert teacher_origin(student, copy.deepcopy(teacher).to(dtype))["matches"] is True
    assert teacher_origin(student, teacher)["matches"] is True
    # a record written before the dtype-independent fingerprint: the exact one in the recorded dtype
    old = copy.deepcopy(student)
    for entry in old.config.layerswap["steps"]:
        del entry["weights_sample_before"]
    assert teacher_origin(old, teacher)["matches"] is True
    with pytest.raises(ValueError, match="not the model the student was cut from"):
        teacher_origin(old, foreign)
    with pytest.warns(UserWarning, match=r"recorded only a torch\.float32 fingerprint .* the teacher is torch\.bfloat16"):
        unchecked = teacher_origin(old, copy.deepcopy(teacher).to(torch.bfloat16))
    assert unchecked["matches"] is None and "could not be checked" in unchecked["note"]
    # allowed: the report and the card name the other teacher and never call it the model it was cut from
    report = hl.heal(student, foreign, _calibration(), method="last_k", k=2, max_tokens=64, seq_len=16,
                     allow_foreign_teacher=True)
    assert report.teacher["matches"] is False and report.teacher["fingerprint"] == hl_plan.model_fingerprint(foreign)
    assert student.config.layerswap["healing"][-1]["teacher"] == report.teacher
    text = healing_section(student.config.layerswap)
    assert "**not the model it was cut from**" in text and "the dense model it was cut from" not in text
    assert heal_command(student.config.layerswap["healing"][-1]).endswith("--allow-foreign-teacher --option k=2")
    right, teacher = _pair()
    hl.heal(right, teacher, _calibration(), method="last_k", k=2, max_tokens=64, seq_len=16)
    assert "| Teacher | the dense model it was cut from (" in healing_section(right.config.layerswap)


def test_a_misspelt_keyword_is_an_unknown_keyword_not_a_method_option():
    student, teacher = _pair()
    with pytest.raises(TypeError, match=r"heal\(\) got an unknown keyword argument 'max_tokns' \(did you mean "
                                        r"'max_tokens'\?\): its keywords are method, tokenizer, .*max_tokens.*; the "
                                        r"methods' options are 'adjacent': none; 'last_k': k; 'lora': lora_r, lora_alpha"):
        hl.heal(student, teacher, _calibration(), max_tokns=64)
    with pytest.raises(ValueError, match="method='last_k' has no option 'lora_r'"):  # another method's option
        hl.heal(student, teacher, _calibration(), method="last_k", lora_r=4)


def test_token_ids_outside_the_vocabulary_are_refused_up_front(tmp_path):
    student, teacher = _pair()
    calib = _calibration()
    calib["input_ids"][0, 3] = student.config.vocab_size + 5
    with pytest.raises(ValueError, match=f"the healing calibration prompts hold token id {student.config.vocab_size + 5}"
                                         f", but the model's input embedding has {student.config.vocab_size} rows"):
        hl.heal(student, teacher, calib, method="last_k", k=2, max_tokens=64, seq_len=16, checkpoint_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists() and "healing" not in student.config.layerswap


def _overflowing_pair(dtype=torch.float16):
    teacher = tiny_model("llama", num_blocks=6, seed=0)
    with torch.no_grad():  # weights within float16's range, the first MLP's activations beyond it
        for linear in (teacher.model.layers[0].mlp.up_proj, teacher.model.layers[0].mlp.gate_proj):
            linear.weight.mul_(1e3 / linear.weight.abs().max())
    teacher = teacher.to(dtype)
    student = copy.deepcopy(teacher)
    hl.remove_layers(student, REMOVED)
    return student, teacher


def test_an_overflowing_float16_model_is_refused_by_the_non_finite_rule_before_anything_is_written(tmp_path):
    # the run printed "Out of range float values are not JSON compliant: nan", left the checkpoint
    # folder behind, and the API recorded final_loss 0.0 next to NaN KLs
    student, teacher = _overflowing_pair()
    start = {k: v.clone() for k, v in student.state_dict().items()}
    with pytest.raises(hl.NonFiniteScoresError, match=r"the held-out KL\(teacher \|\| student\) before healing is nan "
                                                      r"\(non-finite: the teacher and the student's logits hold NaN or inf; "
                                                      r"the models are torch\.float16\).*load the models in float32"):
        hl.heal(student, teacher, _calibration(), method="last_k", k=2, max_tokens=64, seq_len=16,
                checkpoint_dir=tmp_path / "ck")
    assert not (tmp_path / "ck").exists() and "healing" not in student.config.layerswap
    assert all(torch.equal(student.state_dict()[k], v) for k, v in start.items())


def test_a_loss_turning_non_finite_stops_healing_and_removes_the_folder_it_created(tmp_path):
    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                with torch.no_grad():
                    next(p for p in model.parameters() if p.requires_grad).fill_(float("nan"))

    student, teacher = _pair()
    start = {k: v.clone() for k, v in student.state_dict().items()}
    with pytest.raises(hl.NonFiniteScoresError, match=r"healing stopped at step 3: the training loss is nan"):
        hl.heal(student, teacher, _calibration(), method="last_k", k=2, max_tokens=6 * 16 * 4, seq_len=16,
                eval_every=5, callbacks=[Poison()], checkpoint_dir=tmp_path / "ck")
    assert not (tmp_path / "ck").exists() and "healing" not in student.config.layerswap
    assert all(torch.equal(student.state_dict()[k], v) for k, v in start.items())


def test_heal_report_from_json_validates_like_the_other_reports():
    student, teacher = _pair()
    report = hl.heal(student, teacher, _calibration(), method="last_k", k=2, max_tokens=64, seq_len=16)
    assert hl.HealReport.from_json(report.to_json()) == report
    nan = copy.deepcopy(report)
    nan.final_loss = float("nan")
    nan.loss_history = [{"step": 1, "loss": float("nan")}]
    back = hl.HealReport.from_json(nan.to_json())  # non-finite values come back as floats, not strings
    assert math.isnan(back.final_loss) and math.isnan(back.loss_history[0]["loss"])
    data = json.loads(report.to_json())
    for bad, message in [({"kl_before": "low"}, "kl_before: value 'low' is not a number"),
                         ({"kl_after": -0.5}, "kl_after=-0.5: a KL is never negative"),
                         ({"steps": -1}, "steps=-1: must be an int >= 0"),
                         ({"tokens": "9"}, "tokens='9': must be an int >= 0"),
                         ({"reverted": "no"}, "reverted='no': must be true or false"),
                         ({"eval_history": [{"step": 1}]}, "eval_history entry {'step': 1}: must be"),
                         ({"colour": 1}, "unknown field(s) ['colour']")]:
        with pytest.raises(ValueError, match=re.escape(f"JSON text is not a valid HealReport JSON file: {message}")):
            hl.HealReport.from_json(json.dumps({**data, **bad}))
    missing = {k: v for k, v in data.items() if k != "kl_after"}
    with pytest.raises(ValueError, match=re.escape("is not a valid HealReport JSON file: missing field(s) ['kl_after']")):
        hl.HealReport.from_json(json.dumps(missing))


@pytest.mark.parametrize("bad, message", [
    (dict(seq_len=0), "seq_len=0: must be an int >= 2"),
    (dict(seq_len=-4), "seq_len=-4: must be an int >= 2"),
    (dict(ce_weight=-1.0), "ce_weight=-1.0: must be a finite number >= 0"),
    (dict(ce_weight=float("nan")), "ce_weight=nan: must be a finite number >= 0"),
    (dict(seed="a"), "seed='a': must be an int"),
    (dict(seed=-1), "seed=-1: must be an int in 0..4294967295"),  # numpy refused it after the measurements
    (dict(seed=2**32), "seed=4294967296: must be an int in 0..4294967295"),
])
def test_heal_refuses_what_heal_config_refuses(bad, message):
    student, teacher = _pair()
    start = {k: v.clone() for k, v in student.state_dict().items()}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hl.heal(student, teacher, _calibration(), method="last_k", k=2, **bad)
    assert all(torch.equal(student.state_dict()[k], v) for k, v in start.items())
    assert "healing" not in student.config.layerswap


def _zero_weights(model) -> int:
    _, _, blocks = decoder_blocks(model)
    return sum(int((lin.weight == 0).sum()) for block in blocks for _, lin in prunable_linears(block))


@pytest.mark.parametrize("method, options", [("last_k", {"k": 2}), ("lora", {"lora_r": 4})])
def test_a_sparsified_student_keeps_its_zeros(method, options):
    # healing was refused on a sparsified student (last_k had filled half of the zeros); now the
    # zeros are set back after every optimiser step and after LoRA's merge, and the record says so
    student, teacher = _pair()
    hl.sparsify(student, _calibration(), sparsity=0.5, allocation="uniform", pruner="magnitude")
    record = dict(student.config.layerswap_sparsity)
    _, _, blocks = decoder_blocks(student)
    zeros_before = {n: lin.weight == 0 for n, lin in blocks[-1].named_modules() if isinstance(lin, torch.nn.Linear)}
    before = _zero_weights(student)
    report = hl.heal(student, teacher, _calibration(), method=method, max_tokens=8 * 16 * 4, seq_len=16,
                     learning_rate=1e-3, eval_every=2, patience=3, **options)
    assert report.steps > 0 and not report.reverted
    assert _zero_weights(student) == before == record["num_zeros"]
    for name, lin in blocks[-1].named_modules():  # the same weights are zero, none refilled
        if isinstance(lin, torch.nn.Linear):
            assert torch.equal(lin.weight == 0, zeros_before[name])
    assert report.kept_zeros["zeros"] == before and report.kept_zeros["linears"] == 7 * len(blocks)
    assert ("kl_after_unmasked" in report.kept_zeros) == (method == "lora")
    assert student.config.layerswap_sparsity == record  # the sparsity record stays true
    assert sparsity_mismatches(student) == []
    assert student.config.layerswap["healing"][-1]["kept_zeros"] == report.kept_zeros


@pytest.mark.parametrize("method, options, message", [
    ("lora", {"lora_rank": 8}, "heal() got an unknown keyword argument 'lora_rank' (did you mean 'lora_r'?)"),
    ("last_k", {"lora_r": 4}, "method='last_k' has no option 'lora_r': its options are k"),
    ("adjacent", {"k": 2}, "method='adjacent' has no option 'k': it takes none"),
    ("lora", {"lora_r": True}, "lora_r=True: must be an int >= 1 (the LoRA rank)"),
    ("lora", {"lora_r": 2.5}, "lora_r=2.5: must be an int >= 1 (the LoRA rank)"),
    ("lora", {"lora_alpha": float("nan")}, "lora_alpha=nan: must be a finite number > 0"),
    ("last_k", {"k": 0}, "k=0: must be an int in 1..4 (the model's block count)"),
])
def test_method_options_are_checked_before_anything_runs(tmp_path, method, options, message):
    # an option the method does not read was recorded as if it had been used; a bad value failed
    # in PEFT with a TypeError after the checkpoint folder was claimed
    student, teacher = _pair()
    start = {k: v.clone() for k, v in student.state_dict().items()}
    unknown = message.startswith("heal() got")  # no method's option: a misspelt keyword of heal itself
    with pytest.raises(TypeError if unknown else ValueError, match=re.escape(message)):
        hl.heal(student, teacher, _calibration(), method=method, checkpoint_dir=tmp_path / "ck", **options)
    assert not (tmp_path / "ck").exists()
    assert all(torch.equal(student.state_dict()[k], v) for k, v in start.items())
    with pytest.raises(ValueError, match=re.escape(f"HealConfig(options={options!r}): ")):
        HealConfig(method=method, options=options)  # before a model is loaded


# ---------------------------------------------------------------- top-k teacher cache
def test_top_k_loss_equals_full_kl_at_vocab_size_and_bounds_it_below():
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(2, 5, 32, generator=gen) * 3
    student = (torch.randn(2, 5, 32, generator=gen) * 3).requires_grad_(True)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    full = distillation_loss(student, teacher, mask)
    exact = top_k_distillation_loss(student, *teacher_top_k(teacher, 32), mask)
    assert exact.item() == pytest.approx(full.item(), rel=1e-6)
    assert torch.isinf(teacher_top_k(teacher, 32)[2]).all()
    exact.backward()
    assert torch.isfinite(student.grad).all()
    bounds = [top_k_distillation_loss(student, *teacher_top_k(teacher, k), mask).item() for k in (1, 4, 16, 31)]
    assert all(0 <= b <= full.item() + 1e-6 for b in bounds)
    with pytest.raises(ValueError, match="teacher_top_k=33"):
        teacher_top_k(teacher, 33)


def test_heal_with_full_size_cache_equals_on_the_fly():
    kw = dict(method="last_k", k=2, max_tokens=8 * 16 * 4, seq_len=16, batch_size=4, learning_rate=1e-3,
              eval_every=2, patience=3)
    a, teacher = _pair()
    first = hl.heal(a, teacher, _calibration(), **kw)
    b, teacher = _pair()
    cached = hl.heal(b, teacher, _calibration(), teacher_top_k=a.config.vocab_size, **kw)
    assert cached.kl_after == pytest.approx(first.kl_after, rel=1e-5) and cached.teacher_top_k == 128
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="teacher_top_k=0"):
        hl.heal(b, teacher, _calibration(), teacher_top_k=0)


# ---------------------------------------------------------------- resume
class _Interrupt(TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("method,lr,options", [("lora", 1e-2, {"lora_r": 4}), ("last_k", 1e-3, {"k": 2})])
def test_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path, capsys, method, lr, options):
    kw = dict(method=method, max_tokens=8 * 16 * 4, seq_len=16, batch_size=4, learning_rate=lr, eval_every=2,
              patience=3, **options)
    whole, teacher = _pair()
    expected = hl.heal(whole, teacher, _calibration(), **kw)
    cut, teacher = _pair()
    with pytest.raises(KeyboardInterrupt):
        hl.heal(cut, teacher, _calibration(), checkpoint_dir=tmp_path, callbacks=[_Interrupt(5)], **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4", RUN_FILE]
    (tmp_path / "checkpoint-6").mkdir()  # a save cut off half way: no early-stop state in it
    (tmp_path / "checkpoint-6" / "model.safetensors").write_bytes(b"partial")
    resumed, teacher = _pair()
    capsys.readouterr()
    report = hl.heal(resumed, teacher, _calibration(), checkpoint_dir=tmp_path, progress=True, **kw)
    assert "healing: 100%" in capsys.readouterr().err  # the bar, in tokens, resumed at step 4 of 8
    assert report.steps == expected.steps == 8
    assert report.kl_after == expected.kl_after and report.eval_history == expected.eval_history
    assert [e["step"] for e in report.loss_history] == list(range(1, 9))
    for (name, x), y in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(x, y), name
    # the folder of this run refuses a run with other settings
    other, teacher = _pair()
    with pytest.raises(ValueError, match="learning_rate"):
        hl.heal(other, teacher, _calibration(), checkpoint_dir=tmp_path, **{**kw, "learning_rate": lr / 2})


@pytest.mark.parametrize("method,lr,options", [("lora", 1e-2, {"lora_r": 4}), ("last_k", 1e-3, {"k": 2})])
def test_an_interrupted_call_leaves_the_student_as_given_and_the_same_object_resumes(tmp_path, method, lr, options):
    # the student was left half trained (LoRA: with PEFT modules in it), and the same call on the
    # same object then met checkpoints of "another student"
    kw = dict(method=method, max_tokens=8 * 16 * 4, seq_len=16, batch_size=4, learning_rate=lr, eval_every=2,
              patience=3, **options)
    whole, teacher = _pair()
    hl.heal(whole, teacher, _calibration(), **kw)
    student, teacher = _pair()
    start = {k: v.clone() for k, v in student.state_dict().items()}
    with pytest.raises(KeyboardInterrupt):
        hl.heal(student, teacher, _calibration(), checkpoint_dir=tmp_path, callbacks=[_Interrupt(5)], **kw)
    assert student.state_dict().keys() == start.keys()
    assert all(torch.equal(student.state_dict()[k], v) for k, v in start.items())
    assert all(p.requires_grad for p in student.parameters()) and not student.training
    hl.heal(student, teacher, _calibration(), checkpoint_dir=tmp_path, **kw)  # the same call, the same object
    for (name, x), y in zip(whole.state_dict().items(), student.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("steps, lr, eval_every, patience, ended", [
    (8, 1e4, 1, 2, 2),  # the early stop after two evaluations without improvement
    (5, 1e-3, 2, 30, 5),  # all 5 steps: the last checkpoint is mid-epoch (8 prompts, 2 batches an epoch)
])
def test_rerun_of_a_finished_run_trains_no_further(tmp_path, steps, lr, eval_every, patience, ended):
    # a run that ended and was cut off afterwards (its measurements, the save) ends, run again, with
    # its steps and weights, instead of training on from its last checkpoint
    kw = dict(method="last_k", k=2, max_tokens=steps * 16 * 4, seq_len=16, batch_size=4, learning_rate=lr,
              eval_every=eval_every, patience=patience)
    first, teacher = _pair()
    stopped = hl.heal(first, teacher, _calibration(), checkpoint_dir=tmp_path, **kw)
    again, teacher = _pair()
    report = hl.heal(again, teacher, _calibration(), checkpoint_dir=tmp_path, **kw)
    assert stopped.steps == report.steps == ended and report.eval_history == stopped.eval_history
    assert report.tokens == stopped.tokens and report.loss_history == stopped.loss_history
    for (name, x), y in zip(first.state_dict().items(), again.state_dict().values()):
        assert torch.equal(x, y), name


def test_checkpoints_of_another_student_or_teacher_are_refused(tmp_path):
    kw = dict(method="last_k", k=2, max_tokens=8 * 16 * 4, seq_len=16, batch_size=4, learning_rate=1e-3, eval_every=2,
              patience=3)
    cut, teacher = _pair()
    with pytest.raises(KeyboardInterrupt):
        hl.heal(cut, teacher, _calibration(), checkpoint_dir=tmp_path, callbacks=[_Interrupt(5)], **kw)
    teacher = tiny_model("llama", num_blocks=6, seed=0)
    other = copy.deepcopy(teacher)
    hl.remove_layers(other, [1, 4])  # another cut of the same base, the same settings
    start = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="other settings.*student: "):
        hl.heal(other, teacher, _calibration(), checkpoint_dir=tmp_path, **kw)
    student, _ = _pair()
    with pytest.raises(ValueError, match="the teacher is not the model the student was cut from"):
        hl.heal(student, tiny_model("llama", num_blocks=6, seed=1), _calibration(), checkpoint_dir=tmp_path, **kw)
    with pytest.raises(ValueError, match="other settings.*teacher: "):  # accepted as foreign: the folder is another's
        hl.heal(student, tiny_model("llama", num_blocks=6, seed=1), _calibration(), checkpoint_dir=tmp_path,
                allow_foreign_teacher=True, **kw)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in start.items())
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="checkpoint_dir '.*file' is a file: give a new or empty folder"):
        hl.heal(other, teacher, _calibration(), checkpoint_dir=tmp_path / "file", **kw)


def test_checkpoints_of_the_same_cut_without_its_ghosted_repair_are_refused(tmp_path):
    # the operators are buffers, outside the weights' fingerprint: a folder left by a run on
    # the unrepaired cut resumed the repaired one (held-out KL "healed" from 0.111 to 0.120)
    kw = dict(method="lora", lora_r=4, max_tokens=4 * 16 * 4, seq_len=16, batch_size=4, learning_rate=1e-2,
              eval_every=2, patience=3)
    teacher = tiny_model("llama", num_blocks=6, seed=0)
    plain = copy.deepcopy(teacher)
    hl.remove_layers(plain, REMOVED)
    hl.heal(plain, teacher, _calibration(), checkpoint_dir=tmp_path, **kw)
    repaired = copy.deepcopy(teacher)
    hl.recover(repaired, REMOVED, _calibration(), method="ghosted")
    with pytest.raises(ValueError, match="other settings.*student: "):
        hl.heal(repaired, teacher, _calibration(), checkpoint_dir=tmp_path, **kw)


def test_the_card_command_reproduces_the_recorded_settings():
    student, teacher = _pair()
    hl.heal(student, teacher, _calibration(), method="last_k", k=2, max_tokens=3 * 16 * 4, seq_len=16, batch_size=4,
            learning_rate=1e-3, eval_every=1, heldout_prompts=2, patience=5, ce_weight=0.5, seed=7, packing=False)
    entry = student.config.layerswap["healing"][-1]
    command = heal_command(entry)
    assert command.startswith("hf-layerswap heal PRUNED BASE OUTPUT --calibration TEXT ")
    parser = argparse.ArgumentParser()
    add_heal_args(parser)
    words = shlex.split(command)
    assert words[:5] == ["hf-layerswap", "heal", "PRUNED", "BASE", "OUTPUT"]
    assert heal_config(parser.parse_args(words[5:])) == HealConfig(
        method="last_k", max_tokens=192, calibration="TEXT", seq_len=16, packing=False, batch_size=4, learning_rate=1e-3,
        ce_weight=0.5, heldout_prompts=2, eval_every=1, patience=5, seed=7, options={"k": 2})
    assert f"```bash\n{command}\n```" in healing_section(student.config.layerswap)
    assert heal_command({k: v for k, v in entry.items() if k != "settings"}) is None  # an older record


# ---------------------------------------------------------------- config and pipeline
def test_heal_config_round_trip_and_refusals():
    cfg = LayerSwapConfig(num_to_remove=2, heal=HealConfig(method="last_k", max_tokens=512, options={"k": 2}))
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["heal"] == {"method": "last_k", "max_tokens": 512, "calibration": None, "seq_len": 128,
                            "packing": True, "batch_size": 4, "learning_rate": None, "ce_weight": 0.0, "heldout_prompts": 4,
                            "eval_every": 4, "patience": None, "seed": 0, "teacher_top_k": None, "options": {"k": 2},
                            "perplexity_text": None, "eval_tasks": None, "eval_tasks_path": None,
                            "eval_tasks_limit": None}
    assert LayerSwapConfig.from_dict(data) == cfg and LayerSwapConfig.from_dict(data).heal == cfg.heal
    assert LayerSwapConfig(num_to_remove=2, heal="adjacent").heal == HealConfig(method="adjacent")
    assert LayerSwapConfig(num_to_remove=2).to_dict()["heal"] is None
    with pytest.raises(ValueError, match=r"HealConfig\(method='nope'\): allowed \['adjacent', 'last_k', 'lora'\]"):
        HealConfig(method="nope")
    with pytest.raises(ValueError, match=r"HealConfig\(seed=-1\): must be an int in 0\.\.4294967295"):
        HealConfig(seed=-1)
    with pytest.raises(ValueError, match=r"max_tokenz.*did you mean 'max_tokens'"):
        LayerSwapConfig(num_to_remove=2, heal={"max_tokenz": 5})
    with pytest.raises(ValueError, match=r"HealConfig\(learning_rate=nan\)"):
        HealConfig(learning_rate=float("nan"))
    with pytest.raises(ValueError, match=r"teacher_top_k=0"):
        HealConfig(teacher_top_k=0)
    with pytest.raises(ValueError, match=r"HealConfig\(packing='no'\): must be True or False"):
        HealConfig(packing="no")
    with pytest.raises(ValueError, match="needs num_to_remove or layers"):
        LayerSwapConfig(heal="lora")
    with pytest.raises(ValueError, match="not both in one run"):
        LayerSwapConfig(num_to_remove=2, heal="lora", sparsity=0.5)


def _heal_config(**extra):
    return HealConfig(method="last_k", max_tokens=8 * 16 * 4, seq_len=16, learning_rate=1e-3, eval_every=2,
                      patience=3, options={"k": 2}, **extra)


def test_pipeline_heals_after_the_cut_like_heal_on_a_copy():
    model = tiny_model("llama", num_blocks=6, seed=0)
    result = prune(model, LayerSwapConfig(layers=REMOVED, calibration=_calibration(), heal=_heal_config(),
                                          progress=False))
    student, teacher = _pair()
    direct = hl.heal(student, teacher, _calibration(), **_heal_config().heal_kwargs())
    assert result.heal_report.kl_after == direct.kl_after and not result.heal_report.reverted
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), student.state_dict().values()))
    record = model.config.layerswap
    assert record["steps"][-1]["config"]["heal"]["method"] == "last_k"
    assert record["healing"][-1]["after_removal_step"] == 1 and weights_changed_later(model.config)
    assert model.layerswap_heal_report is result.heal_report
    with pytest.raises(ValueError, match="heals nothing"):
        prune(tiny_model("llama"), LayerSwapConfig(layers=REMOVED), heal_checkpoint_dir="x")


def test_from_pretrained_heals_at_load_time(tmp_path):
    tiny_model("llama", num_blocks=6, seed=0).save_pretrained(tmp_path)
    cfg = LayerSwapConfig(layers=REMOVED, calibration=_calibration(), heal=_heal_config(), progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=cfg, attn_implementation="eager")
    student, teacher = _pair()
    direct = hl.heal(student, teacher, _calibration(), **_heal_config().heal_kwargs())
    assert model.config.layerswap["healing"][-1]["kl_after"] == direct.kl_after
    assert model.config.num_hidden_layers == 4


def test_later_cut_marks_healing_stale():
    student, teacher = _pair()
    hl.heal(student, teacher, _calibration(), **_heal_config().heal_kwargs())
    kept = student.config.layerswap["healing"][-1]
    hl.remove_layers(student, [1])
    (entry,) = student.config.layerswap["healing"]
    assert entry == {**kept, "stale": "removal step 1 came after this healing: its numbers describe the model "
                                      "before that cut"}
    assert not weights_changed_later(student.config)  # the new removal's fingerprint applies again
    assert "**stale**: removal step 1" in healing_section(student.config.layerswap)  # steps 0 and 1


def test_sparsifying_a_healed_model_marks_its_healing_stale():
    # the documented order (heal, save, sparsify) left the healing KLs current on a model 50% zeros
    student, teacher = _pair()
    hl.heal(student, teacher, _calibration(), **_heal_config().heal_kwargs())
    kept = student.config.layerswap["healing"][-1]
    hl.sparsify(student, _calibration(), sparsity=0.5, allocation="uniform", pruner="magnitude")
    (entry,) = student.config.layerswap["healing"]
    assert entry == {**kept, "stale": "sparsification (magnitude, uniform allocation, achieved sparsity 50.0%) came "
                                      "after this healing: its numbers describe the model before its weights were zeroed"}
    assert "| Status | **stale**: sparsification (magnitude" in healing_section(student.config.layerswap)
    assert weights_changed_later(student.config)  # the sparsity still changed the weights after the cut


@pytest.mark.parametrize("method, words", [
    ("lora", "LoRA adapters on every kept block's attention and MLP projections, merged back into the weights"),
    ("adjacent", "the kept blocks on each side of every cut and every block's norms, trained in place"),
    ("last_k", "the last k blocks, the final norm and the output head, trained in place"),
])
def test_the_card_describes_each_method_from_its_registry_entry(method, words):
    # "LoRA merged back" was said of every method
    text = healing_section({"healing": [{"method": method, "tokens": 10, "steps": 1, "kl_before": 0.2, "kl_after": 0.1}]})
    assert f"| Method | `{method}`: {words} |" in text
    assert ("LoRA" in text) == (method == "lora")


def test_card_section_never_shows_healing_without_before_and_after():
    record = {"healing": [{"method": "lora", "tokens": 10, "steps": 1, "kl_before": 0.2, "kl_after": 0.15,
                           "perplexity": {"before": 30.0, "after": 24.0, "contract": "matched"}}],
              "recovery": {"method": "ghosted"}}
    text = healing_section(record, plot="layerswap_healing.png")
    assert "| Held-out KL(teacher ‖ student) before → after | 0.2000 → 0.1500 nats/token (-25.0%) |" in text
    assert "| Perplexity after the repair (ghosted) | 30.000 |" in text
    assert "| Perplexity after healing | 24.000; -20.0% vs the start of healing (after the repair) |" in text
    assert "![Healing: training loss and held-out KL against training tokens](layerswap_healing.png)" in text
    bare = healing_section({"healing": [{"method": "lora", "tokens": 10, "steps": 1}]})
    assert "not recorded: this healing cannot be judged" in bare
    assert healing_section({"removed_layers": [1]}) is None


# ---------------------------------------------------------------- command line
def _calibration_file(path, n=24):
    paragraphs = [" ".join(f"w{(7 * p + 3 * k) % 120}" for k in range(40)) for p in range(n)]
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def _digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


HEAL_FLAGS = ["--method", "last_k", "--option", "k=2", "--max-tokens", "512", "--seq-len", "16",
              "--learning-rate", "1e-3", "--eval-every", "2", "--patience", "3"]


def test_heal_verb_end_to_end(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "base")
    calib = _calibration_file(tmp_path / "calib.txt")
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "pruned"), "--layers", "2", "3"]) == 0
    before = _digest(tmp_path / "pruned")
    out = tmp_path / "healed"
    assert main(["heal", str(tmp_path / "pruned"), str(tmp_path / "base"), str(out), "--calibration", str(calib),
                 *HEAL_FLAGS]) == 0
    assert "held-out KL" in capsys.readouterr().out
    assert _digest(tmp_path / "pruned") == before
    assert not (tmp_path / "healed.heal-checkpoints").exists()
    assert not any("adapter" in p.name for p in out.iterdir())
    healed = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert not any("lora" in n for n, _ in healed.named_modules())
    entry = healed.config.layerswap["healing"][-1]
    assert entry["method"] == "last_k" and entry["options"] == {"k": 2} and entry["kl_after"] < entry["kl_before"]
    assert entry["steps"] == 8 and entry["learning_rate"] == 1e-3 and len(entry["data_hash"]) == 64
    card = (out / "README.md").read_text()
    assert "## Healing" in card and "(layerswap_healing.png)" in card
    assert (out / "layerswap_healing.png").stat().st_size > 0
    assert hl.HealReport.from_json(out / "layerswap_healing.json").kl_after == entry["kl_after"]
    assert check_card(card, out) == []


def test_heal_verb_refusals_leave_inputs_alone(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "base")
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "pruned"), "--layers", "2", "3"]) == 0
    before = _digest(tmp_path / "pruned")
    run = ["heal", str(tmp_path / "pruned"), str(tmp_path / "base")]
    assert main([*run, str(tmp_path / "pruned"), *HEAL_FLAGS]) == 2
    assert "healing never writes into its input" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert main([*run, str(tmp_path / "busy"), *HEAL_FLAGS]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    tiny_checkpoint(tmp_path / "other", tiny_model("qwen3", vocab_size=64))
    assert main(["heal", str(tmp_path / "pruned"), str(tmp_path / "other"), str(tmp_path / "o1"), *HEAL_FLAGS]) == 2
    assert "vocab_size=64" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o1.heal-checkpoints").exists()
    tiny_checkpoint(tmp_path / "deep", tiny_model("qwen3", num_blocks=8))
    assert main(["heal", str(tmp_path / "pruned"), str(tmp_path / "deep"), str(tmp_path / "o2"), *HEAL_FLAGS]) == 2
    assert "has 8 blocks but PRUNED was cut from a model of 6" in capsys.readouterr().err
    assert main([*run, str(tmp_path / "o3"), "--learning-rate", "0"]) == 2
    assert "HealConfig(learning_rate=0.0)" in capsys.readouterr().err
    for resume in (tmp_path / "pruned" / "ck", tmp_path / "o4", tmp_path / "o4" / "ck", tmp_path / "base"):
        assert main([*run, str(tmp_path / "o4"), *HEAL_FLAGS, "--resume", str(resume)]) == 2
        assert f"--resume {resume} is " in capsys.readouterr().err
    assert not (tmp_path / "o4").exists() and not (tmp_path / "pruned" / "ck").exists()
    assert _digest(tmp_path / "pruned") == before and (tmp_path / "busy" / "x").read_text() == "x"


def test_heal_verb_refuses_a_foreign_or_overflowing_base_and_borrows_the_base_tokenizer(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "base")
    calib = _calibration_file(tmp_path / "calib.txt")
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "pruned"), "--layers", "2", "3"]) == 0
    for path in (tmp_path / "pruned").iterdir():  # saved without its tokenizer: a raw TypeError traceback before
        if path.name.startswith("tokenizer"):
            path.unlink()
    flags = ["--calibration", str(calib), "--method", "last_k", "--option", "k=2", "--max-tokens", "64", "--seq-len", "16"]
    run = ["heal", str(tmp_path / "pruned")]
    tiny_checkpoint(tmp_path / "foreign", tiny_model("qwen3", seed=5))  # same shape, other weights
    assert main([*run, str(tmp_path / "foreign"), str(tmp_path / "o1"), *flags]) == 2
    err = capsys.readouterr().err
    assert "\nerror: the teacher is not the model the student was cut from" in err and "--allow-foreign-teacher" in err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o1.heal-checkpoints").exists()
    assert main([*run, str(tmp_path / "foreign"), str(tmp_path / "o2"), *flags, "--allow-foreign-teacher"]) == 0
    assert "using BASE's" in capsys.readouterr().err
    assert (tmp_path / "o2" / "tokenizer.json").is_file()
    entry = json.loads((tmp_path / "o2" / "config.json").read_text())["layerswap"]["healing"][-1]
    assert entry["teacher"]["matches"] is False and entry["teacher"]["name"] == "foreign"
    assert "**not the model it was cut from**: `foreign`" in (tmp_path / "o2" / "README.md").read_text()
    # a base that overflows in float16 (its pruned copy too): the non-finite rule's error, nothing left behind
    hot = tiny_model("qwen3")
    with torch.no_grad():  # weights within float16's range, the first MLP's activations beyond it; finite in float32
        for linear in (hot.model.layers[0].mlp.up_proj, hot.model.layers[0].mlp.gate_proj):
            linear.weight.mul_(1e3 / linear.weight.abs().max())
    tiny_checkpoint(tmp_path / "hot", hot)
    assert main(["prune", str(tmp_path / "hot"), str(tmp_path / "hot-pruned"), "--layers", "2", "3"]) == 0
    assert main(["heal", str(tmp_path / "hot-pruned"), str(tmp_path / "hot"), str(tmp_path / "o3"), *flags,
                 "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "error: the held-out KL(teacher || student) before healing is nan" in err and "JSON compliant" not in err
    assert not (tmp_path / "o3").exists() and not (tmp_path / "o3.heal-checkpoints").exists()


def test_prune_with_heal_flag(tmp_path):
    tiny_checkpoint(tmp_path / "base")
    calib = _calibration_file(tmp_path / "calib.txt")
    flags = ["--heal", "--heal-option", "lora_r=4", "--heal-max-tokens", "512", "--heal-seq-len", "16",
             "--heal-learning-rate", "1e-2", "--heal-eval-every", "2"]
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "p"), "--layers", "2", "3", "--calibration",
                 str(calib), *flags]) == 0
    record = json.loads((tmp_path / "p" / "config.json").read_text())["layerswap"]
    assert record["healing"][-1]["method"] == "lora" and record["healing"][-1]["options"] == {"lora_r": 4}
    assert record["steps"][-1]["config"]["heal"]["max_tokens"] == 512
    assert not any("adapter" in p.name for p in (tmp_path / "p").iterdir())
    assert not (tmp_path / "p.heal-checkpoints").exists()  # the healing checkpoints, removed after the save
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "p")
    assert not any("lora" in n for n, _ in reloaded.named_modules())
    assert "## Healing" in (tmp_path / "p" / "README.md").read_text()
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "q"), "--layers", "2", "--heal-max-tokens", "9"]) == 2


def test_an_interrupted_prune_heal_names_the_command_that_resumes_it(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "base")
    calib = _calibration_file(tmp_path / "calib.txt")
    command = ["prune", str(tmp_path / "base"), str(tmp_path / "p"), "--layers", "2", "3", "--calibration", str(calib),
               "--heal", "last_k", "--heal-option", "k=2", "--heal-max-tokens", "512", "--heal-seq-len", "16",
               "--heal-eval-every", "2"]
    interrupt = _Interrupt(4)
    original = DistillationTrainer.__init__

    def with_interrupt(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.add_callback(interrupt)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DistillationTrainer, "__init__", with_interrupt)
        assert main(command) == 130
    err = capsys.readouterr().err
    assert (f"healing checkpoints kept in {tmp_path / 'p.heal-checkpoints'}: run the same command again to resume the "
            f"healing from the last one: {shlex.join(['hf-layerswap', *command])}") in err
    assert (tmp_path / "p.heal-checkpoints" / RUN_FILE).is_file() and not (tmp_path / "p").exists()
    assert main(command) == 0  # the same command resumes and finishes
    assert not (tmp_path / "p.heal-checkpoints").exists()


# ---------------------------------------------------------------- packed healing text
def _eos_tokenizer(vocab_size):
    """A word-level tokenizer of ``w0``, ``w1``, ... with ``[UNK]`` and an EOS ``[EOS]`` (the last id)."""
    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab.update({"[UNK]": vocab_size - 2, "[EOS]": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")


def _heal_recording(tmp_path, paragraphs, steps, **kwargs):
    """Heal (last_k) on a text file of ``paragraphs``; returns the report, the rows the student
    trained on and the rows it was evaluated on (as tuples of ids), and the text's path."""
    student, teacher = _pair()
    path = _calibration_file(tmp_path / "calib.txt", n=paragraphs)
    seen = {True: [], False: []}

    def record(module, args, inputs):
        seen[module.training].extend(tuple(row) for row in inputs["input_ids"].tolist())

    student.register_forward_pre_hook(record, with_kwargs=True)
    report = hl.heal(student, teacher, str(path), tokenizer=_eos_tokenizer(student.config.vocab_size),
                     method="last_k", k=2, max_tokens=steps * 4 * 16, seq_len=16, batch_size=4, heldout_prompts=4,
                     learning_rate=1e-3, eval_every=steps, patience=1, **kwargs)
    return report, seen[True], seen[False], path, student


def _rows(calib, part=slice(None)):
    return [tuple(row) for row in calib.input_ids[part].tolist()]


def test_packed_healing_trains_each_distinct_window_once_and_never_the_heldout(tmp_path):
    report, trained, evaluated, path, student = _heal_recording(tmp_path, paragraphs=24, steps=10)
    windows = hl.build_calibration(str(path), _eos_tokenizer(student.config.vocab_size), num_prompts=44, seq_len=16,
                                   packing=True)
    assert windows.input_ids.shape == (44, 16) and bool(windows.attention_mask.all())  # 24 x 41 tokens hold 61
    assert set(evaluated) == set(_rows(windows, slice(0, 4)))  # the first 4 windows are held out
    assert sorted(trained) == sorted(_rows(windows, slice(4, None)))  # each of the next 40 exactly once
    assert not set(trained) & set(evaluated)
    assert (report.packing, report.tokens, report.distinct_tokens, report.epochs) == (True, 640, 640, 1.0)
    assert report.data_hash == windows.content_hash and "packed: the first" in report.data
    assert report.heldout == "first 4 window(s) of the packed text (never trained on)"
    entry = student.config.layerswap["healing"][-1]
    assert (entry["packing"], entry["distinct_tokens"], entry["tokens"], entry["epochs"]) == (True, 640, 640, 1.0)
    assert "| Training | 640 tokens (640 distinct, packed text, 1.00 epochs), 10 steps," in \
        healing_section(student.config.layerswap)


def test_packed_healing_beyond_the_text_repeats_it_in_epochs_and_says_so(tmp_path):
    # 6 paragraphs x (40 words + EOS) = 246 tokens = 15 windows of 16: 4 held out, 11 to train on
    with pytest.warns(hl.CalibrationShortfallWarning, match=r"11 distinct training windows \(176 tokens\) are "
                                                            r"repeated about 2\.91 times \(epochs\)"):
        report, trained, evaluated, path, student = _heal_recording(tmp_path, paragraphs=6, steps=8)
    # an epoch is 3 batches (4 + 4 + 3 windows): 8 steps = 2 epochs and 2 batches = 30 windows, counted exactly
    assert (report.tokens, report.distinct_tokens, report.steps) == (30 * 16, 176, 8)
    assert report.epochs == pytest.approx(480 / 176)
    assert len(set(trained)) == 11 and len(trained) == 30 and not set(trained) & set(evaluated)
    assert all(len(row) == 16 for row in trained)


def test_unpacked_healing_is_the_paragraph_prompts_as_before(tmp_path):
    report, trained, evaluated, path, student = _heal_recording(tmp_path, paragraphs=24, steps=3, packing=False)
    # the old rule: min(steps x batch, 256) paragraph prompts for training, then the held-out ones, last
    calib = hl.build_calibration(str(path), _eos_tokenizer(student.config.vocab_size), num_prompts=16, seq_len=16)
    assert report.data_hash == calib.content_hash and report.data == calib.description
    assert set(evaluated) == set(_rows(calib, slice(-4, None))) and sorted(trained) == sorted(_rows(calib, slice(0, 12)))
    assert report.packing is False and report.heldout == "last 4 prompt(s) of the calibration set"
    assert report.distinct_tokens == int(calib.attention_mask[:12].sum()) == report.tokens


def test_packing_flags_on_the_command_line():
    for prefix, flag in (("", "--no-packing"), ("heal-", "--no-heal-packing")):
        parser = argparse.ArgumentParser()
        add_heal_args(parser, prefix=prefix)
        method = None if not prefix else "lora"
        assert heal_config(parser.parse_args([]), prefix=prefix, method=method).packing is True
        assert heal_config(parser.parse_args([flag]), prefix=prefix, method=method).packing is False


# ---------------------------------------------------------------- a real model
@pytest.mark.slow
def test_smollm2_lora_healing_of_a_real_cut_lowers_heldout_kl_and_saves_plain(smollm2, wikitext_valid, tmp_path):
    dense, tokenizer = smollm2
    dense_snapshot = snapshot_model(dense)
    student = copy.deepcopy(dense)
    hl.remove_layers(student, [13, 14])  # the default search's set at n = 2 (model_cards/smollm2-135m)
    report = hl.heal(student, dense, str(wikitext_valid), tokenizer=tokenizer, method="lora", learning_rate=1e-3,
                     max_tokens=8 * 4 * 128, seq_len=128, batch_size=4, heldout_prompts=4, eval_every=2)
    assert_model_unchanged(dense, dense_snapshot)  # the teacher is never trained
    assert report.packing and report.steps >= 2 and report.tokens == report.steps * 4 * 128  # full windows, no padding
    assert report.kl_after < report.kl_before and not report.reverted
    assert [e["step"] for e in report.eval_history] == list(range(2, report.steps + 1, 2))
    assert not any("lora" in name for name, _ in student.named_modules())
    student.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = tokenizer("The tower is 324 metres tall.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, student(input_ids=ids).logits)
    record = reloaded.config.layerswap
    assert record["removed_layers"] == [13, 14] and reloaded.config.num_hidden_layers == 28
    assert record["healing"][-1]["kl_after"] == report.kl_after and record["healing"][-1]["method"] == "lora"


# ----------------------------------------------------------------------------- the teacher's device
def test_teacher_goes_where_the_students_token_ids_go_not_to_its_first_parameter():
    """place_teacher moves a teacher held on one device to the student's input device
    (hl.utils.devices.input_device: the execution device of its embeddings), not to the device of
    the student's first parameter: a student split over devices computes its embeddings on
    the device accelerate's hook names, and a first parameter offloaded to disk is on "meta".
    "meta" stands in for the embedding's GPU here: the hook says it, the weights stay on the CPU."""
    from accelerate.hooks import AlignDevicesHook

    from hf_layerswap.healing.teacher import place_teacher

    student, teacher = _pair()
    embed = student.get_input_embeddings()
    embed._hf_hook = AlignDevicesHook(execution_device="meta")  # the hook's word only: nothing moved
    assert next(student.parameters()).device == torch.device("cpu")  # the embedding's weight stays here
    assert place_teacher(teacher, student) == torch.device("meta")
    assert {p.device for p in teacher.parameters()} == {torch.device("meta")}

    # the embedding's weight on "meta" between calls (disk offload), its execution device the CPU
    student, teacher = _pair()
    embed = student.get_input_embeddings()
    embed.weight = torch.nn.Parameter(torch.empty_like(embed.weight, device="meta"))
    embed._hf_hook = AlignDevicesHook(execution_device="cpu")
    assert next(student.parameters()).device == torch.device("meta")
    assert place_teacher(teacher, student) == torch.device("cpu")
    assert {p.device for p in teacher.parameters()} == {torch.device("cpu")}
    assert bool(torch.isfinite(teacher.get_input_embeddings().weight).all())  # real weights, not "meta"


class _Process:
    """A stand-in for launched process ``rank`` of two (:class:`~hf_layerswap.scoring.processes.Processes`)."""

    def __init__(self, rank, waits):
        self.rank, self.world, self.waits = rank, 2, waits

    def barrier(self):
        self.waits.append(self.rank)


def test_only_the_first_launched_process_writes_the_run_file_and_every_process_waits_for_it(tmp_path, monkeypatch):
    # two processes claiming one folder at once: the second read the first's half-written file and refused (exit 2)
    import hf_layerswap.healing.distill as heal_core

    settings, waits = {"method": "last_k", "seed": 0}, []
    folder = tmp_path / "checkpoints"
    monkeypatch.setattr(heal_core, "Processes", lambda: _Process(1, waits))
    heal_core.write_claim(folder, settings)
    assert not folder.exists() and waits == [1, 1]
    monkeypatch.setattr(heal_core, "Processes", lambda: _Process(0, waits))
    heal_core.write_claim(folder, settings)
    assert json.loads((folder / RUN_FILE).read_text()) == settings and waits == [1, 1, 0, 0]
    # the settings of the run it names are those the other process checks (a resume: True)
    assert heal_core.claim_checkpoints(folder, settings, write=False) is True
