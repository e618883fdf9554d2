"""Swap-KL probes over a calibration set (No Free Swap, arXiv 2605.16234).

Every probe is a layer plan (:mod:`hf_layerswap.plan`) run through the model's own
forward with ``use_cache=False``. For each calibration batch the identity plan runs once;
it yields the reference next-token log-probabilities and the residual stream entering
every slot. A probe whose plan first differs from identity at slot s starts from the
cached stream entering s, so the unchanged prefix is never recomputed. The KL is
computed from fp32 log-softmax in chunks of positions, and only per-prompt sums are kept.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import nn

from .calibration import CalibrationSet, build_calibration
from .plan import (
    apply_plan,
    capture_residual_stream,
    first_difference,
    interchange_plan,
    num_blocks,
    removal_plan,
    replacement_plan,
)
from .report import PROTOCOLS, PairResult, SwapReport

__all__ = ["library_versions", "masked_kl", "model_identity", "plan_kl", "removal_kl", "score_layers"]

#: Positions per chunk when turning logits into KL (bounds temporary memory).
KL_CHUNK_POSITIONS = 256


def library_versions() -> dict:
    """Versions of the libraries that determine the numbers (for provenance)."""
    import transformers

    from . import __version__

    return {
        "hf_layerswap": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def model_identity(model: nn.Module) -> dict:
    """``{"name", "revision"}`` of a transformers model, as far as it is known."""
    cfg = getattr(model, "config", None)
    name = getattr(model, "name_or_path", None) or getattr(cfg, "_name_or_path", None) or type(model).__name__
    base = getattr(cfg, "layerswap_base_model", None)
    revision = getattr(cfg, "_commit_hash", None)
    out = {"name": str(name), "revision": revision, "class": type(model).__name__}
    if base:
        out["base_model"] = base
    return out


@torch.no_grad()
def masked_kl(ref_logprobs: torch.Tensor, logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-prompt mean KL(p_ref || p_mod) over real positions, in nats.

    Args:
        ref_logprobs: ``(B, T, V)`` float32 log-softmax of the reference logits.
        logits: ``(B, T, V)`` logits of the modified model (any float dtype; promoted to fp32).
        attention_mask: ``(B, T)``, 1 = real position.

    Returns:
        ``(B,)`` float64: for each prompt, the mean over its real positions of
        sum_v p_ref(v) (log p_ref(v) - log p_mod(v)). Per-position values are clamped at
        0 (they are >= 0 in exact arithmetic). NaN/inf propagate.

    Raises:
        ValueError: shape mismatch or a prompt with no real position.
    """
    if ref_logprobs.shape != logits.shape or attention_mask.shape != logits.shape[:2]:
        raise ValueError(
            f"shape mismatch: ref {tuple(ref_logprobs.shape)}, logits {tuple(logits.shape)}, "
            f"mask {tuple(attention_mask.shape)}"
        )
    bsz, seqlen, vocab = logits.shape
    mask = attention_mask.bool()
    counts = mask.sum(dim=1)
    if bool((counts == 0).any()):
        raise ValueError("a prompt has no real position (all padding)")
    rows = mask.reshape(-1).nonzero().squeeze(1)
    ref_flat = ref_logprobs.reshape(-1, vocab)
    mod_flat = logits.reshape(-1, vocab)
    prompt_of_row = rows // seqlen
    sums = torch.zeros(bsz, dtype=torch.float64)
    for start in range(0, rows.numel(), KL_CHUNK_POSITIONS):
        idx = rows[start : start + KL_CHUNK_POSITIONS]
        lp = ref_flat.index_select(0, idx)
        lq = torch.log_softmax(mod_flat.index_select(0, idx).float(), dim=-1)
        kl = (lp.exp() * (lp - lq)).sum(dim=-1).clamp_min(0.0)
        sums.index_add_(0, prompt_of_row[start : start + KL_CHUNK_POSITIONS], kl.double())
    return sums / counts.double()


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="probe", disable=not enabled, dynamic_ncols=True)


