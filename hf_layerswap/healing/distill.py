"""``heal``: distil a pruned student from its dense teacher with transformers' ``Trainer``."""

from __future__ import annotations

import copy
import hashlib
import difflib
import inspect
import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import PrinterCallback, TrainerState, set_seed
from transformers.trainer import TRAINER_STATE_NAME

from ..calibration import (CalibrationSet, CalibrationShortfallWarning, build_calibration, check_token_ids,
                           shortfall_text)
from ..utils.jsonio import write_json_atomic
from ..layerplan import model_fingerprint, num_blocks
from ..utils.provenance import library_versions
from ..surgery.operators import attached_operators
from ..scoring.rule import NonFiniteScoresError
from ..scoring.processes import Processes
from .choice import probe_learning_rate, probe_steps, time_budget, time_forwards
from .loss import teacher_top_k
from .measure import HealMeasures
from .methods import HEAL_METHODS, get_heal_method
from .report import RUN_SETTINGS, HealReport
from .mask import KeepZeros, ZeroMask, keep_zeros
from .teacher import check_finite_start, check_teacher, place_teacher, teacher_origin
from .trainer import (TEACHER_CACHE_KEYS, BestWeights, DistillationTrainer, FiniteLoss, HealProgress,
                      last_complete_checkpoint, resolve_patience, training_arguments)

__all__ = ["MAX_SEED", "PARAGRAPH_PROMPTS", "RUN_FILE", "claim_checkpoints", "heal", "processes_launched", "write_claim"]

#: The largest training seed (numpy's, under transformers' ``set_seed``).
MAX_SEED = 2**32 - 1
#: Training prompts of ``packing=False`` at most (budgets beyond them repeat them, epochs).
PARAGRAPH_PROMPTS = 256


class _Rows(torch.utils.data.Dataset):
    """Prompts as Trainer rows, with the cached teacher's entries when ``cache`` is set."""

    def __init__(self, ids, mask):
        self.ids, self.mask = ids, mask
        self.cache: dict | None = None

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        row = {"input_ids": self.ids[i], "attention_mask": self.mask[i]}
        if self.cache is not None:
            row.update({key: values[i] for key, values in self.cache.items()})
        return row


