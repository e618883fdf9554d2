"""transformers' ``Trainer`` with the distillation loss, a best-weights early stop that
survives a resume, and a progress bar in tokens."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import Trainer, TrainerCallback, TrainingArguments

from ..utils.jsonio import write_json_atomic
from ..scoring.rule import NonFiniteScoresError
from .loss import distillation_loss, next_token_cross_entropy, top_k_distillation_loss

__all__ = ["BEST_FILE", "BestWeights", "DistillationTrainer", "FiniteLoss", "HealProgress", "TEACHER_CACHE_KEYS",
           "last_complete_checkpoint", "training_arguments"]

#: Files :class:`BestWeights` adds to each Trainer checkpoint folder.
BEST_FILE = "layerswap_best.safetensors"
BEST_STATE = "layerswap_best.json"
#: Batch keys of a cached teacher (:func:`~hf_layerswap.healing.loss.teacher_top_k`).
TEACHER_CACHE_KEYS = ("teacher_top_log_probs", "teacher_top_indices", "teacher_rest_log_mass")


def training_arguments(settings: dict, output_dir: str, *, steps: int, device, world: int, learning_rate: float,
                       **overrides) -> TrainingArguments:
    """transformers' ``TrainingArguments`` of a healing run (or of the learning-rate probe):
    ``steps`` optimiser steps of ``settings["batch_size"]`` prompts (each of the ``world``
    launched processes takes its share of every step) at peak ``learning_rate``, AdamW with
    linear decay and no warmup unless ``overrides`` say otherwise, every step's loss logged,
    nothing printed or reported."""
    keywords = dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=settings["batch_size"] // world,
        per_device_eval_batch_size=settings["batch_size"], learning_rate=learning_rate, seed=settings["seed"],
        logging_steps=1, report_to=[], disable_tqdm=True, remove_unused_columns=False, use_cpu=device.type == "cpu",
        include_num_input_tokens_seen="non_padding",
        logging_nan_inf_filter=False,  # a NaN loss is recorded and refused (FiniteLoss), never logged as another value
    )
    return TrainingArguments(**{**keywords, **overrides})


class DistillationTrainer(Trainer):
    """A ``Trainer`` whose loss is :func:`~hf_layerswap.healing.loss.distillation_loss`
    against ``teacher``'s logits, computed on the fly (teacher in eval mode, no grad), or
    :func:`~hf_layerswap.healing.loss.top_k_distillation_loss` against a cached teacher
    when the batch carries :data:`TEACHER_CACHE_KEYS` (then ``ce_weight`` is added on the
    text as well). The evaluation loss is the full KL with ``ce_weight=0`` (the teacher
    on the fly: exact held-out numbers whatever the training reads)."""

    def __init__(self, *args, teacher, ce_weight: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval()
        self.ce_weight = ce_weight

    def _loss(self, model, inputs, ce_weight):
        if TEACHER_CACHE_KEYS[0] in inputs:
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            loss = top_k_distillation_loss(logits, *(inputs[k] for k in TEACHER_CACHE_KEYS), inputs["attention_mask"])
            if ce_weight:
                loss = loss + ce_weight * next_token_cross_entropy(logits, inputs["input_ids"], inputs["attention_mask"])
            return loss
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        return distillation_loss(logits, teacher_logits, inputs["attention_mask"], inputs["input_ids"], ce_weight=ce_weight)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = self._loss(model, inputs, self.ce_weight)
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            return self._loss(model, inputs, 0.0).detach(), None, None


#: The default early stop's share of the run: stop once the last tenth of the planned
#: held-out evaluations brought no lower KL.
PATIENCE_SHARE = 0.1


def resolve_patience(patience: int | None, steps: int, eval_every: int) -> int:
    """The early stop's patience in held-out evaluations: ``patience`` itself, or for
    ``None`` a tenth of the evaluations the run plans (``ceil(steps / eval_every)``),
    at least 2. A fixed count stops a long run on the first flat stretch of a still
    falling curve (``benchmarks/results/heal.md``: a 512-step run stopped at step 68 after
    three flat evaluations); a share of the run scales with the budget."""
    if patience is not None:
        return patience
    return max(2, math.ceil(PATIENCE_SHARE * math.ceil(steps / eval_every)))


class BestWeights(TrainerCallback):
    """Keeps the trainable weights of the best held-out KL seen (starting with ``start_kl``
    and the weights before training) and stops after ``patience`` evaluations without an
    improvement of more than ``min_delta`` nats.

    Its state (best weights, best KL, the evaluations so far) is written into each Trainer
    checkpoint folder (:data:`BEST_FILE` and a JSON file) and read back by
    :meth:`load`, so a resumed run stops and restores exactly as an uninterrupted one."""

    def __init__(self, model, start_kl: float, patience: int, min_delta: float = 0.0):
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.start_kl = self.best_kl = start_kl
        self.best = self.snapshot()
        self.improved = False
        self.patience, self.min_delta, self.waited = patience, min_delta, 0
        self.history: list[dict] = []

    @property
    def stopped(self) -> bool:
        """Whether the early stop has fired (a resumed run that had stopped trains no further)."""
        return self.waited >= self.patience

    def snapshot(self) -> dict:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def restore(self) -> None:
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(self.best[name])

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            save_file({n: t.contiguous() for n, t in self.best.items()}, str(folder / BEST_FILE))
            state_ = {"best_kl": self.best_kl, "improved": self.improved, "waited": self.waited,
                      "history": self.history}
            write_json_atomic(state_, folder / BEST_STATE)  # written last: marks the checkpoint complete

    def load(self, folder) -> None:
        """Read the state :meth:`on_save` wrote into the checkpoint ``folder``.

        Raises:
            FileNotFoundError: the folder has no saved state (not a healing checkpoint).
        """
        folder = Path(folder)
        if not (folder / BEST_STATE).is_file():
            raise FileNotFoundError(f"{folder} holds no {BEST_STATE}: not a checkpoint of hf_layerswap's heal")
        state = json.loads((folder / BEST_STATE).read_text(encoding="utf-8"))
        best = load_file(str(folder / BEST_FILE))
        self.best = {n: best[n].to(p.device) for n, p in self.params.items()}
        self.best_kl, self.improved, self.waited = state["best_kl"], state["improved"], state["waited"]
        self.history = state["history"]

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        kl = float(metrics["eval_loss"])
        self.history.append({"step": state.global_step, "kl": kl})
        if kl < self.best_kl - self.min_delta:
            self.best_kl, self.best, self.improved, self.waited = kl, self.snapshot(), True, 0
        else:
            self.waited += 1
            if self.stopped:
                control.should_training_stop = True


class FiniteLoss(TrainerCallback):
    """Stops a run whose training loss or held-out KL turns non-finite (NaN, inf: a model
    that overflows in its dtype, a divergent learning rate): raises
    :class:`~hf_layerswap.NonFiniteScoresError` naming the step and the value, so no
    checkpoint is written with it and no number is recorded as if it were a result."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key, name in (("loss", "training loss"), ("eval_loss", "held-out KL")):
            value = (logs or {}).get(key)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                raise NonFiniteScoresError(
                    f"healing stopped at step {state.global_step}: the {name} is {value} (non-finite): load the models "
                    "in float32 (--dtype float32) or bfloat16, or lower the learning rate",
                    nonfinite={f"{name} at step {state.global_step}": value})