@torch.no_grad()
def plan_kl(
    model: nn.Module,
    calibration: CalibrationSet,
    plans: Mapping[Hashable, Sequence[int]],
    *,
    batch_size: int = 8,
    progress: bool = False,
    desc: str = "swap-KL",
) -> tuple[dict[Hashable, torch.Tensor], dict]:
    """Per-prompt KL(p_M || p_plan) for every plan, with prefix reuse.

    Args:
        model: a causal LM with L decoder blocks.
        calibration: the prompts (:func:`~hf_layerswap.calibration.build_calibration`).
        plans: probe name -> block plan (see :mod:`hf_layerswap.plan`).
        batch_size: prompts per forward pass.

    Returns:
        ``(values, stats)``: ``values[name]`` is a ``(N,)`` float64 tensor of per-prompt
        mean KL in nats; ``stats`` has ``forward_passes`` (calibration-set sweeps: one
        reference plus one per probe), ``block_evaluations`` (block forward calls over
        all batches) and ``seconds``.

    The model is left exactly as it was (blocks, ``layer_idx``, config, train/eval mode).
    """
    num_layers = num_blocks(model)
    plans = {name: list(plan) for name, plan in plans.items()}
    starts = {name: first_difference(plan, num_layers) for name, plan in plans.items()}
    values = {name: [] for name in plans}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    num_batches = math.ceil(calibration.num_prompts / batch_size)
    block_evals = 0
    bar = _progress_bar(num_batches * (1 + len(plans)), desc, progress)
    try:
        for ids, mask in calibration.batches(batch_size):
            ids, mask = ids.to(device), mask.to(device)
            streams, logits = capture_residual_stream(model, ids, mask, compute_logits=True)
            ref = torch.log_softmax(logits.float(), dim=-1)
            del logits
            block_evals += num_layers
            bar.update(1)
            for name, plan in plans.items():
                start = starts[name]
                if start >= len(plan) and len(plan) == num_layers:
                    values[name].append(torch.zeros(ids.shape[0], dtype=torch.float64))  # identity: exactly 0
                    bar.update(1)
                    continue
                start = min(start, len(plan) - 1)  # trailing blocks dropped: re-run the last kept one
                kwargs = {"start": start, "start_hidden": streams[start]} if start > 0 else {}
                with apply_plan(model, plan, **kwargs):
                    out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                values[name].append(masked_kl(ref, out, mask).cpu())
                block_evals += len(plan) - start
                del out
                bar.update(1)
            del ref, streams
    finally:
        bar.close()
        model.train(was_training)
    stats = {
        "forward_passes": 1 + len(plans),
        "block_evaluations": block_evals,
        "seconds": time.perf_counter() - t0,
    }
    return {name: torch.cat(v) for name, v in values.items()}, stats


def _mean_se(values: torch.Tensor) -> tuple[float, float | None]:
    mean = float(values.mean())
    if values.numel() < 2 or not math.isfinite(mean):
        return mean, None
    return mean, float(values.std(unbiased=True) / math.sqrt(values.numel()))


def _pair_list(num_layers: int, max_gap: int) -> list[tuple[int, int]]:
    if isinstance(max_gap, bool) or not isinstance(max_gap, int) or not 1 <= max_gap <= num_layers - 1:
        raise ValueError(f"max_gap={max_gap!r}: allowed 1..{num_layers - 1} (L-1 = all pairs) for {num_layers} blocks")
    return [(i, j) for i in range(num_layers) for j in range(i + 1, min(num_layers, i + max_gap + 1))]


def _calibration_from_args(model, calibration, tokenizer, num_prompts, seq_len, seed) -> CalibrationSet:
    if tokenizer is None and not isinstance(calibration, (Mapping, CalibrationSet)):
        tokenizer = getattr(model, "layerswap_tokenizer", None)
    return build_calibration(calibration, tokenizer, num_prompts=num_prompts, seq_len=seq_len, seed=seed)


