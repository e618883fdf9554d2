"""Removal history you can trust: the ``config.layerswap`` record checked against the model.

:func:`~hf_layerswap.remove_layers` writes a record into ``model.config.layerswap``
(original block count, kept and removed blocks in the original 0-based numbering, one
entry per removal step, and a weight fingerprint after each step). Other tools that edit a
checkpoint (a mergekit passthrough that drops or reorders blocks, a hand-edited
``config.json``, a conversion that rewrote the weights) carry that record along unchanged,
and it then describes a model that no longer exists.

:func:`verify_history` compares the record with the model: block count, the kept/removed
lists (sorted, disjoint, covering the original depth), the removal steps replayed from the
original blocks (each step's indices name the original blocks it records, and together the
steps removed exactly ``removed_layers``), the last step's block count, and
the fingerprint recorded after the last step where one is present and comparable (same
parameter dtype, and no later step of this library that changed the weights on purpose:
sparsification or a repair of the cut). On a mismatch it warns once, naming the probable
cause, and rewrites the record as **unverified**: what is known (the blocks the model has
now, the claimed base model) is kept, the old record is kept verbatim under
``unverified_record`` as evidence, and block numbering restarts at the checkpoint as
loaded. A later removal then extends the unverified record, never the wrong one; the
model card says the history is unverified; :func:`~hf_layerswap.push_to_hub` refuses a
record that fails the check unless it has been marked unverified.

The check runs when the quantizer plugin loads a checkpoint (``from_pretrained`` with a
:class:`~hf_layerswap.LayerSwapConfig`) and at the start of every
:func:`~hf_layerswap.remove_layers`.
"""

from __future__ import annotations

import copy
import hashlib
import math
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..layerplan import model_fingerprint, num_blocks

__all__ = [
    "HistoryWarning",
    "history_problems",
    "history_status",
    "mark_history_unverified",
    "probable_cause",
    "same_weights",
    "verify_history",
    "weights_sample",
]

UNVERIFIED = "unverified"
VERIFIED = "verified"


class HistoryWarning(UserWarning):
    """``config.layerswap`` does not describe the loaded model; its history is now unverified."""


def _record(model) -> Mapping | None:
    record = getattr(getattr(model, "config", None), "layerswap", None)
    return record if isinstance(record, Mapping) and record else None


def param_dtype(model: nn.Module) -> str | None:
    """The dtype of the first floating-point parameter (``"torch.float32"``), or ``None``."""
    for param in model.parameters():
        if param.is_floating_point():
            return str(param.dtype)
    return None


def weights_changed_later(config) -> bool:
    """True when a step of this library changed the weights after the last removal on
    purpose (one-shot sparsification, a repair of the cut, healing), so the fingerprint recorded at
    removal time no longer applies."""
    record = getattr(config, "layerswap", None) or {}
    healed = any(isinstance(h, Mapping) and not h.get("stale") for h in record.get("healing") or [])
    return bool(getattr(config, "layerswap_sparsity", None)) or bool(record.get("recovery")) or healed


def _index_list(value) -> list[int] | None:
    if not isinstance(value, (list, tuple)):
        return None
    if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        return None
    return list(value)


def history_problems(model: nn.Module, *, fingerprint: bool = True) -> list[str]:
    """What in ``model.config.layerswap`` disagrees with ``model`` (empty list = consistent,
    or no record).

    Args:
        model: a transformers causal LM.
        fingerprint: also compare the weight fingerprint recorded after the last removal
            step (where present and comparable, see the module docstring).

    A record already marked unverified is checked only for its own consistency.
    """
    record = _record(model)
    if record is None:
        return []
    n = num_blocks(model)
    problems: list[str] = []
    kept = _index_list(record.get("kept_layers"))
    removed = _index_list(record.get("removed_layers"))
    original = record.get("original_num_hidden_layers")
    if kept is None or removed is None or isinstance(original, bool) or not isinstance(original, int):
        return ["config.layerswap lacks kept_layers / removed_layers / original_num_hidden_layers as 0-based ints"]
    if len(kept) != n:
        problems.append(f"config.layerswap lists {len(kept)} kept blocks but the model has {n}")
    if kept != sorted(set(kept)) or removed != sorted(set(removed)):
        problems.append("config.layerswap kept_layers / removed_layers are not sorted, distinct indices")
    if set(kept) & set(removed):
        problems.append(f"config.layerswap lists blocks {sorted(set(kept) & set(removed))} as both kept and removed")
    if sorted(set(kept) | set(removed)) != list(range(original)):
        problems.append(
            f"config.layerswap kept + removed blocks do not make up the original {original} blocks 0..{original - 1}"
        )
    steps = record.get("steps") or []
    if not problems:
        problems += _step_problems(steps, original, removed)
    last = steps[-1] if steps and isinstance(steps[-1], Mapping) else {}
    if "num_blocks_after" in last and last["num_blocks_after"] != n:
        problems.append(f"the last removal step left {last['num_blocks_after']} blocks but the model has {n}")
    recorded = last.get("fingerprint_after")
    if (
        fingerprint
        and not problems
        and recorded
        and record.get("history") != UNVERIFIED
        and last.get("dtype_after") == param_dtype(model)
        and not weights_changed_later(model.config)
        and model_fingerprint(model) != recorded
    ):
        problems.append(
            "the weights differ from those recorded after the last removal step (fingerprint "
            f"{recorded[:12]} recorded, {model_fingerprint(model)[:12]} now)"
        )
    return problems


