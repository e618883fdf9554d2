"""Training-free recovery of a cut: a closed-form linear map on the residual stream.

Removing blocks hands the next kept block a residual stream it was never trained on. Two
repairs fitted in closed form on a calibration set, both on the *dense* model (before any
removal), float64 accumulation, pad positions excluded:

``"ghosted"`` (Ghosted Layers, arXiv 2605.15491)
    For each removed block p: X = residual stream entering p, Y = stream entering p+1
    (raw, before the input norm), both ``(N, H)`` over the N real calibration tokens.
    Solve ``(XᵀX + λI) M = Xᵀ(Y − X)`` and set ``W_p = I + M`` (a ridge toward the
    identity), with ``λ = epsilon · trace(XᵀX) / H``. Operators of adjacent removed blocks
    land at the same boundary and are multiplied into one matrix ``W = W_s W_{s+1} …``
    (row vectors: ``h ↦ h W``). The map acts on the *full* residual stream after the last
    kept block before the cut (before the first kept block when the cut starts at block 0).
    It cannot be folded into transformers weights (an anisotropic map changes the
    per-token RMS every later norm reads), so it stays a module: a forward hook on the
    kept block. Saved checkpoints carry it in :data:`RECOVERY_FILE` next to the weights.

``"fused"`` (ReplaceMe least-squares variant, arXiv 2505.02819)
    For each cut s..e-1 whose last kept block is k = s-1: with ``m`` = output of
    ``blocks[k].mlp.down_proj`` and ``Δ = h_e − h_s``, fit ``T = I + K`` with
    ``(mᵀm + λI) K = mᵀΔ`` (ridge toward the identity; ReplaceMe's own ridge shrinks
    toward 0), so that ``a_k + m T`` (``a_k`` = stream after block k's attention) best
    matches ``h_e``. T is folded into the weights: ``down_proj.weight ← Tᵀ W``
    (and ``bias ← Tᵀ b``), so the result is a plain transformers checkpoint. A cut
    starting at block 0 has no kept block before it; there the direct map ``h_0 ↦ h_0 W``
    (fitted like a ghosted operator on ``X = h_0, Y = h_e``) is folded into the input
    embedding matrix (untying a tied ``lm_head`` first). Post-norm blocks (Gemma-2/3,
    OLMo-2) normalise the MLP output before adding it to the stream, so a map on
    ``down_proj`` is not a map on the stream: they are refused, as are blocks without an
    ``mlp.down_proj`` ``nn.Linear`` (GPT-2, GPT-NeoX).

Fit residuals are relative: ``‖Ŷ − Y‖_F / ‖Y‖_F`` with ``Y = h_e`` (the stream the next
kept block saw in the dense model); "before" is plain removal (``Ŷ = h_s``).

Loading and saving ghosted checkpoints
--------------------------------------
The operators are not part of any transformers architecture, so:

- ``model.save_pretrained(dir)`` (and ``push_to_hub``, which calls it) on a model with
  operators attached writes :data:`RECOVERY_FILE` (safetensors, float32, one ``(H, H)``
  tensor per boundary) and records the operators in ``config.layerswap["recovery"]``;
  config.json also gets a ``quantization_config`` marker with ``quant_method="layerswap"``.
- With ``hf_layerswap`` imported, ``from_pretrained(dir)`` sees that marker, runs the
  layerswap quantizer plugin, which calls :func:`attach_saved_recovery` (logits identical
  to the saved model's). :func:`attach_saved_recovery` also works on any loaded model.
- Plain transformers (without ``hf_layerswap``) loads the pruned model *without* the
  operators; the marker makes it log "Unknown quantization type, got layerswap ... we will
  skip the quantization". That is the only warning a config.json field can make plain
  transformers emit; the record in ``config.layerswap["recovery"]["loader"]`` and the model
  card say which loader the recovered quality needs.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import types
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.utils import cached_file

from ..calibration import CalibrationSet, CalibrationShortfallWarning, build_calibration
from ..jsonio import JsonResult, atomic_path, decode_float, encode_float, write_json_atomic
from ..plan import capture_residual_stream, decoder_blocks, resolve_layer_indices
from ..surgery import remove_layers

__all__ = [
    "DEFAULT_EPSILON",
    "GhostedOperator",
    "METHODS",
    "RECOVERY_FILE",
    "BoundaryFit",
    "RecoveryReport",
    "attach_saved_recovery",
    "attached_operators",
    "cut_boundaries",
    "detach_recovery",
    "recover",
    "ridge_toward_identity",
    "save_recovery",
]

#: Recovery methods accepted by :func:`recover` (``"none"`` = plain removal, residuals only).
METHODS = ("none", "ghosted", "fused")
#: File written next to the weights of a checkpoint with ghosted operators.
RECOVERY_FILE = "layerswap_recovery.safetensors"
#: Default relative ridge per method, ``λ = ε · trace(XᵀX) / H`` (ridge toward the identity).
#: Chosen by held-out KL(dense || pruned), nats, on SmolLM2-135M (fit: 4,096 WikiText-2
#: validation tokens; KL: 8 WikiText-2 test paragraphs)::
#:
#:     removed    none    ghosted ε=0   1e-4   1e-3   1e-2    fused ε=1e-3   1e-1   0.3    1
#:     [20]       0.289   0.134        0.129  0.127  0.152    0.164          0.157  -      -
#:     [13, 20]   0.425   0.234        0.224  0.229  0.270    0.284          0.269  -      -
#:     [24, 25]   1.151   0.344        0.340  0.324  -        -              0.421  0.418  0.430
#:
#: Ghosted Layers' own absolute ε = 1e-6 is a no-op at these scales; a small relative
#: ridge tames the directions that only the attention-sink tokens excite.
DEFAULT_EPSILON = {"none": 0.0, "ghosted": 1e-3, "fused": 1e-1}
#: What the saved record tells a reader about loading a ghosted checkpoint.
LOADER_NOTE = (
    "ghosted operators live in {file}, outside the transformers weights: load with `import hf_layerswap` before "
    "`AutoModelForCausalLM.from_pretrained` (or call hf_layerswap.recovery.attach_saved_recovery(model, path)); "
    "plain transformers loads the pruned model without them (quality of plain removal)"
)
_OUT_ATTR = "ghosted_out"  # operator on a block's output
_IN_ATTR = "ghosted_in"  # operator on block 0's input (cut starting at block 0)
_FILE_FORMAT = "hf_layerswap.recovery/1"


# ----------------------------------------------------------------------------- algebra


def ridge_toward_identity(gram: torch.Tensor, cross: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, float, float]:
    """Closed-form ``W = I + M`` with ``(XᵀX + λI) M = XᵀY − XᵀX`` (Ghosted Layers' solve).

    Minimises ``‖X W − Y‖_F² + λ ‖W − I‖_F²``; with ``epsilon = 0`` it is ordinary least
    squares of Y on X.

    Args:
        gram: ``(H, H)`` float64 ``XᵀX``.
        cross: ``(H, H)`` float64 ``XᵀY``.
        epsilon: relative ridge, ``λ = epsilon · trace(XᵀX) / H`` (>= 0).

    Returns:
        ``(W, λ, condition number of XᵀX + λI)``; W is ``(H, H)`` float64.

    Raises:
        ValueError: ``XᵀX + λI`` is singular (fewer independent tokens than H with
            ``epsilon = 0``); the message says to raise ``epsilon`` or the token budget.
    """
    size = gram.shape[0]
    lam = float(epsilon) * float(torch.trace(gram)) / size
    eye = torch.eye(size, dtype=gram.dtype, device=gram.device)
    system = gram + lam * eye
    eig = torch.linalg.eigvalsh(system)
    # numerically singular: the smallest eigenvalue is at rounding level of the largest
    if not float(eig[0]) > size * torch.finfo(system.dtype).eps * float(eig[-1]):
        raise ValueError(
            f"XᵀX + λI is singular (λ={lam:g}, epsilon={epsilon:g}, eigenvalues {float(eig[0]):.3g}..{float(eig[-1]):.3g}): "
            f"the calibration tokens do not span the {size}-dimensional residual stream; use more calibration "
            "tokens or a larger epsilon"
        )
    m = torch.linalg.solve(system, cross - gram)
    return eye + m, lam, float(eig[-1] / eig[0])


def _quadratic_residual(w: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor, target_sq: float) -> float:
    """``‖X W − Y‖_F²`` from ``XᵀX``, ``XᵀY`` and ``‖Y‖_F²`` (clamped at 0)."""
    value = float((w * (gram @ w)).sum()) - 2.0 * float((w * cross).sum()) + target_sq
    return max(value, 0.0)


# ----------------------------------------------------------------------------- report


@dataclass
class BoundaryFit:
    """The fit at one cut.

    Attributes:
        boundary: residual-stream slot of the *pruned* model the map acts on (0-based):
            ``b = 0`` is the input of pruned block 0, ``b > 0`` the output of pruned block
            ``b − 1`` (``b = L'`` the output of the last block, before the final norm).
        removed: 0-based indices (in the model given to :func:`recover`) of the removed run.
        host: index (same numbering) of the last kept block before the cut; ``None`` when
            the cut starts at block 0.
        residual_before: ``‖h_s − h_e‖_F / ‖h_e‖_F`` (plain removal), over the calibration tokens.
        residual_after: ``‖Ŷ − h_e‖_F / ‖h_e‖_F`` with the fitted map; equals
            ``residual_before`` for method ``"none"``.
        condition_number: largest condition number of ``XᵀX + λI`` among this boundary's
            solves (``None`` for ``"none"``).
        ridge: the absolute λ of each solve at this boundary.
        folded_into: for ``"fused"``, the weight the map was folded into.
    """

    boundary: int
    removed: list[int]
    host: int | None
    residual_before: float
    residual_after: float
    condition_number: float | None = None
    ridge: list[float] = field(default_factory=list)
    folded_into: str | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("residual_before", "residual_after", "condition_number"):
            out[key] = encode_float(out[key])
        out["ridge"] = [encode_float(x) for x in self.ridge]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> BoundaryFit:
        d = dict(d)
        for key in ("residual_before", "residual_after", "condition_number"):
            d[key] = decode_float(d.get(key))
        d["ridge"] = [decode_float(x) for x in d.get("ridge", [])]
        return cls(**d)


@dataclass
class RecoveryReport(JsonResult):
    """What :func:`recover` fitted.

    Attributes:
        method: ``"none"``, ``"ghosted"`` or ``"fused"``.
        removed_layers: 0-based indices removed (numbering of the model given to :func:`recover`).
        epsilon: relative ridge (``λ = epsilon · trace(XᵀX) / H`` per solve).
        num_tokens: real calibration tokens used (every fit uses the same tokens).
        hidden_size: H.
        boundaries: one :class:`BoundaryFit` per cut, in order.
        calibration: the calibration set's :meth:`CalibrationSet.spec`.
    """

    method: str
    removed_layers: list[int]
    epsilon: float
    num_tokens: int
    hidden_size: int | None
    boundaries: list[BoundaryFit] = field(default_factory=list)
    calibration: dict | None = None

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "removed_layers": list(self.removed_layers),
            "epsilon": self.epsilon,
            "num_tokens": self.num_tokens,
            "hidden_size": self.hidden_size,
            "boundaries": [b.to_dict() for b in self.boundaries],
            "calibration": copy.deepcopy(self.calibration),
        }

    @classmethod
    def from_dict(cls, d: dict) -> RecoveryReport:
        d = dict(d)
        d["boundaries"] = [BoundaryFit.from_dict(b) for b in d.get("boundaries", [])]
        return cls(**d)


# ----------------------------------------------------------------------------- cuts


def cut_boundaries(num_layers: int, removed: Sequence[int]) -> list[dict]:
    """Group removed blocks into cuts (maximal runs of consecutive indices).

    Returns:
        One dict per cut, in order: ``removed`` (the run s..e-1), ``start`` s, ``end`` e
        (first kept block after it, or ``num_layers``), ``host`` (s-1, or ``None`` for
        s = 0) and ``boundary`` (s minus the number of removed blocks before s: the slot
        of the pruned model where the map acts).
    """
    removed = resolve_layer_indices(removed, num_layers, allow_empty=True)
    runs: list[list[int]] = []
    for p in removed:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    out = []
    for run in runs:
        start = run[0]
        before = sum(1 for p in removed if p < start)
        out.append(
            {
                "removed": run,
                "start": start,
                "end": run[-1] + 1,
                "host": start - 1 if start > 0 else None,
                "boundary": start - before,
            }
        )
    return out


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _model_family(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "model_type", None) or type(model).__name__)


def _down_proj(model: nn.Module, blocks: nn.ModuleList, index: int) -> nn.Linear:
    mlp = getattr(blocks[index], "mlp", None)
    down = getattr(mlp, "down_proj", None)
    if not isinstance(down, nn.Linear):
        found = type(down).__name__ if down is not None else ("no mlp.down_proj" if mlp is not None else "no mlp")
        raise ValueError(
            f"fused recovery folds the map into mlp.down_proj of the last kept block, but {_model_family(model)} "
            f"block {index} ({type(blocks[index]).__name__}) has no mlp.down_proj nn.Linear (found: {found}); "
            "use method='ghosted'"
        )
    return down


# ----------------------------------------------------------------------------- statistics


class _Moments:
    """Streaming float64 second moments of named row sets."""

    def __init__(self):
        self.gram: dict = {}
        self.cross: dict = {}
        self.sq: dict = {}

    @staticmethod
    def _add(store: dict, key, value):
        store[key] = value if key not in store else store[key] + value

    def add_gram(self, key, x):
        self._add(self.gram, key, x.T @ x)

    def add_cross(self, key, x, y):
        self._add(self.cross, key, x.T @ y)

    def add_sq(self, key, x):
        self._add(self.sq, key, float((x * x).sum()))


def _select_rows(calib: CalibrationSet, batch_size: int, num_tokens: int):
    """Batches covering the first ``num_tokens`` real tokens (prompt order, then position)."""
    remaining = num_tokens
    for ids, mask in calib.batches(batch_size):
        if remaining <= 0:
            return
        counts = mask.sum(dim=1)
        cum = counts.cumsum(0)
        rows = int((cum < remaining).sum()) + 1
        rows = min(rows, ids.shape[0])
        ids, mask = ids[:rows], mask[:rows].clone()
        keep = mask.bool()
        if int(mask.sum()) > remaining:  # truncate the last row's real tokens
            excess = int(mask.sum()) - remaining
            last = int(counts[rows - 1])
            keep[rows - 1, last - excess : last] = False
        remaining -= int(keep.sum())
        width = int(mask.sum(dim=1).max())
        yield ids[:, :width], mask[:, :width], keep[:, :width]


@torch.no_grad()
def _probe_additive_write(model, blocks, host: int, ids, mask) -> None:
    """Check that block ``host`` adds its ``mlp.down_proj`` output to the stream unchanged.

    Doubling the down_proj output must add exactly that output to the stream leaving the
    block; post-norm blocks (whose MLP write is a norm output) fail this.
    """
    down = _down_proj(model, blocks, host)
    seen = {}

    def grab(module, args, output):
        seen["m"] = output.detach()

    def double(module, args, output):
        return output * 2

    device = _model_device(model)
    ids, mask = ids.to(device), mask.to(device)
    handle = down.register_forward_hook(grab)
    try:
        base, _ = capture_residual_stream(model, ids, mask, slots=[host + 1])
    finally:
        handle.remove()
    handle = down.register_forward_hook(double)
    try:
        doubled, _ = capture_residual_stream(model, ids, mask, slots=[host + 1])
    finally:
        handle.remove()
    keep = mask.bool()
    m = seen["m"][keep].double()
    diff = (doubled[host + 1] - base[host + 1])[keep].double()
    rel = float(torch.linalg.norm(diff - m) / torch.linalg.norm(m).clamp_min(1e-30))
    if rel > 0.5:
        extra = ""
        if any(hasattr(blocks[host], a) for a in ("post_feedforward_layernorm", "post_mlp_layernorm")):
            extra = " (post-norm blocks: the MLP output passes through a norm before it is added)"
        raise ValueError(
            f"fused recovery needs blocks that add the mlp.down_proj output to the residual stream unchanged; "
            f"{_model_family(model)} block {host} does not{extra} (relative mismatch {rel:.2f}), so a map folded "
            "into down_proj is not a map on the stream; use method='ghosted'"
        )


@torch.no_grad()
def _collect(model, blocks, cuts, method, calib, num_tokens, batch_size) -> tuple[_Moments, int, int | None]:
    """One pass over the calibration tokens; returns the moments, tokens used and H."""
    slots: set[int] = set()
    for cut in cuts:
        slots.update((cut["start"], cut["end"]))
        if method == "ghosted":
            slots.update(range(cut["start"], cut["end"] + 1))
    fused_hosts = [c["host"] for c in cuts if method == "fused" and c["host"] is not None]
    moments = _Moments()
    used = 0
    hidden = None
    mlp_out: dict[int, torch.Tensor] = {}
    handles = []

    def grabber(k):
        def hook(module, args, output):
            mlp_out[k] = output.detach()

        return hook

    for k in fused_hosts:
        handles.append(_down_proj(model, blocks, k).register_forward_hook(grabber(k)))
    try:
        device = _model_device(model)
        for ids, mask, keep in _select_rows(calib, batch_size, num_tokens):
            keep = keep.to(device)
            streams, _ = capture_residual_stream(model, ids.to(device), mask.to(device), slots=sorted(slots))
            rows = {s: streams[s][keep].double() for s in slots}
            hidden = next(iter(rows.values())).shape[-1]
            used += int(keep.sum())
            for cut in cuts:
                s, e = cut["start"], cut["end"]
                delta = rows[e] - rows[s]
                moments.add_sq(("y", e), rows[e])
                moments.add_sq(("delta", s), delta)
                if method == "ghosted":
                    for p in cut["removed"]:
                        moments.add_gram(("h", p), rows[p])
                        moments.add_cross(("h", p, p + 1), rows[p], rows[p + 1])
                    if e != s + 1:
                        moments.add_cross(("h", s, e), rows[s], rows[e])
                elif method == "fused" and cut["host"] is None:
                    moments.add_gram(("h", s), rows[s])
                    moments.add_cross(("h", s, e), rows[s], rows[e])
                elif method == "fused":
                    m = mlp_out[cut["host"]][keep].double()
                    moments.add_gram(("m", s), m)
                    moments.add_cross(("m", s), m, delta)
            mlp_out.clear()
    finally:
        for h in handles:
            h.remove()
    return moments, used, hidden


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


def _attach(model: nn.Module, boundary: int, weight: torch.Tensor) -> GhostedOperator:
    _, _, blocks = decoder_blocks(model)
    if not 0 <= boundary <= len(blocks):
        raise ValueError(f"boundary {boundary} is out of range for a model with {len(blocks)} blocks: allowed 0..{len(blocks)}")
    block = blocks[0] if boundary == 0 else blocks[boundary - 1]
    attr = _IN_ATTR if boundary == 0 else _OUT_ATTR
    if isinstance(getattr(block, attr, None), GhostedOperator):
        raise ValueError(f"a ghosted operator is already attached at boundary {boundary}")
    ref = next(block.parameters(), None)
    op = GhostedOperator(weight, boundary)
    if ref is not None and ref.device.type != "meta":
        op.to(ref.device)
    setattr(block, attr, op)
    if boundary == 0:
        op._handle = block.register_forward_pre_hook(op.input_hook, with_kwargs=True, prepend=True)
    else:
        op._handle = block.register_forward_hook(op.output_hook, prepend=True)
    _install_save_hook(model)
    return op


def detach_recovery(model: nn.Module) -> int:
    """Remove every attached ghosted operator, its hook and the recovery record.

    The model becomes the plainly pruned model. Returns the number of operators removed.
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
    if isinstance(record, dict) and (record.get("recovery") or {}).get("method") == "ghosted":
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
            "save_pretrained(push_to_hub=True) uploads before the ghosted operators are written; "
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
    record = model.config.layerswap.setdefault("recovery", {})
    record.update(
        {
            "method": "ghosted",
            "file": RECOVERY_FILE,
            "boundaries": [b for b, _ in ops],
            "loader": LOADER_NOTE.format(file=RECOVERY_FILE),
        }
    )
    return record


def _marker(layerswap: dict) -> dict:
    """The ``quantization_config`` that routes a reload through the layerswap plugin
    (``layers`` records the removed original blocks; a pre-quantized reload prunes nothing)."""
    return {"quant_method": "layerswap", "recovery": "ghosted", "layers": list(layerswap.get("removed_layers") or [])}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_recovery(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write the attached ghosted operators next to a saved checkpoint.

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
        raise ValueError("no ghosted recovery operator is attached to this model; nothing to save")
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist: save the model (save_pretrained) before its operators")
    record = copy.deepcopy(_refresh_record(model, ops))
    tensors = {f"boundary_{b}": op.weight.detach().to("cpu", torch.float32).contiguous() for b, op in ops}
    metadata = {"format": _FILE_FORMAT, "method": "ghosted", "boundaries": json.dumps([b for b, _ in ops])}
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
    """Re-attach the ghosted operators of a saved checkpoint to its loaded model.

    Reads ``model.config.layerswap["recovery"]``; when it records ``method="ghosted"``,
    loads :data:`RECOVERY_FILE` from ``source`` (a checkpoint directory or Hub id; default
    ``model.name_or_path``) and attaches one operator per recorded boundary. A no-op
    (returns ``[]``) for models without a ghosted record, and idempotent: operators already
    attached are kept as they are. The layerswap plugin calls this on reload.

    Returns:
        The boundaries (pruned-model slots) now carrying an operator.

    Raises:
        FileNotFoundError: the record names a file that ``source`` does not have (e.g. the
            checkpoint was re-saved by plain transformers, which drops it).
        ValueError: the file does not match the record (boundaries, sha256, hidden size).
    """
    record = (getattr(model.config, "layerswap", None) or {}).get("recovery") or {}
    if record.get("method") != "ghosted":
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
            f"the checkpoint records ghosted recovery operators in {name}, but {source!r} has no such file "
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
    hidden = _hidden_size(model)
    for b, w in weights.items():
        if tuple(w.shape) != (hidden, hidden):
            raise ValueError(f"operator at boundary {b} in {path} has shape {tuple(w.shape)}, model hidden size {hidden}")
    for b in boundaries:
        _attach(model, b, weights[b])
    return boundaries


def _hidden_size(model) -> int:
    emb = model.get_input_embeddings()
    return int(emb.weight.shape[1])


# ----------------------------------------------------------------------------- recover


#: Most real calibration tokens a fit uses by default (Ghosted Layers' 65,536).
DEFAULT_NUM_TOKENS = 65536


def recover(
    model: nn.Module,
    removed: Sequence[int],
    calibration=None,
    *,
    method: str = "ghosted",
    num_tokens: int | None = None,
    tokenizer=None,
    epsilon: float | None = None,
    num_prompts: int | None = None,
    seq_len: int = 128,
    batch_size: int = 8,
    seed: int = 0,
) -> RecoveryReport:
    """Remove blocks from a dense model and repair each cut with a closed-form linear map.

    Args:
        model: the *dense* causal LM (before removal); modified in place: the blocks are
            removed with :func:`hf_layerswap.surgery.remove_layers` and the maps attached
            (``"ghosted"``) or folded into weights (``"fused"``).
        removed: 0-based indices of the blocks to remove (negative = from the end). An
            empty set changes nothing and returns an empty report.
        calibration: a :class:`CalibrationSet` or any source :func:`build_calibration`
            accepts (text file, list of strings, ``datasets.Dataset``, tensors mapping,
            ``None`` = embedded prose).
        method: ``"ghosted"`` (Ghosted Layers), ``"fused"`` (ReplaceMe-style, folded into
            ``down_proj``) or ``"none"`` (plain removal; fit residuals still reported).
        num_tokens: use at most this many real calibration tokens; ``None`` (default) =
            every real token of the calibration set, up to :data:`DEFAULT_NUM_TOKENS`
            (65,536, what Ghosted Layers uses). The report records how many were used. An
            explicit ``num_tokens`` the set cannot fill warns
            :class:`~hf_layerswap.calibration.CalibrationShortfallWarning` with both numbers
            and the record keeps ``requested_tokens``.
        tokenizer: needed for text calibration sources.
        epsilon: relative ridge toward the identity, ``λ = epsilon · trace(XᵀX) / H``
            (>= 0; recorded); ``None`` = :data:`DEFAULT_EPSILON` of the method.
        num_prompts, seq_len, seed: passed to :func:`build_calibration` for non-
            :class:`CalibrationSet` sources (``num_prompts=None``: ``2·num_tokens/seq_len``).
        batch_size: prompts per forward pass.

    Returns:
        A :class:`RecoveryReport` (also stored, as a dict, in
        ``model.config.layerswap["recovery"]`` for ``"ghosted"``/``"fused"``).

    Raises:
        ValueError: an unknown method, bad indices, ``num_tokens < 1``, ``epsilon < 0``,
            operators already attached (recover from the dense model instead), a family
            ``"fused"`` cannot fold into (the message names it), a singular system, or a
            model :func:`remove_layers` refuses. The model is unchanged when it raises.
        TypeError: a text calibration source without a tokenizer.
    """
    if method is None:
        method = "none"
    if method not in METHODS:
        raise ValueError(f"method={method!r}: allowed {list(METHODS)}")
    requested = num_tokens is not None
    if num_tokens is None:
        num_tokens = DEFAULT_NUM_TOKENS
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens!r}: must be an int >= 1 (or None for the whole calibration set)")
    if epsilon is None:
        epsilon = DEFAULT_EPSILON[method]
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon={epsilon!r}: must be a finite float >= 0")
    _, _, blocks = decoder_blocks(model)
    num_layers = len(blocks)
    removed = resolve_layer_indices(removed, num_layers, allow_empty=True)
    if not removed:
        return RecoveryReport(method, [], float(epsilon), 0, _hidden_size(model))
    if len(removed) >= num_layers:
        raise ValueError(f"removing {removed} would leave no block: at most {num_layers - 1} of {num_layers} can go")
    if attached_operators(model):
        raise ValueError(
            "this model already carries ghosted recovery operators; recover() fits on the dense model: "
            "start from the dense checkpoint (or detach_recovery(model) first)"
        )
    cuts = cut_boundaries(num_layers, removed)
    if method == "fused":
        for cut in cuts:
            if cut["host"] is not None:
                _down_proj(model, blocks, cut["host"])
    if not isinstance(calibration, CalibrationSet):
        if num_prompts is None:
            num_prompts = max(1, math.ceil(2 * num_tokens / seq_len))
        calibration = build_calibration(calibration, tokenizer, num_prompts=num_prompts, seq_len=seq_len, seed=seed)
    was_training = model.training
    model.eval()
    try:
        if method == "fused":
            first = next(_select_rows(calibration, min(batch_size, 2), num_tokens))
            for cut in cuts:
                if cut["host"] is not None:
                    _probe_additive_write(model, blocks, cut["host"], first[0], first[1])
        moments, used, hidden = _collect(model, blocks, cuts, method, calibration, num_tokens, batch_size)
    finally:
        model.train(was_training)
    if requested and used < num_tokens and method != "none":
        warnings.warn(
            CalibrationShortfallWarning(
                f"recovery fitted on {used:,} calibration tokens, fewer than the {num_tokens:,} requested "
                f"(num_tokens): the calibration set holds no more ({calibration.num_prompts} prompts); pass a larger "
                "source or num_prompts"
            ),
            stacklevel=2,
        )
    if hidden is not None and used < hidden and method != "none":
        warnings.warn(
            f"recovery fitted on {used} calibration tokens, fewer than the hidden size {hidden}: XᵀX is rank "
            "deficient and the ridge (epsilon) decides the map; use more calibration tokens",
            stacklevel=2,
        )

    fits, maps = _fit(moments, cuts, method, float(epsilon))
    report = RecoveryReport(method, removed, float(epsilon), used, hidden, fits, calibration.spec())

    # everything that can fail has run; now change the model
    old_record = copy.deepcopy((getattr(model.config, "layerswap", None) or {}).get("recovery"))
    host_modules = {cut["boundary"]: (blocks[cut["host"]] if cut["host"] is not None else None) for cut in cuts}
    remove_layers(model, removed, provenance={"recovery": method})
    if method == "fused":
        _fold(model, cuts, maps, host_modules)
    elif method == "ghosted":
        for cut in cuts:
            _attach(model, cut["boundary"], maps[cut["boundary"]])
    if method != "none":
        record = {
            "method": method,
            "boundaries": [c["boundary"] for c in cuts],
            "removed_layers": removed,
            "removed_original_layers": model.config.layerswap["steps"][-1]["removed_original_layers"],
            "epsilon": float(epsilon),
            "epsilon_rule": "lambda = epsilon * trace(X^T X) / H, ridge toward the identity",
            "num_tokens": used,
            **({"requested_tokens": num_tokens} if requested and used < num_tokens else {}),
            "residual_before": [encode_float(f.residual_before) for f in fits],
            "residual_after": [encode_float(f.residual_after) for f in fits],
            "calibration": calibration.spec(),
        }
        if method == "ghosted":
            record.update({"file": RECOVERY_FILE, "loader": LOADER_NOTE.format(file=RECOVERY_FILE)})
        else:
            record["folded_into"] = [f.folded_into for f in fits]
        if old_record:
            record["previous"] = old_record
        model.config.layerswap["recovery"] = record
    return report


def _fit(moments: _Moments, cuts, method: str, epsilon: float) -> tuple[list[BoundaryFit], dict]:
    """Solve every map from the moments (on the CPU, float64); maps are keyed by boundary."""
    moments.gram = {k: v.cpu() for k, v in moments.gram.items()}
    moments.cross = {k: v.cpu() for k, v in moments.cross.items()}
    fits, maps = [], {}
    for cut in cuts:
        s, e, b = cut["start"], cut["end"], cut["boundary"]
        y_sq = moments.sq[("y", e)]
        y_norm = math.sqrt(y_sq) if y_sq > 0 else math.nan
        before = math.sqrt(moments.sq[("delta", s)]) / y_norm
        fit = BoundaryFit(b, list(cut["removed"]), cut["host"], before, before)
        if method == "ghosted":
            total, conds = None, []
            for p in cut["removed"]:
                w, lam, cond = ridge_toward_identity(moments.gram[("h", p)], moments.cross[("h", p, p + 1)], epsilon)
                total = w if total is None else total @ w
                fit.ridge.append(lam)
                conds.append(cond)
            cross = moments.cross[("h", s, e)] if e != s + 1 else moments.cross[("h", s, s + 1)]
            after = _quadratic_residual(total, moments.gram[("h", s)], cross, y_sq)
            fit.condition_number = max(conds)
            maps[b] = total.to(torch.float32)
        elif method == "fused" and cut["host"] is None:
            w, lam, cond = ridge_toward_identity(moments.gram[("h", s)], moments.cross[("h", s, e)], epsilon)
            after = _quadratic_residual(w, moments.gram[("h", s)], moments.cross[("h", s, e)], y_sq)
            fit.ridge, fit.condition_number, fit.folded_into = [lam], cond, "embed_tokens"
            maps[b] = w
        elif method == "fused":
            gram, cross = moments.gram[("m", s)], moments.cross[("m", s)]
            # T = I + K with (mᵀm + λI) K = mᵀΔ: the same solve with XᵀY := mᵀΔ + mᵀm
            t, lam, cond = ridge_toward_identity(gram, cross + gram, epsilon)
            k = t - torch.eye(t.shape[0], dtype=t.dtype)
            after = _quadratic_residual(k, gram, cross, moments.sq[("delta", s)])
            fit.ridge, fit.condition_number = [lam], cond
            fit.folded_into = f"layers.{cut['boundary'] - 1}.mlp.down_proj"
            maps[b] = t
        else:
            fits.append(fit)
            continue
        fit.residual_after = math.sqrt(after) / y_norm
        fits.append(fit)
    return fits, maps


@torch.no_grad()
def _fold(model, cuts, maps, host_modules) -> None:
    """Fold fused maps into weights (float64 products, cast to the weight dtype)."""
    for cut in cuts:
        t = maps[cut["boundary"]]
        host = host_modules[cut["boundary"]]
        if host is None:
            emb = model.get_input_embeddings()
            out = model.get_output_embeddings()
            if out is not None and out.weight is emb.weight:
                out.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=emb.weight.requires_grad)
                for cfg in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
                    cfg.tie_word_embeddings = False
            w = emb.weight
            w.copy_((w.double() @ t.to(w.device)).to(w.dtype))
            continue
        down = host.mlp.down_proj
        w = down.weight  # (H, d_ff): output = z Wᵀ; new output = z Wᵀ T = z (Tᵀ W)ᵀ
        tt = t.T.to(w.device)
        w.copy_((tt @ w.double()).to(w.dtype))
        if down.bias is not None:
            down.bias.copy_((tt @ down.bias.double()).to(down.bias.dtype))
