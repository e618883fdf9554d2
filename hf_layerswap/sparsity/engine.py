"""Block-by-block calibration engine.

One real forward per calibration batch records, with forward pre-hooks, the exact
positional and keyword arguments every decoder block is called with (attention mask per
layer type, ``position_embeddings``, ``position_ids``, ...) and the residual stream
entering block 0. Blocks are then replayed directly on cached inputs with those
arguments and a new ``hidden_states``; this is how each block is calibrated on the
outputs of the already-pruned blocks before it (Wanda/SparseGPT's sequential flow,
without hard-coding any decoder's call signature).

Statistics only ever count real (non-pad) tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..layerplan import BlockCall, StopForward, decoder_blocks, split_hidden

__all__ = ["CalibrationCache", "capture_block_calls", "prunable_linears"]


@dataclass
class CalibrationCache:
    """Per batch: the real-token mask ``(B, T)`` bool, the stream entering block 0
    ``(B, T, H)`` and, per block, its :class:`BlockCall`."""

    token_masks: list[torch.Tensor]
    hidden: list[torch.Tensor]
    calls: list[list[BlockCall]]


def prunable_linears(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` inside a decoder block, as ``(name within block, module)``."""
    return [(name, m) for name, m in block.named_modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def capture_block_calls(
    model: nn.Module,
    batches,
    *,
    on_block_input: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    linear_hooks: Callable[[int, torch.Tensor], list] | None = None,
) -> CalibrationCache:
    """One dense forward per batch, recording every block's call and block 0's input.

    Args:
        model: a transformers causal LM.
        batches: iterable of ``(input_ids, attention_mask)``, each ``(B, T)``.
        on_block_input: called as ``f(block_index, hidden (B, T, H), token_mask (B, T))``
            for every block, e.g. to feed dense activation statistics.
        linear_hooks: ``f(block_index, token_mask_ref) -> handles``: registers extra hooks
            for the dense pass (removed afterwards); ``token_mask_ref`` is a one-element
            list holding the current batch's mask.

    The forward stops after the last block (no final norm, no LM head).
    """
    _, _, blocks = decoder_blocks(model)
    cache = CalibrationCache([], [], [])
    current: dict = {}
    mask_ref: list = [None]

    def pre_hook(index):
        def hook(module, args, kwargs):
            hidden, call = split_hidden(args, kwargs)
            current["calls"][index] = call
            if index == 0:
                current["hidden"] = hidden.detach()
            if on_block_input is not None:
                on_block_input(index, hidden, mask_ref[0])

        return hook

    def stop_hook(module, args, output):
        raise StopForward

    handles = [b.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles.append(blocks[-1].register_forward_hook(stop_hook))
    if linear_hooks is not None:
        for i in range(len(blocks)):
            handles.extend(linear_hooks(i, mask_ref))
    try:
        for ids, mask in batches:
            token_mask = mask.to(torch.bool)
            mask_ref[0] = token_mask
            current.clear()
            current["calls"] = [None] * len(blocks)
            try:
                model(input_ids=ids, attention_mask=mask, use_cache=False)
            except StopForward:
                pass
            cache.token_masks.append(token_mask)
            cache.hidden.append(current["hidden"])
            cache.calls.append(current["calls"])
    finally:
        for h in handles:
            h.remove()
    return cache


def real_rows(x: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T, C)`` activations -> ``(n_real, C)`` rows at real (non-pad) positions."""
    return x.reshape(-1, x.shape[-1])[token_mask.reshape(-1).to(x.device)]


def gradient_statistics(model: nn.Module, batches, block_weights: list[list[torch.Tensor]]) -> list[float]:
    """Mean ``|dL/dW|`` per block over its prunable weights, for the calibration loss.

    ``L`` is the mean next-token cross-entropy (nats) over every real target token of the
    calibration set (gradients accumulated over batches, weighted by their target counts).
    Only the listed weights get gradients; ``requires_grad`` flags and ``.grad`` are
    restored afterwards.

    Args:
        batches: list of ``(input_ids, attention_mask)``, each ``(B, T)``.
        block_weights: per block, the weights whose gradient is averaged.
    """
    params = list(model.parameters())
    saved = [(p, p.requires_grad, p.grad) for p in params]
    wanted = {id(w) for ws in block_weights for w in ws}
    targets = [int(mask[:, 1:].sum()) for _, mask in batches]
    total = sum(targets)
    try:
        for p in params:
            p.requires_grad_(id(p) in wanted)
            p.grad = None
        with torch.enable_grad():
            for (ids, mask), n in zip(batches, targets):
                labels = ids.masked_fill(mask == 0, -100)
                out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
                (out.loss * (n / total)).backward()
        return [
            float(sum(w.grad.double().abs().sum() for w in ws) / sum(w.numel() for w in ws)) for ws in block_weights
        ]
    finally:
        for p, flag, grad in saved:
            p.requires_grad_(flag)
            p.grad = grad