def _step_problems(steps, original: int, removed: list[int]) -> list[str]:
    """The removal steps replayed from the original ``0..original-1`` blocks: each step's
    local indices must name the original blocks it records, and together the steps must
    have removed exactly ``removed`` (empty list = they agree; steps that do not record
    their indices are not replayed)."""
    kept = list(range(original))
    for k, step in enumerate(steps):
        local = _index_list(step.get("removed_layers")) if isinstance(step, Mapping) else None
        recorded = _index_list(step.get("removed_original_layers")) if isinstance(step, Mapping) else None
        if local is None or recorded is None:
            return []
        if any(not 0 <= i < len(kept) for i in local):
            return [f"removal step {k} removed blocks {local} but only {len(kept)} blocks were left before it"]
        mapped = [kept[i] for i in local]
        if mapped != recorded:
            return [f"removal step {k} removed blocks {local} of {len(kept)}, which are original blocks {mapped}, "
                    f"but it records original blocks {recorded}"]
        kept = [b for j, b in enumerate(kept) if j not in set(local)]
    if steps and sorted(set(range(original)) - set(kept)) != removed:
        return [f"config.layerswap lists removed blocks {removed} but its removal steps removed "
                f"{sorted(set(range(original)) - set(kept))} (original numbering)"]
    return []


def probable_cause(problems: list[str]) -> str:
    """One sentence naming the most likely reason for ``problems`` (from :func:`history_problems`)."""
    text = " ".join(problems)
    if "kept blocks but the model has" in text or "the last removal step left" in text:
        return (
            "the block count changed outside hf_layerswap, most likely a merge or pruning tool (e.g. a mergekit "
            "passthrough merge) that copied config.layerswap unchanged, or a hand-edited config.json"
        )
    if "weights differ" in text:
        return (
            "the weights changed after the removal was recorded: blocks reordered or replaced by a merge tool "
            "(e.g. mergekit), fine-tuning, or a conversion that rewrote the tensors"
        )
    return "config.layerswap was edited by hand or copied from another checkpoint"


def history_status(model_or_config) -> str | None:
    """``"verified"`` / ``"unverified"`` for a model (or config) with a record, else ``None``.

    ``"verified"`` means the record has not been marked unverified; call
    :func:`verify_history` first to check it against the model."""
    config = getattr(model_or_config, "config", model_or_config)
    record = getattr(config, "layerswap", None)
    if not isinstance(record, Mapping) or not record:
        return None
    return UNVERIFIED if record.get("history") == UNVERIFIED else VERIFIED


def mark_history_unverified(model: nn.Module, problems: list[str] | None = None, *, cause: str | None = None) -> Mapping:
    """Rewrite ``model.config.layerswap`` as an unverified history and return it.

    Kept: the claimed ``base_model``, the reasons, the probable cause and the old record
    verbatim under ``unverified_record``. Block numbering restarts at the model as it is
    now (``kept_layers = 0..L-1``, nothing removed), so a later
    :func:`~hf_layerswap.remove_layers` records its removals against blocks that exist.
    """
    record = _record(model) or {}
    if record.get("history") == UNVERIFIED:
        return record
    problems = list(problems if problems is not None else history_problems(model))
    n = num_blocks(model)
    new = {
        "history": UNVERIFIED,
        "unverified_reasons": problems,
        "probable_cause": cause or probable_cause(problems),
        "base_model": record.get("base_model"),
        "original_num_hidden_layers": n,
        "removed_layers": [],
        "kept_layers": list(range(n)),
        "steps": [],
        "unverified_record": copy.deepcopy(dict(record)),
    }
    model.config.layerswap = new
    return new


