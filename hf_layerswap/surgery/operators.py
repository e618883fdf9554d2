"""Repair operators: the fixed residual-stream maps left on a model by ``"ghosted"``
recovery (and by ``"linearpatch"`` at the cuts it cannot fold), how they are attached and
detached, and how a checkpoint carries them (:data:`RECOVERY_FILE`, :func:`save_recovery`,
:func:`attach_saved_recovery`). The methods whose repair is these operators are listed in
:data:`OPERATOR_METHODS`; the record ``config.layerswap["recovery"]["method"]`` says which one
made the operators of a model (:func:`operator_method`)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import types
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.utils import cached_file

from ..utils.devices import execution_device
from ..utils.jsonio import atomic_path, write_json_atomic
from ..layerplan import decoder_blocks, model_hidden_size

__all__ = [
    "attach_operator", "attach_saved_recovery", "attached_operators", "carried_operators", "detach_recovery",
    "GhostedOperator", "HAND_ATTACHED_METHOD", "LOADER_NOTE", "OPERATOR_METHODS", "operator_method", "RECOVERY_FILE", "save_recovery",
    "take_operators",
]

#: File written next to the weights of a checkpoint with repair operators.
RECOVERY_FILE = "layerswap_recovery.safetensors"
#: What the saved record tells a reader about loading a checkpoint with operators.
LOADER_NOTE = (
    "{method} operators live in {file}, outside the transformers weights: load with `import hf_layerswap` before "
    "`AutoModelForCausalLM.from_pretrained` (or call hf_layerswap.surgery.attach_saved_recovery(model, path)); "
    "plain transformers loads the pruned model without them (quality of plain removal)"
)
_OUT_ATTR = "ghosted_out"  # operator on a block's output
_IN_ATTR = "ghosted_in"  # operator on block 0's input (cut starting at block 0)
_FILE_FORMAT = "hf_layerswap.recovery/1"
#: The recovery methods whose repair is these operators: every method registered with
#: ``stream_operators = True`` is added here when it is registered (``"ghosted"``,
#: ``"linearpatch"`` and any registered later).
OPERATOR_METHODS: set[str] = set()
#: The method that operators attached by hand (:func:`attach_operator`, no record) are recorded
#: as: Ghosted Layers', whose operator :class:`GhostedOperator` is.
HAND_ATTACHED_METHOD = "ghosted"



# ----------------------------------------------------------------------------- operators


class GhostedOperator(nn.Module):
    """A fixed ``(H, H)`` map on the residual stream: ``h ↦ h W`` (row vectors).

    The matrix is a float32, non-persistent buffer: it moves with ``model.to(device)``,
    stays float32 under ``model.to(dtype)``/``.half()`` and never enters the transformers
    state dict (it is saved separately, see :func:`save_recovery`). The product is computed
    in float32 and cast back to the stream's dtype (as in Ghosted Layers' reference code).
    """

    def __init__(self, weight: torch.Tensor, boundary: int):
        super().__init__()
        if weight.dim() != 2 or weight.shape[0] != weight.shape[1]:
            raise ValueError(f"a ghosted operator must be a square (H, H) matrix, got shape {tuple(weight.shape)}")
        self.boundary = int(boundary)
        self.register_buffer("weight", weight.detach().to(torch.float32).clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        kept = self.weight
        super()._apply(fn, recurse)
        self.weight = kept.to(device=self.weight.device, dtype=torch.float32)
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight.device == hidden.device else self.weight.to(hidden.device)
        return (hidden.float() @ weight).to(hidden.dtype)

    def extra_repr(self) -> str:
        return f"boundary={self.boundary}, hidden_size={self.weight.shape[0]}"

    # hooks are bound methods so that copy.deepcopy(model) binds them to the copied operator
    def output_hook(self, module, args, output):
        if isinstance(output, torch.Tensor):
            return self(output)
        if isinstance(output, (tuple, list)):
            return type(output)([self(output[0]), *output[1:]])
        raise TypeError(f"cannot apply a ghosted operator to a block output of type {type(output).__name__}")

    def input_hook(self, module, args, kwargs):
        if args:
            return (self(args[0]), *args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = self(kwargs["hidden_states"])
        return args, kwargs


def attached_operators(model: nn.Module) -> list[tuple[int, GhostedOperator]]:
    """``[(boundary, operator), ...]`` currently attached, by boundary (pruned-model slots).

    The boundary is derived from where the operator sits: ``ghosted_in`` on block 0 acts at
    slot 0, ``ghosted_out`` on block k at slot k+1.
    """
    _, _, blocks = decoder_blocks(model)
    found = []
    for k, block in enumerate(blocks):
        op = getattr(block, _IN_ATTR, None)
        if isinstance(op, GhostedOperator):
            found.append((k, op))
        op = getattr(block, _OUT_ATTR, None)
        if isinstance(op, GhostedOperator):
            found.append((k + 1, op))
    return sorted(found, key=lambda t: t[0])


def operator_method(model: nn.Module) -> str:
    """The recovery method whose operators ``model`` carries: the method of its record
    ``config.layerswap["recovery"]`` when that is one of :data:`OPERATOR_METHODS`, else
    :data:`HAND_ATTACHED_METHOD`."""
    record = (getattr(model.config, "layerswap", None) or {}).get("recovery") or {}
    method = record.get("method") if isinstance(record, dict) else None
    return method if method in OPERATOR_METHODS else HAND_ATTACHED_METHOD


def attach_operator(model: nn.Module, boundary: int, weight: torch.Tensor) -> GhostedOperator:
    """Attach a :class:`GhostedOperator` ``I + M`` (``weight``: ``(H, H)``) at ``boundary`` (0..L) and return it; raises ``ValueError`` out of range or when one is attached there already."""
    _, _, blocks = decoder_blocks(model)
    if not 0 <= boundary <= len(blocks):
        raise ValueError(f"boundary {boundary} is out of range for a model with {len(blocks)} blocks: allowed 0..{len(blocks)}")
    block = blocks[0] if boundary == 0 else blocks[boundary - 1]
    attr = _IN_ATTR if boundary == 0 else _OUT_ATTR
    if isinstance(getattr(block, attr, None), GhostedOperator):
        raise ValueError(f"a ghosted operator is already attached at boundary {boundary}")
    op = GhostedOperator(weight, boundary).to(execution_device(block))
    setattr(block, attr, op)
    if boundary == 0:
        op._handle = block.register_forward_pre_hook(op.input_hook, with_kwargs=True, prepend=True)
    else:
        op._handle = block.register_forward_hook(op.output_hook, prepend=True)
    _install_save_hook(model)
    return op


def take_operators(model: nn.Module) -> dict[int, torch.Tensor]:
    """Detach every attached operator (hooks and modules) and return ``{boundary: weight}``
    (float32 ``(H, H)``); unlike :func:`detach_recovery` the recovery record and the save
    hook stay, for :func:`carried_operators` to put the maps back after a removal."""
    ops = attached_operators(model)
    for _, op in ops:
        op._handle.remove()
    _, _, blocks = decoder_blocks(model)
    for block in blocks:
        for attr in (_IN_ATTR, _OUT_ATTR):
            if isinstance(getattr(block, attr, None), GhostedOperator):
                delattr(block, attr)
    return {b: op.weight for b, op in ops}


def carried_operators(ops: dict[int, torch.Tensor], kept: Sequence[int]) -> dict[int, torch.Tensor]:
    """Where ghosted operators go when blocks are removed, so that the result is exactly the
    repaired model with those blocks skipped.

    Boundary ``b`` (the residual stream between blocks ``b-1`` and ``b``) becomes boundary
    ``#{k in kept : k < b}``. Operators whose boundaries meet (the blocks between them are
    all removed) become their product in stream order: ``h W_a W_b`` for ``a < b``.

    Args:
        ops: ``{boundary: (H, H) weight}`` before the removal.
        kept: the 0-based indices of the blocks that stay, ascending.

    Returns:
        ``{new boundary: (H, H) weight}``.
    """
    out: dict[int, torch.Tensor] = {}
    for b in sorted(ops):
        new = sum(1 for k in kept if k < b)
        out[new] = out[new] @ ops[b] if new in out else ops[b]
    return out


def detach_recovery(model: nn.Module) -> int:
    """Remove every attached repair operator, its hook and the recovery record.

    The model becomes the plainly pruned model. Returns the number of operators removed. A
    record that also names maps folded into the weights (``"linearpatch"``'s
    ``folded_boundaries``) is kept for those, without the operators.
    """
    _, _, blocks = decoder_blocks(model)
    count = 0
    for block in blocks:
        for attr in (_IN_ATTR, _OUT_ATTR):
            op = getattr(block, attr, None)
            if isinstance(op, GhostedOperator):
                op._handle.remove()
                delattr(block, attr)
                count += 1
    vars(model).pop("save_pretrained", None)
    record = getattr(model.config, "layerswap", None)
    recovery = record.get("recovery") if isinstance(record, dict) else None
    if isinstance(recovery, dict) and recovery.get("method") in OPERATOR_METHODS:
        if recovery.get("folded_boundaries"):
            for key in ("file", "loader", "sha256"):
                recovery.pop(key, None)
            recovery["boundaries"] = []
        else:
            record.pop("recovery")
    return count


# ----------------------------------------------------------------------------- save / load


def _install_save_hook(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` (and ``push_to_hub``, which calls it) also write the
    operators. The override is an instance attribute; :func:`detach_recovery` removes it."""
    if "save_pretrained" not in vars(model):
        model.save_pretrained = types.MethodType(_save_pretrained_with_recovery, model)