def score_layers(
    model: nn.Module,
    calibration=None,
    *,
    tokenizer=None,
    protocols: Sequence[str] = PROTOCOLS,
    max_gap: int = 1,
    num_prompts: int = 64,
    seq_len: int = 128,
    batch_size: int = 8,
    progress: bool = True,
    seed: int = 0,
) -> SwapReport:
    """Score block pairs with the replacement and/or interchange swap-KL.

    Implements No Free Swap (arXiv 2605.16234) Def. 1 / Remark 1: for each pair
    ``1 <= j - i <= max_gap``, replacement runs two probes (slot i runs block j; slot j
    runs block i) and interchange one (slots i and j exchange blocks). Each value is
    E_x KL(p_M || p_probe) in nats: the mean over real tokens of each prompt, then over
    prompts, from fp32 log-softmax, temperature 1.

    Args:
        model: a transformers causal LM (decoder-only; multimodal text towers included).
        calibration: ``None``/``"embedded"`` (default prose shipped with Python), a text
            file path, a list of strings, a ``datasets.Dataset`` with a text column, a
            mapping with ``input_ids``/``attention_mask`` ``(B, T)`` long tensors, or a
            :class:`~hf_layerswap.calibration.CalibrationSet`.
        tokenizer: required for text sources.
        protocols: any of ``("replacement", "interchange")``.
        max_gap: pair distance bound (1 = adjacent pairs, L-1 = all pairs).
        num_prompts, seq_len, seed: calibration budget and paragraph shuffle seed.
        batch_size: prompts per forward pass.
        progress: show a progress bar with an ETA.

    Returns:
        A :class:`~hf_layerswap.report.SwapReport`.

    Raises:
        ValueError: an unknown protocol, ``max_gap`` outside ``1..L-1``, a model with
            fewer than 2 blocks, or bad calibration input (see ``build_calibration``).
    """
    protocols = tuple(dict.fromkeys(protocols))
    if not protocols or any(p not in PROTOCOLS for p in protocols):
        raise ValueError(f"protocols={protocols!r}: allowed a non-empty subset of {list(PROTOCOLS)}")
    num_layers = num_blocks(model)
    if num_layers < 2:
        raise ValueError(f"the model has {num_layers} block(s); swap tests need at least 2")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an int >= 1")
    pairs = _pair_list(num_layers, max_gap)
    calib = _calibration_from_args(model, calibration, tokenizer, num_prompts, seq_len, seed)
    plans: dict[tuple, list[int]] = {}
    for i, j in pairs:
        if "replacement" in protocols:
            plans[("replacement_ij", i, j)] = replacement_plan(num_layers, i, j)
            plans[("replacement_ji", i, j)] = replacement_plan(num_layers, j, i)
        if "interchange" in protocols:
            plans[("interchange", i, j)] = interchange_plan(num_layers, i, j)
    values, stats = plan_kl(model, calib, plans, batch_size=batch_size, progress=progress, desc="swap-KL probes")
    results = []
    for i, j in pairs:
        kw = {}
        for kind in ("replacement_ij", "replacement_ji", "interchange"):
            if (kind, i, j) in values:
                kw[kind], kw[f"{kind}_se"] = _mean_se(values[(kind, i, j)])
        results.append(PairResult(i, j, **kw))
    dtype = next(model.parameters()).dtype
    metadata = {
        "model": model_identity(model),
        "calibration": calib.spec(),
        "num_prompts": calib.num_prompts,
        "num_tokens": calib.num_tokens,
        "seq_len": calib.seq_len,
        "dtype": str(dtype).replace("torch.", ""),
        "softmax_dtype": "float32",
        "batch_size": batch_size,
        "seed": seed,
        "token_averaging": "mean over real tokens per prompt, then mean over prompts",
        "kl_direction": "KL(original || modified)",
        "prefix_reuse": True,
        "library_versions": library_versions(),
        **stats,
    }
    return SwapReport(num_layers, results, protocols=protocols, max_gap=max_gap, metadata=metadata)


def removal_kl(
    model: nn.Module,
    calibration,
    removed: Sequence[int] | Sequence[Sequence[int]],
    *,
    tokenizer=None,
    num_prompts: int = 64,
    seq_len: int = 128,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
):
    """Joint removal KL d_skip(S) = E_x KL(p_M || p_{M-S}) in nats.

    Args:
        removed: one set of 0-based block indices, or a list of sets (then a list of
            floats is returned, one per set, sharing the reference forward passes).
        calibration, tokenizer, num_prompts, seq_len, seed, batch_size: as in
            :func:`score_layers`.

    Returns:
        A float (one set) or a list of floats. The empty set gives exactly 0.0.

    Raises:
        ValueError: bad indices (out of range, duplicates) or a set leaving no block.
    """
    num_layers = num_blocks(model)
    single = len(removed) == 0 or all(isinstance(x, int) for x in removed)
    sets = [list(removed)] if single else [list(s) for s in removed]
    plans = {n: removal_plan(num_layers, s) for n, s in enumerate(sets)}
    calib = _calibration_from_args(model, calibration, tokenizer, num_prompts, seq_len, seed)
    values, _ = plan_kl(model, calib, plans, batch_size=batch_size, progress=progress, desc="removal KL")
    out = [float(values[n].mean()) for n in range(len(sets))]
    return out[0] if single else out