def heal(
    model: nn.Module,
    teacher: nn.Module,
    calibration=None,
    *,
    method: str = "lora",
    tokenizer=None,
    teacher_tokenizer=None,
    max_tokens: int | None = None,
    seq_len: int = 128,
    packing: bool = True,
    heldout_prompts: int = 4,
    batch_size: int = 4,
    learning_rate: float | None = None,
    ce_weight: float = 0.0,
    eval_every: int = 4,
    patience: int | None = None,
    seed: int = 0,
    checkpoint_dir: str | os.PathLike | None = None,
    teacher_top_k: int | None = None,
    progress: bool = False,
    perplexity_text=None,
    eval_tasks: Sequence[str] | None = None,
    eval_tasks_path=None,
    eval_tasks_limit: int | float | None = None,
    callbacks: Sequence = (),
    allow_foreign_teacher: bool = False,
    **options,
) -> HealReport:
    """Distil the pruned ``model`` from its dense ``teacher`` with transformers' ``Trainer``: minimise KL(teacher ||
    student) of next-token distributions (temperature 1, fp32 log-softmax, real tokens) + ``ce_weight`` x text CE.

    The text (:func:`~hf_layerswap.calibration.build_calibration`, never the evaluation text) is packed by default:
    paragraphs joined by EOS in full ``seq_len`` windows, the first ``heldout_prompts`` held out, the next ``steps x
    batch_size`` trained on, distinct until the text runs out, then repeated (epochs, with a warning;
    ``report.epochs``). ``packing=False``/tensors: one paragraph per prompt, at most :data:`PARAGRAPH_PROMPTS`, the
    last held out. Held-out KL every ``eval_every`` steps; stop after ``patience`` without improvement (``None``:
    :func:`~hf_layerswap.healing.trainer.resolve_patience`), keeping the best weights (the start's:
    ``report.reverted``).

    Args:
        model: the pruned student, healed in place. teacher: the dense model, same vocabulary and tokenizer (not trained).
        calibration: any :func:`build_calibration` source (``None``: the embedded text, needs ``tokenizer``).
        method: a name registered in :data:`~hf_layerswap.healing.HEAL_METHODS`.
        max_tokens: training budget in prompt positions: ``ceil(max_tokens / (batch_size * seq_len))``
            steps (given tensors: their width for ``seq_len``); ``None``: the whole steps that fit 10
            minutes on the student's device, at most one pass over the text. learning_rate: peak rate
            (AdamW, linear decay, no warmup); ``None``: a short probe of the method's candidates on the
            held-out KL. Both :mod:`~hf_layerswap.healing.choice`, recorded in ``report.choice``.
        seq_len: tokens per prompt. packing: pack a text source (above; ignored for
            tensors). options: method options (``lora_r``, ``lora_alpha``, ``k``).
        checkpoint_dir: a folder for transformers' Trainer checkpoints (one after every evaluation, the last
            two kept, each with the early stop's best weights): the same call after an interruption resumes from
            the last complete one (one cut off while saving is removed) with what the first call chose, and ends
            with the same weights as an uninterrupted run (same seed; a run that had ended trains no further).
            A folder of another student, teacher or settings is refused. ``None``: nothing is saved.
        teacher_top_k: ``None``: the teacher's full logits on the fly. An int ``k``: its top-``k`` log-probabilities
            plus the rest's mass, cached once (:func:`~hf_layerswap.healing.loss.teacher_top_k`); the KL over those
            ``k + 1`` buckets is a lower bound of the full KL, equal at ``k = V``. The held-out KL is always the full KL.
        perplexity_text: a text source :func:`~hf_layerswap.evaluation.evaluate_perplexity` accepts (``"embedded"``:
            the embedded evaluation split); when given, the perplexity (``"matched"`` contract, one text) of every stage
            is recorded in ``report.perplexity``: the dense teacher, after the cut, after the repair or an earlier
            healing run when the student had one, after healing (:mod:`~hf_layerswap.healing.measure`). Needs ``tokenizer``.
        eval_tasks: lm-eval task names measured on the student before and after healing
            (:func:`~hf_layerswap.evaluate_tasks`, zero-shot, same settings both times), in ``report.tasks``;
            ``eval_tasks_path`` (task YAML folder) and ``eval_tasks_limit`` (documents per task) as its
            ``include_path`` and ``limit``. Needs ``tokenizer`` and lm-eval.
        callbacks: more transformers ``TrainerCallback`` objects for the Trainer (logging, a custom stop). progress: a
            tqdm bar over the training tokens with its ETA.
        allow_foreign_teacher: accept a teacher that is not the model the student was cut from
            (:func:`~hf_layerswap.healing.teacher.teacher_origin`), named as such in ``report.teacher``.

    Returns:
        The :class:`HealReport`, also left on ``model.layerswap_heal_report``. ``model`` is healed in place and stays
        a plain transformers model (LoRA is merged back with ``merge_and_unload``; no PEFT modules), in eval mode;
        ``model.config.layerswap["healing"]`` records the step (a sparsified student keeps its zeros: ``kept_zeros``).

    Raises:
        ValueError: before any training: an offloaded student or teacher, a mismatched or foreign teacher, an unknown
            method, a bad budget, ``seq_len``, ``ce_weight``, ``seed``, ``teacher_top_k`` or task field, token ids
            outside the embedding, too few prompts to hold some out, another run's ``checkpoint_dir``,
            measurements without ``tokenizer``. TypeError: an unknown keyword (``max_tokns=``).
        NonFiniteScoresError: a non-finite held-out KL before training or loss (then a ``checkpoint_dir`` it created is removed).
    """
    _check_keywords(options, method)
    settings = dict(method=method, max_tokens=max_tokens, seq_len=seq_len, packing=packing, heldout_prompts=heldout_prompts,
                    batch_size=batch_size, learning_rate=learning_rate, ce_weight=ce_weight, eval_every=eval_every,
                    patience=patience, seed=seed, teacher_top_k=teacher_top_k, options=dict(options))
    check_teacher(model, teacher, tokenizer, teacher_tokenizer)
    origin = teacher_origin(model, teacher, allow_foreign=allow_foreign_teacher)
    measures = HealMeasures(perplexity_text, eval_tasks, eval_tasks_path, eval_tasks_limit, tokenizer, progress)
    measures.check()
    entry, zeros = get_heal_method(method), ZeroMask.of(model)  # a sparsified student keeps its zeros
    _check_settings(settings, model, entry)
    device = place_teacher(teacher, model)
    choice, (calib, steps, train, held, packed) = _budgeted_text(model, teacher, calibration, tokenizer, settings,
                                                                 checkpoint_dir, device)
    settings.update(patience=resolve_patience(patience, steps, eval_every), data_hash=calib.content_hash,
                    student=student_fingerprint(model), teacher=model_fingerprint(teacher))  # what checkpoints belong to
    resume = claim_checkpoints(checkpoint_dir, settings, write=False)  # read by all before the first process writes
    check_finite_start(model, teacher, held, batch_size)
    start = measures.start(model, teacher)
    created = checkpoint_dir is not None and not Path(checkpoint_dir).exists()
    train.cache = _teacher_cache(teacher, train, teacher_top_k, batch_size, device)
    set_seed(seed)  # LoRA's initialisation draws from the global generator
    student = entry.prepare(model, options)
    settings["choice"] = _given(_probe(student, teacher, train, held, settings, entry, steps, device, choice),
                                max_tokens, learning_rate)
    write_claim(checkpoint_dir, settings)  # written only now, after the measurements
    tokens_per_step = int(train.mask.sum()) / len(train) * batch_size
    state, best = _train(student, teacher, train, held, settings, steps=steps, device=device,
                         checkpoint_dir=checkpoint_dir, resume=bool(resume), undo=entry.undo, created=created,
                         extra=([HealProgress(steps, tokens_per_step)] if progress else []) + list(callbacks)
                         + ([KeepZeros(zeros)] if zeros is not None else []))
    healed = _finished(entry, student, model, method)
    report = _heal_report(settings, state, best, calib, tokens_per_step, int(train.mask.sum()), packed, origin)
    keep_zeros(zeros, entry.adds_parameters, healed, teacher, held, batch_size, report)
    _record_step(healed, report)  # before measuring: a measurement that fails leaves the healed model recorded
    _measure_after(measures, healed, start, report)
    return report


