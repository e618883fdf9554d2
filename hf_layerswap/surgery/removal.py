"""Permanent block removal: the removal plan made real, with per-layer config surgery.

Invariants after :func:`remove_layers` (see DESIGN.md, "Surgery invariants"):

- the decoder's ``nn.ModuleList`` holds the kept blocks in order;
- every ``layer_idx`` inside them is renumbered ``0..L'-1`` (the KV cache is indexed by it);
- per-layer config lists (``layer_types``, ``no_rope_layers``) are filtered by kept index
  *before* ``num_hidden_layers`` is set, and index-valued fields are remapped (or the call
  is refused, naming the field);
- ``num_hidden_layers == len(blocks)`` (on the text sub-config of multimodal models);
- provenance is recorded in ``model.config.layerswap`` (0-based, original indices).
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Sequence

from torch import nn

from .history import record_fingerprint, verify_history, weights_sample
from ..layerplan import ONE_BLOCK, PER_LAYER_LIST_FIELDS, decoder_blocks, decoder_config, resolve_layer_indices
from ..layerplan import model_fingerprint
from ..utils.provenance import library_versions, model_identity
from .operators import OPERATOR_METHODS, attach_operator, carried_operators, take_operators

__all__ = ["check_surgery_invariants", "kept_after", "remove_layers", "stale_healing"]


def _remap_prefix_count(value: int, kept: Sequence[int]) -> int:
    """A "first k layers are special" count, after removal: kept layers with index < k."""
    return sum(1 for k in kept if k < value)


def _qwen_moe_fields(cfg, kept: Sequence[int], num_blocks: int) -> dict:
    """Qwen2/3-MoE: ``mlp_only_layers`` (indices) + ``decoder_sparse_step`` decide which
    blocks are sparse at construction. Rewrite them so the kept blocks keep their kind."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    only = set(getattr(cfg, "mlp_only_layers", None) or [])
    num_experts = getattr(cfg, "num_experts", 0) or 0
    sparse = [(i not in only) and num_experts > 0 and (i + 1) % step == 0 for i in range(num_blocks)]
    return {
        "decoder_sparse_step": 1,
        "mlp_only_layers": [new for new, old in enumerate(kept) if not sparse[old]],
    }


#: Index-valued config fields and how they are remapped. Each entry maps a field name to a
#: function ``(cfg, kept, num_blocks) -> {field: new_value}``.
INDEX_FIELDS = {
    "max_window_layers": lambda cfg, kept, n: {"max_window_layers": _remap_prefix_count(cfg.max_window_layers, kept)},
    "first_k_dense_replace": lambda cfg, kept, n: {
        "first_k_dense_replace": _remap_prefix_count(cfg.first_k_dense_replace, kept)
    },
    "mlp_only_layers": _qwen_moe_fields,
    "decoder_sparse_step": _qwen_moe_fields,
}

#: Fields that cannot be remapped: a model that sets them is refused. (Gemma3n's
#: ``hidden_size_per_layer_input`` sizes a per-layer input embedding tensor whose width is
#: ``num_hidden_layers * hidden_size_per_layer_input``.)
UNMAPPABLE_FIELDS = ("num_kv_shared_layers", "layers_block_type", "attn_layer_indices", "hidden_size_per_layer_input")

#: Config fields that name the decoder depth of encoder-decoder style configs; when one is
#: present and ``num_hidden_layers`` is not an alias of it, setting ``num_hidden_layers``
#: would change the wrong count (BART maps it to ``encoder_layers``).
DECODER_DEPTH_FIELDS = ("decoder_layers", "num_decoder_layers")


def _is_token_list(name: str) -> bool:
    return name == "architectures" or name.endswith(("_token_id", "_token_ids"))


def _refusals(model: nn.Module, cfg, num_blocks: int) -> list[str]:
    problems = []
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        problems.append("is_encoder_decoder=True (encoder-decoder models are not supported; decoder-only causal LMs are)")
    alias = getattr(type(cfg), "attribute_map", {}).get("num_hidden_layers")
    for name in DECODER_DEPTH_FIELDS:
        if name in vars(cfg) and alias != name:
            problems.append(
                f"{name}={vars(cfg)[name]!r} (the decoder depth lives in {name}, but config.num_hidden_layers "
                f"{'is an alias of ' + alias if alias else 'is a separate field'})"
            )
    if getattr(cfg, "num_hidden_layers", None) != num_blocks:
        problems.append(
            f"num_hidden_layers={getattr(cfg, 'num_hidden_layers', None)!r} but the decoder has {num_blocks} blocks "
            "(the config does not describe this block list)"
        )
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
        problems.append(
            "scale_attn_by_inverse_layer_idx=True (GPT-2 fixes each block's attention scale from its layer index at "
            "construction, so a pruned checkpoint would change on reload)"
        )
    if getattr(cfg, "is_heterogeneous", False):
        problems.append("per_layer_config (heterogeneous per-layer overrides keyed by layer index)")
    for name in UNMAPPABLE_FIELDS:
        value = getattr(cfg, name, None)
        if value not in (None, 0, [], {}, ()):
            problems.append(f"{name}={value!r} (per-layer field that cannot be remapped)")
    known = set(PER_LAYER_LIST_FIELDS) | set(INDEX_FIELDS) | set(UNMAPPABLE_FIELDS) | {"per_layer_config"}
    for name, value in vars(cfg).items():
        if name in known or _is_token_list(name) or name.startswith("_"):
            continue
        if isinstance(value, (list, tuple)) and len(value) == num_blocks:
            problems.append(f"{name} (a per-layer list of length {num_blocks} this library does not know how to filter)")
    return problems


