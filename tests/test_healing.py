"""Healing: distillation from the dense teacher through transformers' Trainer."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_layerswap as hl
from hf_layerswap.healing import distillation_loss
from hf_layerswap.healing.methods import cut_neighbours
from hf_layerswap.history import verify_history

from conftest import tiny_batch, tiny_model

REMOVED = [2, 3]


def _pair():
    teacher = tiny_model("llama", num_blocks=6, seed=0)
    student = copy.deepcopy(teacher)
    hl.remove_layers(student, REMOVED)
    return student, teacher


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
    assert after == pytest.approx(report.kl_after, rel=1e-5)
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


def test_mismatched_teacher_refused_before_training():
    student, teacher = _pair()
    start = {k: v.clone() for k, v in student.state_dict().items()}
    other = tiny_model("llama", num_blocks=6, vocab_size=64)
    with pytest.raises(ValueError, match="vocab_size=64"):
        hl.heal(student, other, _calibration())
    with pytest.raises(ValueError, match="teacher is the student itself"):
        hl.heal(student, student, _calibration())
    with pytest.raises(ValueError, match="method='nope'.*registered"):
        hl.heal(student, teacher, _calibration(), method="nope")
    with pytest.raises(ValueError, match="teacher tokenizer"):
        hl.heal(student, teacher, _calibration(), tokenizer=_Vocab({"a": 0, "b": 1}), teacher_tokenizer=_Vocab({"a": 0, "c": 1}))
    with pytest.raises(ValueError, match="k=9"):
        hl.heal(student, teacher, _calibration(), method="last_k", k=9)
    assert all(torch.equal(student.state_dict()[k], v) for k, v in start.items())
    assert "healing" not in student.config.layerswap