def processes_launched() -> int:
    """The processes ``accelerate launch`` / ``torchrun`` started for this run (``WORLD_SIZE``;
    1 without a launcher): the Trainer runs data-parallel over them."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _check_keywords(options: Mapping, method: str) -> None:
    """Refuse a keyword of :func:`heal` that is neither its own nor an option of any
    registered method (a misspelt ``max_tokns=`` is no method option), naming the allowed
    ones and the closest. A method that takes any option (``options=None``) takes them all.

    Raises:
        TypeError: naming the keyword, the closest allowed name and the allowed ones.
    """
    entry = HEAL_METHODS.get(method)
    if entry is not None and entry.option_names is None:
        return
    known = {name for cls in HEAL_METHODS.values() for name in (cls.option_names or ())}
    unknown = [key for key in options if key not in known]
    if not unknown:
        return
    own = [name for name, p in inspect.signature(heal).parameters.items()
           if p.kind is inspect.Parameter.KEYWORD_ONLY]
    close = difflib.get_close_matches(unknown[0], own + sorted(known), n=1)
    methods = "; ".join(f"{name!r}: {', '.join(cls.option_names) or 'none'}" for name, cls in sorted(HEAL_METHODS.items())
                        if cls.option_names is not None)
    raise TypeError(f"heal() got an unknown keyword argument {', '.join(map(repr, unknown))}"
                    + (f" (did you mean {close[0]!r}?)" if close else "")
                    + f": its keywords are {', '.join(own)}; the methods' options are {methods}")


def student_fingerprint(model: nn.Module) -> str:
    """:func:`~hf_layerswap.layerplan.model_fingerprint` of the student, with its attached ghosted
    operators (buffers, which the weights' fingerprint leaves out) when it has any: the
    checkpoints of a run on the plain cut never resume the repaired one (sha256 hex)."""
    operators = attached_operators(model)
    if not operators:
        return model_fingerprint(model)
    h = hashlib.sha256(model_fingerprint(model).encode())
    for boundary, op in operators:
        h.update(f"{boundary}:{tuple(op.weight.shape)}".encode())
        h.update(op.weight.detach().reshape(-1)[:16].to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()


def _width(calibration, seq_len: int) -> int:
    """Tokens per healing prompt: given tensors keep their width, a text source ``seq_len``."""
    tensors = isinstance(calibration, (CalibrationSet, Mapping))
    ids = calibration.input_ids if isinstance(calibration, CalibrationSet) else tensors and calibration.get("input_ids")
    return ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else seq_len


def _training_text(calibration, tokenizer, settings: dict, model=None, one_pass: bool = False):
    """``(calibration set, training steps, training rows, held-out rows, packed)`` for :func:`heal`:
    ``steps = ceil(max_tokens / (batch_size * seq_len))`` (given tensors: their width for
    ``seq_len``). Packed (a text source with
    ``settings["packing"]``): the first ``heldout_prompts`` windows held out, then
    ``steps x batch_size`` distinct windows, or every window the source has (the Trainer
    then repeats them, epochs; a warning says so). Otherwise: ``min(steps x batch_size,``
    :data:`PARAGRAPH_PROMPTS` ``)`` prompts for training, then the held-out ones, last.
    ``one_pass`` (a budget :func:`heal` chose): fewer steps when the text holds fewer distinct
    training prompts than the budget, ``max(1, distinct // batch_size)``, the text built
    again for them, as a run given that budget builds it.

    Raises:
        ValueError: no prompt remains for training once ``heldout_prompts`` are held out; a
            token id outside ``model``'s embedding.
    """
    batch_size, heldout, seq_len = settings["batch_size"], settings["heldout_prompts"], settings["seq_len"]
    tensors = isinstance(calibration, (CalibrationSet, Mapping))
    width = _width(calibration, seq_len)
    steps = math.ceil(settings["max_tokens"] / (batch_size * width))
    packing = settings["packing"] and not tensors

    def build(steps):
        wanted = (steps * batch_size if packing else min(steps * batch_size, PARAGRAPH_PROMPTS)) + heldout
        with warnings.catch_warnings():
            if packing or one_pass:  # said below in healing's own words; a chosen budget stops at the text's end
                warnings.simplefilter("ignore", CalibrationShortfallWarning)
            return build_calibration(calibration, tokenizer, num_prompts=wanted, seq_len=seq_len, seed=settings["seed"],
                                     packing=packing)

    calib = build(steps)
    distinct = calib.num_prompts - heldout if packing else min(calib.num_prompts - heldout, PARAGRAPH_PROMPTS)
    if one_pass and distinct >= 1 and steps * batch_size > distinct:  # at most one pass: as the explicit budget builds it
        steps = max(1, distinct // batch_size)
        calib = build(steps)
    if model is not None:
        check_token_ids(calib.input_ids, model, "the healing calibration prompts")
    count = calib.num_prompts
    if count <= heldout:
        raise ValueError(
            f"{count} calibration prompt(s) with heldout_prompts={heldout}: at least one prompt must remain for training"
        )
    ids, mask = calib.input_ids, calib.attention_mask
    if not packing:
        return calib, steps, _Rows(ids[:-heldout], mask[:-heldout]), _Rows(ids[-heldout:], mask[-heldout:]), False
    if calib.shortfall:
        epochs = steps * batch_size / (count - heldout)
        warnings.warn(CalibrationShortfallWarning(
            f"healing text shorter than the budget: {shortfall_text(calib.shortfall)}; after the {heldout} held-out "
            f"window(s) {count - heldout} distinct training windows ({(count - heldout) * seq_len:,} tokens) are repeated "
            f"about {epochs:.2f} times (epochs) for the {steps} steps of max_tokens={settings['max_tokens']:,}: give a "
            "larger text for distinct tokens, or lower max_tokens"), stacklevel=3)
    return calib, steps, _Rows(ids[heldout:], mask[heldout:]), _Rows(ids[:heldout], mask[:heldout]), True


def _finished(entry, student, model: nn.Module, method: str) -> nn.Module:
    """The method's ``finish`` of the trained ``student``: the same object as ``model``, all
    parameters trainable again, in eval mode.

    Raises:
        RuntimeError: the method returned a new model object.
    """
    healed = entry.finish(student)
    if healed is not model:
        raise RuntimeError(f"method={method!r} returned a new model object; healing works in place")
    for param in healed.parameters():
        param.requires_grad_(True)
    healed.eval()
    return healed


def _heal_report(settings: dict, state, best, calib, tokens_per_step: float, distinct: int,
                 packed: bool, teacher: dict | None = None) -> HealReport:
    """The :class:`HealReport` of a finished run (perplexity not yet filled in); ``distinct``:
    the real tokens of the training prompts, ``packed``: whether they are packed windows;
    ``tokens_per_step``: the planned mean, replaced by the steps' own once there are steps."""
    losses = [{"step": e["step"], "loss": e["loss"]} for e in state.log_history if "loss" in e]
    held = settings["heldout_prompts"]
    trained = int(state.num_input_tokens_seen)  # counted per batch by the Trainer (a last short batch of an epoch too)
    tokens_per_step = trained / state.global_step if state.global_step else tokens_per_step  # the planned one: no step
    return HealReport(
        method=settings["method"], tokens=trained, steps=state.global_step,
        learning_rate=float(settings["learning_rate"]), seed=settings["seed"], data=calib.description,
        heldout=(f"first {held} window(s) of the packed text (never trained on)" if packed else
                 f"last {held} prompt(s) of the calibration set"), kl_before=best.start_kl,
        kl_after=best.best_kl, reverted=not best.improved, loss_history=losses, eval_history=best.history,
        data_hash=calib.content_hash, teacher_top_k=settings["teacher_top_k"], ce_weight=float(settings["ce_weight"]),
        final_loss=losses[-1]["loss"] if losses else None, tokens_per_step=tokens_per_step,
        options=dict(settings["options"]), packing=packed, distinct_tokens=distinct, epochs=trained / distinct,
        patience=settings["patience"], settings={k: settings[k] for k in RUN_SETTINGS}, teacher=dict(teacher or {}),
        choice=copy.deepcopy(settings.get("choice") or {}),
    )


def _train(student, teacher, train, held, settings: dict, *, undo, created: bool = False, **kwargs):
    """:func:`_run_trainer`; when it raises (an interruption, an error), the model is left as
    it was given: its trained weights put back (a copy on the CPU), the method's ``undo``
    (LoRA's modules removed), every parameter trainable, in eval mode (as :func:`heal` leaves
    it), so the same call with the same object resumes from ``checkpoint_dir``; a run stopped
    by a non-finite loss leaves nothing to resume: the ``checkpoint_dir`` it ``created`` is removed."""
    start = {n: p.detach().to("cpu", copy=True) for n, p in student.named_parameters() if p.requires_grad}
    try:
        return _run_trainer(student, teacher, train, held, settings, **kwargs)
    except BaseException as err:
        if created and isinstance(err, NonFiniteScoresError):
            shutil.rmtree(kwargs["checkpoint_dir"], ignore_errors=True)
        params = dict(student.named_parameters())
        with torch.no_grad():
            for name, value in start.items():
                params[name].copy_(value)
        _given_back(undo(student))
        raise


def _given_back(model: nn.Module) -> None:
    """``model`` as :func:`heal` leaves it: every parameter trainable, in eval mode."""
    for param in model.parameters():
        param.requires_grad_(True)
    model.eval()


def _run_trainer(student, teacher, train, held, settings: dict, *, steps: int, device, checkpoint_dir, resume: bool,
                 extra: list):
    """Run transformers' Trainer on ``student`` (resuming from the last checkpoint in
    ``checkpoint_dir`` when ``resume``); returns its final state and the early stop, whose
    best weights are restored into ``student``."""
    with tempfile.TemporaryDirectory() as scratch:
        args = training_arguments(
            settings, os.fspath(checkpoint_dir) if checkpoint_dir is not None else scratch, steps=steps, device=device,
            world=processes_launched(), learning_rate=settings["learning_rate"], eval_strategy="steps", eval_steps=settings["eval_every"],
            save_strategy="no" if checkpoint_dir is None else "steps", save_steps=settings["eval_every"],
            save_total_limit=2)
        trainer = DistillationTrainer(model=student, args=args, train_dataset=train, eval_dataset=held,
                                      teacher=teacher, ce_weight=settings["ce_weight"])
        trainer.remove_callback(PrinterCallback)
        best = BestWeights(student, float(trainer.evaluate()["eval_loss"]), settings["patience"])
        for callback in [FiniteLoss(), best, *extra]:
            trainer.add_callback(callback)
        last = last_complete_checkpoint(checkpoint_dir) if resume else None
        saved = None if last is None else TrainerState.load_from_json(os.path.join(last, TRAINER_STATE_NAME))
        if last is not None:
            best.load(last)
        if saved is not None and (best.stopped or saved.global_step >= steps):  # the run had ended: train no further
            trainer.state = saved  # (the Trainer would take one more step from a last checkpoint inside an epoch)
        else:
            trainer.train(resume_from_checkpoint=last)
        best.restore()
    return trainer.state, best


def _check_settings(settings: dict, model, entry) -> None:
    """Refuse a bad setting of :func:`heal` or an option ``entry`` (the method) refuses."""
    entry.check_options(settings["options"], num_blocks(model))
    world = processes_launched()
    batch = settings["batch_size"]
    if isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1 and batch % world:
        raise ValueError(f"batch_size={batch} under {world} launched processes: each process takes batch_size / {world} "
                         f"prompts of every step (the budget and the steps stay those asked for); give a multiple of {world}")
    vocab_size = model.config.vocab_size
    for name, minimum in (("max_tokens", 1), ("seq_len", 2), ("batch_size", 1), ("eval_every", 1), ("patience", 1),
                          ("heldout_prompts", 1)):
        value = settings[name]
        if name in ("patience", "max_tokens") and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r}: must be an int >= {minimum}"
                             + (" or None (chosen for the model and the device)" if name == "max_tokens" else ""))
    for name, positive in (("learning_rate", True), ("ce_weight", False)):
        value = settings[name]
        if name == "learning_rate" and value is None:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (value <= 0 if positive else value < 0):
            raise ValueError(f"{name}={value!r}: must be a finite number {'> 0' if positive else '>= 0'}"
                             + (" or None (chosen by a probe on the held-out KL)" if name == "learning_rate" else ""))
    seed = settings["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r}: must be an int in 0..{MAX_SEED} (what transformers' set_seed takes)")
    if not isinstance(settings["packing"], bool):
        raise ValueError(f"packing={settings['packing']!r}: must be True (full windows of packed text) or False "
                         "(one prompt per paragraph)")
    k = settings["teacher_top_k"]
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size):
        raise ValueError(f"teacher_top_k={k!r}: must be None (full logits) or an int in 1..{vocab_size} "
                         "(the vocabulary size)")


