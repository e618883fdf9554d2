"""The statistics behind every recovery fit: the ridge toward the identity, the cuts of a
removal set, the calibration rows used, streaming float64 moments and the one pass over
the calibration tokens that fills them (:func:`collect_moments`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..calibration import CalibrationSet
from ..utils.devices import input_device
from ..layerplan import capture_residual_stream, resolve_layer_indices

__all__ = [
    "block_down_proj", "check_epsilon", "collect_moments", "cut_boundaries", "fit_memory", "MAX_EPSILON", "model_family",
    "Moments", "POST_MLP_NORMS", "post_mlp_norm", "probe_additive_write", "quadratic_residual",
    "ridge_toward_identity", "select_rows",
]

# ----------------------------------------------------------------------------- algebra

#: Largest relative ridge ``epsilon`` of :func:`ridge_toward_identity` (2**52). The ridge is
#: ``λ = epsilon · trace(XᵀX) / H``, ``epsilon`` times the mean eigenvalue of ``XᵀX``; float64
#: carries 52 fraction bits, so from ``epsilon = 2**52`` on the mean eigenvalue is below the
#: rounding unit of ``λ`` in ``XᵀX + λI``: the fit is the identity map (plain removal) to
#: float64 precision, and far larger values overflow (``1e308 · trace = inf``).
MAX_EPSILON = 2.0**52


def check_epsilon(epsilon, label: str | None = None) -> float:
    """``epsilon`` as a float after checking it is a finite number in [0, :data:`MAX_EPSILON`].

    Args:
        label: how the message names the value (default ``"epsilon=<value>"``).

    Raises:
        ValueError: a bool, a non-number, a negative, non-finite or too large value; the
            message names the value and the allowed range.
    """
    label = label or f"epsilon={epsilon!r}"
    number = not isinstance(epsilon, bool) and isinstance(epsilon, (int, float))
    if not number or not (math.isfinite(epsilon) and 0 <= epsilon <= MAX_EPSILON):
        raise ValueError(
            f"{label}: must be a finite float >= 0 and at most 2**52 = {MAX_EPSILON:.4g} (lambda = epsilon * "
            "trace(X^T X) / H; beyond 2**52 the data term is below float64 rounding of lambda and the fit is the "
            "identity, i.e. plain removal)"
        )
    return float(epsilon)



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


def quadratic_residual(w: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor, target_sq: float) -> float:
    """``‖X W − Y‖_F²`` from ``XᵀX``, ``XᵀY`` and ``‖Y‖_F²`` (clamped at 0)."""
    value = float((w * (gram @ w)).sum()) - 2.0 * float((w * cross).sum()) + target_sq
    return max(value, 0.0)


# ----------------------------------------------------------------------------- cuts


def cut_boundaries(num_blocks: int, removed: Sequence[int]) -> list[dict]:
    """Group removed blocks into cuts (maximal runs of consecutive indices).

    Returns:
        One dict per cut, in order: ``removed`` (the run s..e-1), ``start`` s, ``end`` e
        (first kept block after it, or ``num_blocks``), ``host`` (s-1, or ``None`` for
        s = 0) and ``boundary`` (s minus the number of removed blocks before s: the slot
        of the pruned model where the map acts).
    """
    removed = resolve_layer_indices(removed, num_blocks, allow_empty=True)
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


#: Block attributes of a norm applied to the MLP output before it is added to the stream
#: (post-norm blocks, e.g. Gemma-2/3): a map folded into ``down_proj`` is then no map on the stream.
POST_MLP_NORMS = ("post_feedforward_layernorm", "post_mlp_layernorm")


def post_mlp_norm(block: nn.Module) -> str | None:
    """The name of ``block``'s norm on its MLP output (:data:`POST_MLP_NORMS`), ``None`` for a
    block that adds the MLP output to the stream unchanged."""
    return next((a for a in POST_MLP_NORMS if getattr(block, a, None) is not None), None)


def model_family(model: nn.Module) -> str:
    """The model's ``model_type`` (else its class name), as refusals name the family."""
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "model_type", None) or type(model).__name__)


