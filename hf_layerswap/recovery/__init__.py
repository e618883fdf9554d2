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
    kept block. Saved checkpoints carry it in :data:`~hf_layerswap.surgery.RECOVERY_FILE` next to the
    weights.

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
  operators attached writes :data:`~hf_layerswap.surgery.RECOVERY_FILE` (safetensors, float32, one ``(H, H)``
  tensor per boundary) and records the operators in ``config.layerswap["recovery"]``;
  config.json also gets a ``quantization_config`` marker with ``quant_method="layerswap"``.
- With ``hf_layerswap`` imported, ``from_pretrained(dir)`` sees that marker, runs the
  layerswap quantizer plugin, which calls :func:`~hf_layerswap.surgery.attach_saved_recovery`
  (logits identical to the saved model's). It also works on any loaded model.
- Plain transformers (without ``hf_layerswap``) loads the pruned model *without* the
  operators; the marker makes it log "Unknown quantization type, got layerswap ... we will
  skip the quantization". That is the only warning a config.json field can make plain
  transformers emit; the record in ``config.layerswap["recovery"]["loader"]`` and the model
  card say which loader the recovered quality needs.

Layout: :mod:`.fit` (ridge, cuts, moments, the calibration pass), :mod:`.methods` (the
registry and the built-in methods), :mod:`.report` (what was fitted), :mod:`.repair`
(:func:`recover`). The stream operators a repaired cut carries, and their file, belong to the
surgery that moves them with their blocks: :mod:`hf_layerswap.surgery.operators`.
"""

from __future__ import annotations

from .repair import DEFAULT_NUM_TOKENS, recover
from .fit import MAX_EPSILON, check_epsilon, cut_boundaries, ridge_toward_identity
from .methods import (
    DEFAULT_EPSILON,
    METHODS,
    RECOVERY_METHODS,
    RecoveryMethod,
    get_recovery_method,
    recovery_entry,
    register_recovery_method,
    search_objectives,
)
from .report import BoundaryFit, RecoveryReport
from ..utils.registry import import_package_modules

__all__ = [
    "DEFAULT_EPSILON",
    "DEFAULT_NUM_TOKENS",
    "MAX_EPSILON",
    "METHODS",
    "RECOVERY_METHODS",
    "BoundaryFit",
    "RecoveryMethod",
    "RecoveryReport",
    "check_epsilon",
    "cut_boundaries",
    "get_recovery_method",
    "recover",
    "recovery_entry",
    "register_recovery_method",
    "ridge_toward_identity",
    "search_objectives",
]

import_package_modules(__name__, __path__)  # a repair in a module of its own registers too