def _saved_choice(folder, settings: dict) -> dict:
    """The budget and learning rate that the run whose checkpoints are in ``folder`` chose
    (its ``choice`` record), for the settings left at ``None`` (written into ``settings``):
    a resumed run trains on with them instead of choosing again."""
    path = None if folder is None else Path(folder) / RUN_FILE
    if path is None or not path.is_file():
        return {}
    saved = json.loads(path.read_text(encoding="utf-8"))
    reused = {}
    for name in ("max_tokens", "learning_rate"):
        record = (saved.get("choice") or {}).get(name) or {}
        if settings[name] is None and record.get("rule") not in (None, "given") and saved.get(name) is not None:
            settings[name], reused[name] = saved[name], record
    return reused


def _budgeted_text(model, teacher, calibration, tokenizer, settings: dict, checkpoint_dir, device):
    """``(choice, training text)``: what the run to resume in ``checkpoint_dir`` chose
    (:func:`_saved_choice`), and :func:`_training_text` for ``settings``; with
    ``max_tokens=None`` (not resumed) first the budget :func:`_default_budget` chooses, then
    at most one pass over the text (into ``choice["max_tokens"]`` and ``settings``)."""
    choice = _saved_choice(checkpoint_dir, settings)
    if settings["max_tokens"] is None:
        choice["max_tokens"] = _default_budget(model, teacher, calibration, settings, device)
        settings["max_tokens"] = choice["max_tokens"]["max_tokens"]
    chosen = choice.get("max_tokens", {}).get("rule") == "time"
    calib, steps, train, held, packed = _training_text(calibration, tokenizer, settings, model, one_pass=chosen)
    if chosen and steps < choice["max_tokens"]["steps"]:
        tokens = steps * settings["batch_size"] * _width(calibration, settings["seq_len"])
        choice["max_tokens"].update(text_limited=True, steps=steps, max_tokens=tokens)
        settings["max_tokens"] = tokens
    return choice, (calib, steps, train, held, packed)