def block_down_proj(model: nn.Module, blocks: nn.ModuleList, index: int) -> nn.Linear:
    """The ``mlp.down_proj`` ``nn.Linear`` of block ``index``; raises ``ValueError`` naming the family when it has none."""
    mlp = getattr(blocks[index], "mlp", None)
    down = getattr(mlp, "down_proj", None)
    if not isinstance(down, nn.Linear):
        found = type(down).__name__ if down is not None else ("no mlp.down_proj" if mlp is not None else "no mlp")
        raise ValueError(
            f"fused recovery folds the map into mlp.down_proj of the last kept block, but {model_family(model)} "
            f"block {index} ({type(blocks[index]).__name__}) has no mlp.down_proj nn.Linear (found: {found}); "
            "use method='ghosted'"
        )
    return down


# ----------------------------------------------------------------------------- statistics


class Moments:
    """Streaming float64 second moments of named row sets (and per-column sums, ``sums``).

    Args:
        device: where the sums are kept (``None``: where each product is computed; ``"cpu"``
            keeps them in host memory while the products run on an accelerator, so the
            device holds one product at a time: :func:`fit_memory`).
    """

    def __init__(self, device=None):
        self.device = None if device is None else torch.device(device)
        self.gram: dict = {}
        self.cross: dict = {}
        self.sq: dict = {}
        self.sums: dict = {}

    def _add(self, store: dict, key, value):
        if self.device is not None and isinstance(value, torch.Tensor):
            value = value.to(self.device)
        store[key] = value if key not in store else store[key] + value

    def add_gram(self, key, x):
        self._add(self.gram, key, x.T @ x)

    def add_cross(self, key, x, y):
        self._add(self.cross, key, x.T @ y)

    def add_sq(self, key, x):
        self._add(self.sq, key, float((x * x).sum()))

    def add_sum(self, key, x):
        """Add the column sums of the ``(N, H)`` rows ``x`` (an ``(H,)`` vector) under ``key``."""
        self._add(self.sums, key, x.sum(dim=0))