def kept_after(num_blocks: int, removed: Sequence[int]) -> list[int]:
    """0-based indices kept after removing ``removed`` from ``num_blocks`` blocks."""
    drop = set(resolve_layer_indices(removed, num_blocks))
    return [i for i in range(num_blocks) if i not in drop]


def remove_layers(model: nn.Module, layers: Sequence[int], *, provenance: dict | None = None) -> nn.Module:
    """Remove decoder blocks in place and keep the model and its config consistent.

    Args:
        model: a transformers causal LM (decoder-only, or a multimodal model's text tower).
        layers: 0-based indices of the blocks to remove (negative = from the end).
        provenance: extra JSON-able facts for this step (protocol, scores summary,
            calibration spec) stored in ``model.config.layerswap["steps"]``.

    Ghosted recovery operators attached to the model stay exact: each moves to the
    boundary the cut leaves it at, and operators that meet are multiplied
    (:func:`hf_layerswap.surgery.operators.carried_operators`).

    Returns:
        The same ``model`` object.

    Raises:
        ValueError: out-of-range or duplicate indices, an empty set, removal of every
            block, a model with no decoder block list, or a config field that cannot be
            remapped (the message names it), or ``provenance`` keys that name a computed
            field. TypeError: non-integer indices, or ``provenance`` that is not a dict
            of JSON-able values. Nothing is changed when it raises.
    """
    owner, name, blocks = decoder_blocks(model)
    cfg = decoder_config(model)
    num_blocks = len(blocks)
    removed = resolve_layer_indices(layers, num_blocks)
    kept = [i for i in range(num_blocks) if i not in set(removed)]
    if not kept:
        most = ONE_BLOCK if num_blocks == 1 else f"at most {num_blocks - 1} of {num_blocks} can go"
        raise ValueError(f"removing {removed} would leave no block: {most}")
    problems = _refusals(model, cfg, num_blocks)
    if problems:
        raise ValueError(f"cannot remove blocks from {type(model).__name__}: " + "; ".join(problems))
    _check_provenance(provenance)

    verify_history(model)  # a record that does not describe the model is marked unverified, never extended
    fingerprint_before = model_fingerprint(model)
    sample_before = weights_sample(model)  # dtype-independent: healing checks its teacher against it
    removed_parameters = sum(p.numel() for i in removed for p in blocks[i].parameters())
    base_name = model_identity(model).get("name")
    if not (isinstance(base_name, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", base_name) and not os.path.exists(base_name)):
        base_name = None  # only Hub ids are recorded, never local paths

    # compute every change first, then apply (nothing half-done on error)
    updates: dict = {}
    for field in PER_LAYER_LIST_FIELDS:
        value = getattr(cfg, field, None)
        if value is None:
            continue
        if len(value) != num_blocks:
            raise ValueError(f"config.{field} has {len(value)} entries but the model has {num_blocks} blocks")
        updates[field] = type(value)(value[i] for i in kept)
    for field, remap in INDEX_FIELDS.items():
        if getattr(cfg, field, None) is not None and field not in updates:
            updates.update(remap(cfg, kept, num_blocks))

    operators = take_operators(model)  # repair operators (ghosted, linearpatch): put back where the cut moves them
    setattr(owner, name, nn.ModuleList([blocks[i] for i in kept]))
    for new_idx, block in enumerate(getattr(owner, name)):
        for module in block.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_idx
    for field, value in updates.items():  # per-layer lists BEFORE num_hidden_layers
        setattr(cfg, field, value)
    cfg.num_hidden_layers = len(kept)
    _remap_device_map(model, owner, name, kept)
    operators = carried_operators(operators, kept)
    for boundary, weight in operators.items():
        attach_operator(model, boundary, weight)

    top = model.config
    previous = copy.deepcopy(getattr(top, "layerswap", None) or {})
    original_kept = previous.get("kept_layers", list(range(num_blocks)))
    step = {
        "removed_layers": removed,
        "num_blocks_before": num_blocks,
        "num_blocks_after": len(kept),
        "removed_original_layers": [original_kept[i] for i in removed],
        "fingerprint_before": fingerprint_before,
        "weights_sample_before": sample_before,
        "removed_parameters": removed_parameters,
        "library_versions": library_versions(),
        **(provenance or {}),
    }
    top.layerswap = {
        "base_model": previous.get("base_model", base_name),
        "original_num_hidden_layers": previous.get("original_num_hidden_layers", num_blocks),
        "removed_layers": sorted(previous.get("removed_layers", []) + step["removed_original_layers"]),
        "kept_layers": [original_kept[i] for i in kept],
        "steps": previous.get("steps", []) + [step],
        **{k: previous[k] for k in HISTORY_FIELDS if k in previous},
    }
    if previous.get("healing"):
        top.layerswap["healing"] = stale_healing(previous["healing"], len(top.layerswap["steps"]) - 1)
    if operators and (previous.get("recovery") or {}).get("method") in OPERATOR_METHODS:
        top.layerswap["recovery"] = {**previous["recovery"], "boundaries": sorted(operators)}
    record_fingerprint(model, step)
    return model


def stale_healing(healing: list, step: int | None = None, *, note: str | None = None) -> list:
    """The healing records of ``config.layerswap["healing"]`` after removal step ``step``
    (0-based, the index in ``config.layerswap["steps"]``, as the card's steps table numbers
    them), or after another step that changed the weights (``note`` says which, e.g. a
    sparsification): each is kept as evidence, marked ``"stale"`` (its KL and perplexity
    describe the model before that step) unless an earlier step already marked it."""
    if note is None:
        note = f"removal step {step} came after this healing: its numbers describe the model before that cut"
    return [entry if entry.get("stale") else {**entry, "stale": note} for entry in healing]


#: Keys of an unverified history (see :mod:`hf_layerswap.surgery.history`) that later steps keep.
HISTORY_FIELDS = ("history", "unverified_reasons", "probable_cause", "unverified_record")


#: Fields of a removal step that the library computes; ``provenance`` may not set them.
STEP_FIELDS = (
    "removed_layers", "num_blocks_before", "num_blocks_after", "removed_original_layers", "fingerprint_before",
    "weights_sample_before", "removed_parameters", "library_versions", "fingerprint_after", "dtype_after",
)


def _check_provenance(provenance) -> None:
    """Refuse, before anything changes, provenance that config.json could not hold or
    that would overwrite the step's computed fields."""
    if provenance is None:
        return
    if not isinstance(provenance, dict):
        raise TypeError(f"provenance must be a dict of JSON-able facts, got {type(provenance).__name__}")
    reserved = sorted(set(provenance) & set(STEP_FIELDS))
    if reserved:
        raise ValueError(f"provenance keys {reserved} are computed by remove_layers and cannot be given")
    try:
        json.dumps(provenance, allow_nan=True)
    except (TypeError, ValueError) as err:
        raise TypeError(f"provenance must be JSON-able (it is saved in config.json): {err}") from None


def _remap_device_map(model, owner, name, kept):
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return
    prefix = next((n for n, m in model.named_modules() if m is owner), "")
    pattern = re.compile(rf"^{re.escape((prefix + '.' if prefix else '') + name)}\.(\d+)(.*)$")
    new_index = {old: new for new, old in enumerate(kept)}
    remapped = {}
    for key, dev in device_map.items():
        m = pattern.match(key)
        if m is None:
            remapped[key] = dev
        elif int(m.group(1)) in new_index:
            remapped[f"{key[: m.start(1)]}{new_index[int(m.group(1))]}{m.group(2)}"] = dev
    model.hf_device_map = remapped


def original_indices(config, num_blocks: int) -> list[int]:
    """0-based indices, in the model before any removal, of its current ``num_blocks``
    blocks: ``config.layerswap["kept_layers"]`` when it matches, else ``0..num_blocks-1``."""
    kept = (getattr(config, "layerswap", None) or {}).get("kept_layers")
    if isinstance(kept, list) and len(kept) == num_blocks:
        return [int(i) for i in kept]
    return list(range(num_blocks))


def check_surgery_invariants(model: nn.Module) -> list[str]:
    """Return the violated surgery invariants (empty list = consistent).

    Checks: ``num_hidden_layers == len(blocks)``, contiguous ``layer_idx`` 0..L-1, per-layer
    config lists of length L, and provenance consistency when ``config.layerswap`` exists.
    """
    problems = []
    _, _, blocks = decoder_blocks(model)
    cfg = decoder_config(model)
    n = len(blocks)
    if cfg.num_hidden_layers != n:
        problems.append(f"config.num_hidden_layers={cfg.num_hidden_layers} but the decoder has {n} blocks")
    for pos, block in enumerate(blocks):
        for mod_name, module in block.named_modules():
            idx = getattr(module, "layer_idx", None)
            if isinstance(idx, int) and idx != pos:
                problems.append(f"block {pos} ({mod_name or 'block'}) has layer_idx={idx}")
    for field in PER_LAYER_LIST_FIELDS:
        value = getattr(cfg, field, None)
        if value is not None and len(value) != n:
            problems.append(f"config.{field} has {len(value)} entries for {n} blocks")
    record = getattr(model.config, "layerswap", None)
    if record:
        if len(record.get("kept_layers", [])) != n:
            problems.append(f"config.layerswap.kept_layers has {len(record.get('kept_layers', []))} entries for {n} blocks")
        if len(record.get("kept_layers", [])) + len(record.get("removed_layers", [])) != record.get(
            "original_num_hidden_layers"
        ):
            problems.append("config.layerswap kept + removed != original_num_hidden_layers")
    return problems
