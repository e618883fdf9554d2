"""``heal``: distil a pruned student from its dense teacher with transformers' ``Trainer``."""

from __future__ import annotations

import math
import tempfile

import torch
from torch import nn
from transformers import PrinterCallback, TrainingArguments

from ..calibration import build_calibration
from ..provenance import library_versions
from .methods import get_heal_method
from .report import HealReport
from .trainer import BestWeights, DistillationTrainer

__all__ = ["check_teacher", "heal"]


def check_teacher(model: nn.Module, teacher: nn.Module, tokenizer=None, teacher_tokenizer=None) -> None:
    """Refuse a teacher that cannot teach ``model``: the same object, a different
    ``config.vocab_size`` or output-head shape, or a tokenizer with a different vocabulary.

    Raises:
        ValueError: naming the mismatching values.
    """
    if teacher is model:
        raise ValueError("teacher is the student itself: pass the dense base model as teacher")
    sizes = [(m.config.vocab_size, tuple(m.get_output_embeddings().weight.shape)) for m in (model, teacher)]
    if sizes[0][0] != sizes[1][0] or sizes[0][1][0] != sizes[1][1][0]:
        raise ValueError(
            f"teacher vocabulary (vocab_size={sizes[1][0]}, lm_head {sizes[1][1]}) differs from the student's "
            f"(vocab_size={sizes[0][0]}, lm_head {sizes[0][1]}): the KL needs the same vocabulary"
        )
    if tokenizer is not None and teacher_tokenizer is not None and tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        raise ValueError(
            f"teacher tokenizer ({len(teacher_tokenizer)} tokens) differs from the student's ({len(tokenizer)} tokens)"
        )


class _Rows(torch.utils.data.Dataset):
    def __init__(self, ids, mask):
        self.ids, self.mask = ids, mask

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}


def heal(
    model: nn.Module,
    teacher: nn.Module,
    calibration=None,
    *,
    method: str = "lora",
    tokenizer=None,
    teacher_tokenizer=None,
    max_tokens: int = 4096,
    seq_len: int = 128,
    heldout_prompts: int = 4,
    batch_size: int = 4,
    learning_rate: float = 1e-4,
    ce_weight: float = 0.0,
    eval_every: int = 4,
    patience: int = 2,
    seed: int = 0,
    **options,
) -> HealReport:
    """Distil the pruned ``model`` from its dense ``teacher``: minimise KL(teacher ||
    student) of next-token distributions (temperature 1, fp32 log-softmax, real tokens
    only), plus ``ce_weight`` x cross-entropy on the text, with transformers' ``Trainer``.

    The text comes from :func:`~hf_layerswap.calibration.build_calibration` (calibration
    text, never the evaluation text); its last ``heldout_prompts`` prompts are held out:
    the KL on them is measured before training and at every ``eval_every`` steps, training
    stops after ``patience`` evaluations without improvement, and the weights of the best
    evaluation are kept. When no evaluation beats the start, the starting weights are
    returned and ``report.reverted`` is ``True``.

    Args:
        model: the pruned student, healed in place.
        teacher: the dense model, same vocabulary and tokenizer; it is not trained.
        calibration: any source :func:`build_calibration` accepts (``None``: the
            embedded calibration text; needs ``tokenizer``).
        method: a name registered in :data:`~hf_layerswap.healing.HEAL_METHODS`.
        max_tokens: training budget in prompt positions (``batch_size x seq_len`` per
            step); the number of steps is ``ceil(max_tokens / (batch_size * seq_len))``.
        seq_len: tokens per prompt. options: method options (``lora_r``, ``lora_alpha``, ``k``).

    Returns:
        The :class:`HealReport`. ``model`` is healed in place and stays a plain transformers
        model (LoRA is merged back with ``merge_and_unload``; no PEFT modules), in eval
        mode; ``model.config.layerswap["healing"]`` records the step.

    Raises:
        ValueError: a mismatched teacher (before any training), an unknown method, a bad
            budget, or too few prompts to hold some out.
    """
    check_teacher(model, teacher, tokenizer, teacher_tokenizer)
    entry = get_heal_method(method)
    for name, value in (("max_tokens", max_tokens), ("batch_size", batch_size), ("eval_every", eval_every),
                        ("patience", patience), ("heldout_prompts", heldout_prompts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an int >= 1")
    if not (isinstance(learning_rate, (int, float)) and learning_rate > 0 and math.isfinite(learning_rate)):
        raise ValueError(f"learning_rate={learning_rate!r}: must be a finite number > 0")
    steps = math.ceil(max_tokens / (batch_size * seq_len))
    wanted = min(steps * batch_size, 256) + heldout_prompts
    calib = build_calibration(calibration, tokenizer, num_prompts=wanted, seq_len=seq_len, seed=seed)
    if calib.input_ids.shape[0] <= heldout_prompts:
        raise ValueError(
            f"{calib.input_ids.shape[0]} calibration prompt(s) with heldout_prompts={heldout_prompts}: "
            "at least one prompt must remain for training"
        )
    ids, mask = calib.input_ids, calib.attention_mask
    train, held = _Rows(ids[:-heldout_prompts], mask[:-heldout_prompts]), _Rows(ids[-heldout_prompts:], mask[-heldout_prompts:])
    device = next(model.parameters()).device
    teacher.to(device).eval()
    student = entry.prepare(model, options)
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(
            output_dir=scratch, max_steps=steps, per_device_train_batch_size=batch_size,
            per_device_eval_batch_size=batch_size, learning_rate=learning_rate, seed=seed,
            eval_strategy="steps", eval_steps=eval_every, save_strategy="no", logging_steps=1,
            report_to=[], disable_tqdm=True, remove_unused_columns=False, use_cpu=device.type == "cpu",
        )
        trainer = DistillationTrainer(model=student, args=args, train_dataset=train, eval_dataset=held,
                                      teacher=teacher, ce_weight=ce_weight)
        trainer.remove_callback(PrinterCallback)
        kl_before = float(trainer.evaluate()["eval_loss"])
        best = BestWeights(student, kl_before, patience)
        trainer.add_callback(best)
        trainer.train()
        best.restore()
    healed = entry.finish(student)
    if healed is not model:
        raise RuntimeError(f"method={method!r} returned a new model object; healing works in place")
    for param in healed.parameters():
        param.requires_grad_(True)
    healed.eval()
    real = int(mask[:-heldout_prompts].sum()) / len(train)
    report = HealReport(
        method=method, tokens=round(real * batch_size * trainer.state.global_step), steps=trainer.state.global_step,
        learning_rate=float(learning_rate), seed=seed, data=calib.description,
        heldout=f"last {heldout_prompts} prompt(s) of the calibration set", kl_before=kl_before,
        kl_after=best.best_kl, reverted=not best.improved,
        loss_history=[{"step": e["step"], "loss": e["loss"]} for e in trainer.state.log_history if "loss" in e],
        eval_history=best.history,
    )
    record = getattr(healed.config, "layerswap", None) or {}
    step = {k: v for k, v in report.to_dict().items() if k not in ("loss_history", "eval_history")}
    step["library_versions"] = library_versions()
    healed.config.layerswap = {**record, "healing": record.get("healing", []) + [step]}
    return report