def _probe(student, teacher, train, held, settings: dict, entry, steps: int, device, choice: dict) -> dict:
    """``choice`` with, for ``learning_rate=None``, the learning-rate probe
    (:func:`~hf_layerswap.healing.choice.probe_learning_rate`) of ``entry``'s candidates in
    ``choice["learning_rate"]`` and ``settings``; when it raises, the model is left as it was
    given (the method's ``undo``; the probe put its weights back)."""
    if settings["learning_rate"] is not None:
        return choice
    try:
        choice["learning_rate"] = probe_learning_rate(student, teacher, train, held, settings, entry.learning_rates,
                                                      steps=probe_steps(steps), device=device,
                                                      world=processes_launched(), rows_type=_Rows)
    except BaseException:
        _given_back(entry.undo(student))
        raise
    settings["learning_rate"] = choice["learning_rate"]["learning_rate"]
    return choice


def _default_budget(model: nn.Module, teacher: nn.Module, calibration, settings: dict, device) -> dict:
    """The budget :func:`~hf_layerswap.healing.choice.time_budget` chooses for ``model`` on
    ``device`` (its input device, where the teacher is placed): one forward of the student
    and of the teacher timed there on a batch of the run's shape (random token ids of the
    seed), with the device's name and the two times."""
    width = _width(calibration, settings["seq_len"])
    generator = torch.Generator().manual_seed(settings["seed"])
    ids = torch.randint(0, model.config.vocab_size, (settings["batch_size"], width), generator=generator).to(device)
    student_s, teacher_s = time_forwards(model, ids), time_forwards(teacher, ids)
    return {**time_budget(student_s, teacher_s, settings["batch_size"], width), "device": str(device),
            "throughput": f"forwards timed on {device}{' (CPU time over torch threads)' if device.type == 'cpu' else ''}: "
                          f"student {student_s:.3g} s, teacher {teacher_s:.3g} s per {settings['batch_size']} x {width} "
                          "tokens"}