class HealProgress(TrainerCallback):
    """A tqdm bar over the training tokens (``tokens_per_step`` per optimiser step), with
    tqdm's rate and ETA and the last loss and held-out KL as its postfix."""

    def __init__(self, total_steps: int, tokens_per_step: float):
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.bar = None
        self.shown: dict[str, str] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(total=round(self.total_steps * self.tokens_per_step), unit="tok", unit_scale=True,
                        desc="healing", initial=round(state.global_step * self.tokens_per_step))

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(round(state.global_step * self.tokens_per_step) - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs:
            for key, name in (("loss", "loss"), ("eval_loss", "heldout_kl")):
                if logs.get(key) is not None:
                    self.shown[name] = f"{logs[key]:.4f}"
            self.bar.set_postfix(self.shown, refresh=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def last_complete_checkpoint(folder) -> str | None:
    """The newest ``checkpoint-N`` folder in ``folder`` that :class:`BestWeights` finished
    (transformers writes a checkpoint file by file, so a run killed while saving leaves an
    incomplete one); newer incomplete ones are removed. ``None`` when there is none."""
    found = []
    for path in Path(folder).iterdir():
        match = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    found.sort()
    complete = [path for _, path in found if (path / BEST_STATE).is_file()]
    last = complete[-1] if complete else None
    for step, path in found:
        if last is None or step > int(last.name.split("-")[1]):
            shutil.rmtree(path, ignore_errors=True)
    return None if last is None else str(last)