def _save_pretrained_with_recovery(self, save_directory, *args, **kwargs):
    if kwargs.get("push_to_hub"):
        raise ValueError(
            "save_pretrained(push_to_hub=True) uploads before the repair operators are written; "
            "call model.push_to_hub(repo_id) instead (it includes them)"
        )
    ops = attached_operators(self)
    if ops:
        _refresh_record(self, ops)
    out = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    if ops and kwargs.get("is_main_process", True):
        save_recovery(self, save_directory)
    return out


def _refresh_record(model, ops) -> dict:
    """Bring ``config.layerswap["recovery"]`` in line with the operators actually attached."""
    if not isinstance(getattr(model.config, "layerswap", None), dict):
        model.config.layerswap = {}
    method = operator_method(model)
    record = model.config.layerswap.setdefault("recovery", {})
    record.update(
        {
            "method": method,
            "file": RECOVERY_FILE,
            "boundaries": [b for b, _ in ops],
            "loader": LOADER_NOTE.format(method=method, file=RECOVERY_FILE),
        }
    )
    return record


def _marker(layerswap: dict) -> dict:
    """The ``quantization_config`` that routes a reload through the layerswap plugin
    (``layers`` records the removed original blocks; a pre-quantized reload prunes nothing)."""
    method = (layerswap.get("recovery") or {}).get("method")
    return {"quant_method": "layerswap", "recovery": method if method in OPERATOR_METHODS else HAND_ATTACHED_METHOD,
            "layers": list(layerswap.get("removed_layers") or [])}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_recovery(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write the attached repair operators next to a saved checkpoint.

    Writes ``directory/`` :data:`RECOVERY_FILE` (safetensors; tensor ``boundary_{b}`` is
    the float32 ``(H, H)`` map at pruned-model slot b) and updates ``config.json`` there:
    ``layerswap.recovery`` (method, file, boundaries, sha256 of the file, epsilon, loader
    note) and the ``quantization_config`` marker (``quant_method="layerswap"``) that makes
    ``from_pretrained`` run the layerswap plugin (re-attach) and plain transformers warn.
    Both files are written through a temporary file and renamed.
    ``model.save_pretrained(dir)`` calls this automatically when operators are attached.

    Returns:
        The path of the operator file.

    Raises:
        ValueError: no operator is attached.
        FileNotFoundError: ``directory`` has no ``config.json`` (save the model first).
    """
    ops = attached_operators(model)
    if not ops:
        raise ValueError("no recovery operator is attached to this model; nothing to save")
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist: save the model (save_pretrained) before its operators")
    record = copy.deepcopy(_refresh_record(model, ops))
    tensors = {f"boundary_{b}": op.weight.detach().to("cpu", torch.float32).contiguous() for b, op in ops}
    metadata = {"format": _FILE_FORMAT, "method": record["method"], "boundaries": json.dumps([b for b, _ in ops])}
    target = directory / RECOVERY_FILE
    with atomic_path(target) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        digest = _sha256(tmp)
    record["sha256"] = digest
    model.config.layerswap["recovery"]["sha256"] = digest
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.setdefault("layerswap", {})["recovery"] = record
    config["quantization_config"] = _marker(config["layerswap"])
    write_json_atomic(config, config_path)
    return target


def attach_saved_recovery(model: nn.Module, source: str | os.PathLike | None = None, *, revision: str | None = None) -> list[int]:
    """Re-attach the repair operators of a saved checkpoint to its loaded model.

    Reads ``model.config.layerswap["recovery"]``; when it records a method of
    :data:`OPERATOR_METHODS` (``"ghosted"``, ``"linearpatch"``) with operators,
    loads :data:`RECOVERY_FILE` from ``source`` (a checkpoint directory or Hub id; default
    ``model.name_or_path``) and attaches one operator per recorded boundary. A no-op
    (returns ``[]``) for models without such a record, and idempotent: operators already
    attached are kept as they are. The layerswap plugin calls this on reload.

    Returns:
        The boundaries (pruned-model slots) now carrying an operator.

    Raises:
        FileNotFoundError: the record names a file that ``source`` does not have (e.g. the
            checkpoint was re-saved by plain transformers, which drops it).
        ValueError: the file does not match the record (boundaries, sha256, hidden size).
    """
    record = (getattr(model.config, "layerswap", None) or {}).get("recovery") or {}
    method = record.get("method")
    if method not in OPERATOR_METHODS or ("file" not in record and not record.get("boundaries")):
        return []
    present = attached_operators(model)
    if present:
        return [b for b, _ in present]
    name = record.get("file", RECOVERY_FILE)
    source = source if source is not None else (getattr(model, "name_or_path", None) or model.config._name_or_path)
    path = None
    if source:
        candidate = Path(source) / name
        if candidate.is_file():
            path = candidate
        else:
            resolved = cached_file(
                str(source),
                name,
                revision=revision or getattr(model.config, "_commit_hash", None),
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
            )
            path = Path(resolved) if resolved else None
    if path is None:
        raise FileNotFoundError(
            f"the checkpoint records {method} recovery operators in {name}, but {source!r} has no such file "
            "(a checkpoint re-saved by plain transformers loses it; a checkpoint loaded from a subfolder, cache_dir "
            "or revision needs them passed as source/revision). To use the plainly pruned model, load it "
            "without hf_layerswap imported, or delete 'quantization_config' and 'layerswap.recovery' from its "
            "config.json"
        )
    if record.get("sha256") and _sha256(path) != record["sha256"]:
        raise ValueError(f"{path} does not match the sha256 recorded in config.layerswap.recovery")
    boundaries = [int(b) for b in record.get("boundaries", [])]
    with safe_open(str(path), framework="pt") as fh:
        keys = set(fh.keys())
        expected = {f"boundary_{b}" for b in boundaries}
        if keys != expected:
            raise ValueError(f"{path} holds {sorted(keys)} but the config records boundaries {boundaries}")
        weights = {b: fh.get_tensor(f"boundary_{b}") for b in boundaries}
    hidden = model_hidden_size(model)
    for b, w in weights.items():
        if tuple(w.shape) != (hidden, hidden):
            raise ValueError(f"operator at boundary {b} in {path} has shape {tuple(w.shape)}, model hidden size {hidden}")
    for b in boundaries:
        attach_operator(model, b, weights[b])
    return boundaries