def _given(choice: dict, max_tokens, learning_rate) -> dict:
    """``choice`` with ``{"rule": "given"}`` for each of the two settings the caller gave."""
    return {"max_tokens": choice.get("max_tokens") if max_tokens is None else {"rule": "given"},
            "learning_rate": choice.get("learning_rate") if learning_rate is None else {"rule": "given"}}


#: The file in a ``checkpoint_dir`` naming the run its checkpoints belong to.
RUN_FILE = "layerswap_heal_run.json"


def claim_checkpoints(folder, settings: dict, *, write: bool = True) -> bool:
    """Write ``settings`` into ``folder`` (only check it could be, with ``write=False``), or
    check they equal those of the run whose checkpoints are there; ``True`` when there is a
    run to resume (``folder`` ``None``: no checkpoints, ``False``).

    Raises:
        ValueError: ``folder`` is a file, a non-empty folder without a run file, or holds
            the checkpoints of a run with other settings (naming them).
    """
    if folder is None:
        return False
    folder = Path(folder)
    path = folder / RUN_FILE
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        differ = sorted(k for k in set(saved) | set(settings) if k != "choice" and saved.get(k) != settings.get(k))
        if differ:
            raise ValueError(
                f"checkpoint_dir {os.fspath(folder)!r} holds checkpoints of a healing run with other settings "
                f"({', '.join(f'{k}: {saved.get(k)!r} there, {settings.get(k)!r} now' for k in differ)}): "
                "choose another folder, or remove it to start over"
            )
        return True
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"checkpoint_dir {os.fspath(folder)!r} is a file: give a new or empty folder")
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"checkpoint_dir {os.fspath(folder)!r} is not empty and holds no {RUN_FILE}: "
                         "not a healing checkpoint folder; choose an empty or new folder")
    if not write:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(settings, path)
    return False


