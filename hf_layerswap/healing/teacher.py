"""The teacher of :func:`~hf_layerswap.healing.heal`, checked before any training: one that
can teach the student (:func:`check_teacher`), the model the student was cut from
(:func:`teacher_origin`, by the removal record's dtype-independent weights sample), and a
finite held-out KL to start from (:func:`check_finite_start`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..utils.devices import input_device, offloaded_modules
from ..surgery.history import param_dtype, same_weights, weights_sample
from ..layerplan import model_fingerprint, num_blocks
from ..utils.provenance import public_identity
from ..scoring.rule import NonFiniteScoresError
from .loss import distillation_loss

__all__ = ["check_finite_start", "check_in_memory", "heldout_kl", "check_teacher", "place_teacher", "teacher_origin"]


def check_in_memory(model: nn.Module, role: str = "the student") -> None:
    """Refuse a model with offloaded weights (an accelerate device map that keeps blocks on
    the CPU or disk between calls, ``--max-memory ... --offload-folder``): training needs
    every weight it updates, and the teacher, on one device in memory.

    Raises:
        ValueError: naming the model's role, how many modules are offloaded and what to do.
    """
    offloaded = offloaded_modules(model)
    if offloaded:
        raise ValueError(
            f"healing with {role} offloaded ({len(offloaded)} module(s) kept on the CPU or disk by its device map) "
            "is not supported: training moves every weight to one device; load the models without offloading "
            "(no --offload-folder, a --max-memory that holds them)"
        )


def check_teacher(model: nn.Module, teacher: nn.Module, tokenizer=None, teacher_tokenizer=None) -> None:
    """Refuse a teacher that cannot teach ``model``: the same object, a different
    ``config.vocab_size`` or output-head shape, another block count than the model the
    student was cut from (``config.layerswap``: the original model, or the one its last cut
    started from), or a tokenizer with a different vocabulary; and either model with
    offloaded weights (:func:`check_in_memory`).

    Raises:
        ValueError: naming the mismatching values.
    """
    check_in_memory(model)
    check_in_memory(teacher, "the teacher")
    if teacher is model:
        raise ValueError("teacher is the student itself: pass the dense base model as teacher")
    sizes = [(m.config.vocab_size, tuple(m.get_output_embeddings().weight.shape)) for m in (model, teacher)]
    if sizes[0][0] != sizes[1][0] or sizes[0][1][0] != sizes[1][1][0]:
        raise ValueError(
            f"teacher vocabulary (vocab_size={sizes[1][0]}, lm_head {sizes[1][1]}) differs from the student's "
            f"(vocab_size={sizes[0][0]}, lm_head {sizes[0][1]}): the KL needs the same vocabulary"
        )
    record = getattr(model.config, "layerswap", None) or {}
    last = (record.get("steps") or [{}])[-1]
    depths = [d for d in (record.get("original_num_hidden_layers"), last.get("num_blocks_before")
                          if isinstance(last, Mapping) else None) if isinstance(d, int)]
    if depths and num_blocks(teacher) not in depths:
        raise ValueError(f"teacher has {num_blocks(teacher)} blocks but the student was cut from a model of "
                         f"{' or '.join(map(str, sorted(set(depths))))} (config.layerswap): pass the dense model it "
                         "was pruned from as teacher")
    if tokenizer is not None and teacher_tokenizer is not None and tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        raise ValueError(
            f"teacher tokenizer ({len(teacher_tokenizer)} tokens) differs from the student's ({len(tokenizer)} tokens)"
        )


def teacher_origin(model: nn.Module, teacher: nn.Module, *, allow_foreign: bool = False) -> dict:
    """Whether ``teacher`` holds the weights of the model the student ``model`` was cut from:
    its dtype-independent :func:`~hf_layerswap.surgery.history.weights_sample` against the
    ``weights_sample_before`` recorded by the first removal step (``heal PRUNED BASE``: the
    original model) or the last one (the pipeline's copy taken just before its cut), so a
    bfloat16 or float16 copy of the right model matches. A record written before that field
    existed is compared by its ``fingerprint_before`` when the teacher has the dtype the step
    recorded (``dtype_after``); otherwise the teacher cannot be checked and a warning says so.

    Returns:
        ``{"name", "fingerprint", "matches", "note"}``: the teacher's public name, its
        :func:`~hf_layerswap.layerplan.model_fingerprint`, ``True`` (the model it was cut from),
        ``False`` (another model, accepted with ``allow_foreign``) or ``None`` (not
        checkable; ``note`` says why).

    Raises:
        ValueError: ``matches`` would be ``False`` without ``allow_foreign``, naming the step.
    """
    if not isinstance(allow_foreign, bool):
        raise ValueError(f"allow_foreign_teacher={allow_foreign!r}: must be True or False")
    record = getattr(model.config, "layerswap", None) or {}
    steps = [] if record.get("history") == "unverified" else [s for s in record.get("steps") or []
                                                               if isinstance(s, Mapping)]
    depth = num_blocks(teacher)
    ends = {1: steps[0], len(steps): steps[-1]} if steps else {}
    candidates = [(n, s) for n, s in ends.items() if s.get("num_blocks_before") in (None, depth)]
    exact = model_fingerprint(teacher)
    out = {"name": public_identity(teacher).get("name"), "fingerprint": exact, "matches": None, "note": None}
    compared, unchecked, sample = [], [], None
    for number, step in candidates:
        recorded = step.get("weights_sample_before")
        if isinstance(recorded, Mapping) and recorded:
            sample = sample or weights_sample(teacher)
            if same_weights(recorded, sample):
                return {**out, "matches": True}
            compared.append(number)
            continue
        recorded = step.get("fingerprint_before")
        if not (isinstance(recorded, str) and recorded):
            continue
        if step.get("dtype_after") == param_dtype(teacher):
            if recorded == exact:
                return {**out, "matches": True}
            compared.append(number)
        else:
            unchecked.append(f"removal step {number} recorded only a {step.get('dtype_after') or 'unrecorded'} "
                             f"fingerprint (written before the dtype-independent sample) and the teacher is "
                             f"{param_dtype(teacher)}")
    if compared:
        if not allow_foreign:
            raise ValueError(
                f"the teacher is not the model the student was cut from: its weights differ from those config.layerswap "
                f"recorded before removal step {compared[0]} (fingerprint {exact[:12]} now; same shape, other weights; "
                "any dtype of the right model is accepted): pass the dense model it was pruned from as teacher, or "
                "allow_foreign_teacher=True (--allow-foreign-teacher) to distil from another teacher, recorded as such")
        return {**out, "matches": False, "note": "not the model the student was cut from (its weights differ from the "
                                                  "removal record's); accepted with allow_foreign_teacher"}
    note = ("; ".join(unchecked) + ": the teacher could not be checked against the removal record") if unchecked else (
        "config.layerswap records no weights of the model the student was cut from: the teacher was not checked")
    if unchecked:
        warnings.warn(note, UserWarning, stacklevel=3)
    return {**out, "note": note}


def heldout_kl(model: nn.Module, teacher: nn.Module, held, batch_size: int) -> tuple[float, list[str]]:
    """``(KL, which)``: the held-out KL(teacher || student), nats per real token over the
    prompts of ``held`` in batches of ``batch_size``, and which models' logits hold a NaN or
    inf (``"teacher"``, ``"student"``)."""
    total, tokens = 0.0, 0.0
    bad = []
    with torch.no_grad():
        for start in range(0, len(held), batch_size):
            ids, mask = held.ids[start:start + batch_size], held.mask[start:start + batch_size]
            logits = {}
            for name, net in (("teacher", teacher), ("student", model)):
                out = net(input_ids=ids.to(input_device(net)), attention_mask=mask.to(input_device(net))).logits
                logits[name] = out
                if not bool(torch.isfinite(out[mask.to(out.device).bool()].float()).all()) and name not in bad:
                    bad.append(name)
            device = logits["student"].device
            count = float(mask.sum())
            kl = distillation_loss(logits["student"], logits["teacher"].to(device), mask.to(device))
            total, tokens = total + float(kl) * count, tokens + count
    value = total / tokens if tokens else float("nan")
    return value, bad


def check_finite_start(model: nn.Module, teacher: nn.Module, held, batch_size: int) -> None:
    """Refuse, before any training, measuring or checkpoint, a held-out KL that is not finite
    (a model that overflows in its dtype, e.g. float16): a NaN start is no basis for
    healing, and training would only carry the NaN into every number recorded.

    Raises:
        NonFiniteScoresError: naming the value, which model's logits are not finite and what to try.
    """
    value, bad = heldout_kl(model, teacher, held, batch_size)
    if bad or not math.isfinite(value):
        dtype = param_dtype(model)
        raise NonFiniteScoresError(
            f"the held-out KL(teacher || student) before healing is {value} (non-finite"
            + (f": the {' and the '.join(bad)}'s logits hold NaN or inf" if bad else "")
            + f"; the models are {dtype}): non-finite values are a result to report, never a basis for healing; "
            "load the models in float32 (--dtype float32) or bfloat16, or heal on other calibration text",
            nonfinite={"held-out KL before healing": value})


def place_teacher(teacher: nn.Module, model: nn.Module) -> torch.device:
    """Put ``teacher`` in eval mode where it can meet the student's inputs and return the
    device the student's token ids go to (:func:`~hf_layerswap.utils.devices.input_device`, the
    execution device of its embeddings, also for a split or offloaded student). A teacher
    held whole on one device is moved there; one dispatched over devices (a ``device_map``,
    offloaded weights) stays as accelerate placed it, its hooks moving each input."""
    device = input_device(model)
    if not offloaded_modules(teacher) and not getattr(teacher, "hf_device_map", None):
        teacher.to(device)
    teacher.eval()
    return device