def verify_history(model: nn.Module, *, warn: bool = True) -> bool:
    """Check ``model.config.layerswap`` against ``model``; on a mismatch warn once
    (:class:`HistoryWarning`, naming the probable cause) and mark the history unverified.

    Returns:
        ``True`` when there is no record or it matches the model; ``False`` when the
        history is (now) unverified. A record already marked unverified returns
        ``False`` without warning again.
    """
    record = _record(model)
    if record is None:
        return True
    if record.get("history") == UNVERIFIED:
        return False
    problems = history_problems(model)
    if not problems:
        return True
    cause = probable_cause(problems)
    mark_history_unverified(model, problems, cause=cause)
    if warn:
        warnings.warn(
            f"config.layerswap does not describe this model ({'; '.join(problems)}). Probable cause: {cause}. "
            "The removal history is now marked unverified: block numbers restart at this checkpoint as loaded, "
            "and the old record is kept under config.layerswap['unverified_record'].",
            HistoryWarning,
            stacklevel=2,
        )
    return False


#: Parameter tensors and leading values per tensor in a :func:`weights_sample`.
SAMPLE_TENSORS, SAMPLE_VALUES = 16, 4
#: Relative tolerance of :func:`same_weights`: two bfloat16 steps (a float16 copy rounds
#: twice), plus an absolute one for float16's subnormal values.
SAMPLE_RTOL, SAMPLE_ATOL = 2.0**-7, 1e-7


def weights_sample(model: nn.Module) -> dict:
    """A dtype-independent identity of a model's weights, for config.json:
    ``{"layout": sha256 hex of the architecture, block count, parameter names and shapes,
    "values": the first SAMPLE_VALUES values of SAMPLE_TENSORS parameter tensors spread
    over the model, rounded to bfloat16}``. The same weights in float32, bfloat16 or float16
    give samples :func:`same_weights` accepts; other weights of the same shape do not."""
    params = [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]
    fingerprint = hashlib.sha256(repr((type(model).__name__, num_blocks(model))).encode())
    for name, param in params:
        fingerprint.update(f"{name}:{tuple(param.shape)};".encode())
    picks = sorted({round(i * (len(params) - 1) / max(SAMPLE_TENSORS - 1, 1)) for i in range(SAMPLE_TENSORS)}) if params else []
    values = [float(v) for i in picks
              for v in params[i][1].detach().reshape(-1)[:SAMPLE_VALUES].to("cpu", torch.bfloat16).float()]
    return {"layout": fingerprint.hexdigest(), "values": values}


def same_weights(sample: Mapping, other: Mapping) -> bool:
    """Whether two :func:`weights_sample` records describe the same weights (the same layout,
    every value within :data:`SAMPLE_RTOL` / :data:`SAMPLE_ATOL`; NaN and inf only equal to themselves)."""
    a, b = list(sample.get("values") or []), list(other.get("values") or [])
    if sample.get("layout") != other.get("layout") or len(a) != len(b) or not a:
        return False
    for x, y in zip(a, b):
        if not (isinstance(x, (int, float)) and isinstance(y, (int, float))):
            return False
        if x == y:
            continue
        if not (math.isfinite(x) and math.isfinite(y)) or abs(x - y) > SAMPLE_RTOL * max(abs(x), abs(y)) + SAMPLE_ATOL:
            return False
    return True


def record_fingerprint(model: nn.Module, step: dict) -> None:
    """Store the weight fingerprint and parameter dtype after a removal step in ``step``."""
    step["fingerprint_after"] = model_fingerprint(model)
    step["dtype_after"] = param_dtype(model)


def card_notice(record: Mapping) -> str | None:
    """The model card's sentence for an unverified history (``None`` for a verified one)."""
    if not isinstance(record, Mapping) or record.get("history") != UNVERIFIED:
        return None
    claimed = (record.get("unverified_record") or {}).get("removed_layers")
    return (
        "**Removal history unverified.** The `config.layerswap` record this checkpoint carried did not match its "
        f"weights ({'; '.join(record.get('unverified_reasons') or ['no reason recorded'])}); probable cause: "
        f"{record.get('probable_cause') or 'unknown'}. Only what is known is listed: block numbers below count "
        "from the checkpoint as it was loaded, not from the original model"
        + (f", and the earlier claim (blocks {claimed} removed) is not repeated as fact." if claimed else ".")
    )