def write_claim(folder, settings: dict) -> None:
    """Write the run file of ``settings`` into ``folder`` (:func:`claim_checkpoints`) from
    the first launched process only, once every process has read the folder (the check of
    :func:`heal` that decides whether to resume), the others waiting until it is there: two
    processes writing one folder would each see the other's half-written file."""
    if folder is None:
        return
    processes = Processes()
    processes.barrier()
    if processes.rank == 0:
        claim_checkpoints(folder, settings)
    processes.barrier()


def _teacher_cache(teacher, rows: _Rows, k: int | None, batch_size: int, device) -> dict | None:
    """The teacher's :func:`teacher_top_k` over every row, on the CPU (``None`` for ``k`` ``None``)."""
    if k is None:
        return None
    parts = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            ids = rows.ids[start:start + batch_size].to(device)
            mask = rows.mask[start:start + batch_size].to(device)
            logits = teacher(input_ids=ids, attention_mask=mask).logits
            parts.append([t.cpu() for t in teacher_top_k(logits, k)])
    return {key: torch.cat([p[i] for p in parts]) for i, key in enumerate(TEACHER_CACHE_KEYS)}


def _measure_after(measures: HealMeasures, healed, start: dict, report: HealReport) -> None:
    """The perplexity and tasks after healing, into ``report`` and its recorded step."""
    report.perplexity, report.tasks = measures.finish(healed, start)
    healed.config.layerswap["healing"][-1].update(copy.deepcopy({"perplexity": report.perplexity, "tasks": report.tasks}))


def _record_step(model, report: HealReport) -> None:
    """Append the report (less its histories) to ``config.layerswap["healing"]``, with the
    removal step it follows and the library versions; leave it on ``model.layerswap_heal_report``."""
    record = getattr(model.config, "layerswap", None) or {}
    step = {k: v for k, v in report.to_dict().items() if k not in ("loss_history", "eval_history")}
    step["after_removal_step"] = len(record.get("steps", []))
    step["library_versions"] = library_versions()
    model.config.layerswap = {**record, "healing": record.get("healing", []) + [step]}
    model.layerswap_heal_report = report