def fit_memory(calib: CalibrationSet, batch_size: int, num_tokens: int, *, slots: int, hidden: int,
               element_bytes: int, moment_bytes: int, activation, budget: int | None = None,
               accelerator: bool = False) -> dict:
    """The working memory of a repair's fit (:func:`collect_moments`) under ``budget`` bytes
    beyond the weights, and how the fit stays within it: the float64 moments kept in host
    memory when the fit computes on an accelerator and they do not fit beside a batch's
    captures (the device then holds one ``(H, H)`` float64 product at a time), then the
    prompts per batch halved (down to 1) until a batch's captures fit what remains.

    A batch's captures: the residual streams of ``slots`` slots over its positions (compute
    dtype, ``element_bytes``), their kept rows and one cut's difference in float64, one
    ``(H, H)`` float64 product and ``activation(positions, width)`` (one block's forward).

    Args:
        calib, batch_size, num_tokens: the fit's prompts (:func:`select_rows`).
        slots: stream slots the fit reads; hidden: H.
        moment_bytes: the moments' bytes (:meth:`~.methods.RecoveryMethod.moment_bytes`).
        activation: ``(positions, width) -> bytes`` of one block's forward.
        budget: bytes, or ``None`` (no budget: ``batch_size`` as given, moments where they
            are computed).
        accelerator: the fit computes on an accelerator (host memory can take the moments).

    Returns:
        ``{"batch_size", "capture_bytes", "moment_bytes", "moments_on_host", "device_bytes",
        "host_bytes", "within_budget"}``: ``device_bytes`` the fit's peak beyond the weights
        on its compute device, ``host_bytes`` what host memory holds.
    """
    product = 8 * hidden * hidden

    def captures(b: int) -> int:
        most = 0
        for ids, _, keep in select_rows(calib, b, num_tokens):
            kept = int(keep.sum())
            held = slots * ids.numel() * hidden * element_bytes + (slots + 1) * kept * hidden * 8
            most = max(most, held + product + activation(ids.shape[0], ids.shape[1]))
        return most

    batch, host = batch_size, False
    capture = captures(batch)
    if budget is not None:
        host = accelerator and capture + moment_bytes > budget
        beside = 0 if host else moment_bytes
        while batch > 1 and capture + beside > budget:
            batch = max(1, batch // 2)
            capture = captures(batch)
    device_bytes = capture + (0 if host else moment_bytes)
    return {"batch_size": batch, "capture_bytes": capture, "moment_bytes": moment_bytes, "moments_on_host": host,
            "device_bytes": device_bytes, "host_bytes": moment_bytes if host else 0,
            "within_budget": budget is None or device_bytes <= budget}


def select_rows(calib: CalibrationSet, batch_size: int, num_tokens: int):
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
def probe_additive_write(model, blocks, host: int, ids, mask) -> None:
    """Check that block ``host`` adds its ``mlp.down_proj`` output to the stream unchanged.

    Doubling the down_proj output must add exactly that output to the stream leaving the
    block; post-norm blocks (whose MLP write is a norm output) fail this.
    """
    down = block_down_proj(model, blocks, host)
    seen = {}

    def grab(module, args, output):
        seen["m"] = output.detach()

    def double(module, args, output):
        return output * 2

    device = input_device(model)
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
    keep = mask.bool().cpu()  # tensors of blocks on different devices meet on the CPU
    m = seen["m"].cpu()[keep].double()
    diff = (doubled[host + 1] - base[host + 1]).cpu()[keep].double()
    rel = float(torch.linalg.norm(diff - m) / torch.linalg.norm(m).clamp_min(1e-30))
    if rel > 0.5:
        extra = ""
        if any(hasattr(blocks[host], a) for a in POST_MLP_NORMS):
            extra = " (post-norm blocks: the MLP output passes through a norm before it is added)"
        raise ValueError(
            f"fused recovery needs blocks that add the mlp.down_proj output to the residual stream unchanged; "
            f"{model_family(model)} block {host} does not{extra} (relative mismatch {rel:.2f}), so a map folded "
            "into down_proj is not a map on the stream; use method='ghosted'"
        )


@torch.no_grad()
def collect_moments(model, blocks, cuts, method, calib, num_tokens, batch_size,
                    moments_device=None) -> tuple[Moments, int, int | None]:
    """One pass over the calibration tokens; returns the moments, tokens used and H
    (``moments_device``: where the moments are kept, :class:`Moments`).

    Every cut gets the squared norms of ``h_e`` (``("y", e)``) and of ``h_e - h_s``
    (``("delta", s)``); the rest is ``method``'s (:class:`~.methods.RecoveryMethod`):
    the extra stream slots it reads, the module outputs it taps and what it accumulates.
    """
    slots: set[int] = set()
    for cut in cuts:
        slots.update((cut["start"], cut["end"]))
        slots.update(method.slots(cut))
    moments = Moments(moments_device)
    used = 0
    hidden = None
    tapped: dict = {}
    handles = []

    def grabber(k):
        def hook(module, args, output):
            tapped[k] = output.detach()

        return hook

    for k, module in method.taps(model, blocks, cuts).items():
        handles.append(module.register_forward_hook(grabber(k)))
    try:
        # moments accumulate on the input embeddings' device: the streams and taps of blocks
        # on other devices (accelerate device maps, offload) are brought there
        device = input_device(model)
        for ids, mask, keep in select_rows(calib, batch_size, num_tokens):
            keep = keep.to(device)
            streams, _ = capture_residual_stream(model, ids.to(device), mask.to(device), slots=sorted(slots))
            rows = {s: streams[s].to(device)[keep].double() for s in slots}
            tapped.update({k: v.to(device) for k, v in tapped.items()})
            hidden = next(iter(rows.values())).shape[-1]
            used += int(keep.sum())
            for cut in cuts:
                s, e = cut["start"], cut["end"]
                delta = rows[e] - rows[s]
                moments.add_sq(("y", e), rows[e])
                moments.add_sq(("delta", s), delta)
                method.accumulate(moments, cut, rows, delta, tapped, keep)
            tapped.clear()
    finally:
        for h in handles:
            h.remove()
    return moments, used, hidden

